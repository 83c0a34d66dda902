"""SIGTERM in the `mlxkv` command (`mlxkv.cli.main`): wherever it lands, cleanups run and the
process then dies by the signal, as its caller (systemd, `docker stop`) expects; a raise that
Python loses (in a finalizer) still ends the command, or stops the server."""

import argparse
import signal
import sys

import pytest

import mlxkv.cli as cli
from mlxkv.cli import stopping


class _StopsOnWrite:
    """A stderr that the signal reaches while `main` writes its one-line error."""

    def write(self, text: str) -> int:
        stopping.raise_terminated(signal.SIGTERM, None)
        return len(text)

    def flush(self) -> None:
        pass


class _LosesTheSignal:
    """An object whose finalizer the signal reaches: Python prints its raise as "Exception
    ignored" and goes on."""

    def __del__(self) -> None:
        stopping.raise_terminated(signal.SIGTERM, None)


def _failing(args: argparse.Namespace) -> int:
    raise ValueError("no such model")


def _loses_a_signal(args: argparse.Namespace) -> int:
    _LosesTheSignal()
    return 0


def _command(monkeypatch, run) -> list[int]:
    """`main` will run `run`; the signals it would die by are recorded instead."""
    raised: list[int] = []
    parser = argparse.ArgumentParser()
    parser.set_defaults(run=run, verbose=0)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(cli, "setup_logging", lambda verbose: None)
    monkeypatch.setattr(cli.signal, "raise_signal", raised.append)
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    return raised


def test_a_signal_inside_the_error_handler_still_ends_by_the_signal(monkeypatch):
    """A SIGTERM landing while `main` printed an error (inside its `except`) escaped as an
    uncaught exception with a traceback and exit status 1, not death by the signal."""
    raised = _command(monkeypatch, _failing)
    monkeypatch.setattr(cli.sys, "stderr", _StopsOnWrite())
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(stopping.Terminated):
        cli.main([])
    assert raised == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) == before


def test_a_signal_lost_in_a_finalizer_still_ends_the_command(monkeypatch):
    """The command ran to its end (its raise swallowed where it landed): it then ends by the
    signal, instead of exiting 0 as if none had come."""
    raised = _command(monkeypatch, _loses_a_signal)
    with pytest.raises(stopping.Terminated):
        cli.main([])
    assert raised == [signal.SIGTERM]


def test_a_command_after_a_lost_signal_is_not_ended_by_it(monkeypatch):
    _command(monkeypatch, _loses_a_signal)
    with pytest.raises(stopping.Terminated):
        cli.main([])
    raised = _command(monkeypatch, lambda args: 0)
    assert cli.main([]) == 0 and raised == []


def test_a_server_taking_over_after_a_lost_signal_is_told_at_once(monkeypatch):
    """`serve` hands the stop signals to uvicorn's handler once it prints its ready line: one
    received before, and lost, reaches that handler as it takes over."""
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    told: list[int] = []
    with stopping.terminated_by_raising():
        _LosesTheSignal()
        with stopping.stopped_by(lambda sig, frame: told.append(sig)):
            assert told == [signal.SIGTERM]
            assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_the_server_took_still_ends_the_command():
    """A SIGTERM that reaches the server's handler (one that comes as it shuts down, after it
    has read its signals, included) is kept: the command ends by it once the cache is saved."""
    told: list[int] = []
    with stopping.terminated_by_raising():
        with stopping.stopped_by(lambda sig, frame: told.append(sig)):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
        assert told == [signal.SIGINT, signal.SIGTERM]
        with pytest.raises(stopping.Terminated):
            stopping.raise_if_terminated()
