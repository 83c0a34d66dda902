"""SIGTERM in the `mlxkv` command (`mlxkv.cli.main`): wherever it lands, cleanups run and the
process then dies by the signal, as its caller (systemd, `docker stop`) expects."""

import argparse
import signal

import pytest

import mlxkv.cli as cli


class _StopsOnWrite:
    """A stderr that the signal reaches while `main` writes its one-line error."""

    def write(self, text: str) -> int:
        cli._raise_terminated(signal.SIGTERM, None)
        return len(text)

    def flush(self) -> None:
        pass


def _failing(args: argparse.Namespace) -> int:
    raise ValueError("no such model")


def test_a_signal_inside_the_error_handler_still_ends_by_the_signal(monkeypatch):
    """A SIGTERM landing while `main` printed an error (inside its `except`) escaped as an
    uncaught exception with a traceback and exit status 1, not death by the signal."""
    raised = []
    parser = argparse.ArgumentParser()
    parser.set_defaults(run=_failing, verbose=0)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(cli, "setup_logging", lambda verbose: None)
    monkeypatch.setattr(cli.signal, "raise_signal", raised.append)
    monkeypatch.setattr(cli.sys, "stderr", _StopsOnWrite())
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(cli._Terminated):
        cli.main([])
    assert raised == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) == before
