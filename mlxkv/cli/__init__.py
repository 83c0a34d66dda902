"""The `mlxkv` command: generate, chat, serve, convert, info.

Owns the entry point (`main`): arguments in, exit status out, errors as one line. The
commands live beside it: `chat` (generate, chat), `serve`, `models` (convert, info), with
`parser` (the arguments) and `common` (logging, progress, building the Runner). This package
is the only one that prints: text goes to stdout; statistics, progress and logs to stderr,
so piping stays clean.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from mlxkv.cli.common import setup_logging
from mlxkv.cli.parser import build_parser
from mlxkv.cli.stopping import Terminated, raise_if_terminated, terminated_by_raising
from mlxkv.errors import MlxkvError

EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    _reopen_closed_standard_streams()
    argv = [_as_text(a) for a in (sys.argv[1:] if argv is None else argv)]
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    with terminated_by_raising():  # `serve`: the server's own handler while it runs
        try:
            status = _run(args)
            raise_if_terminated()  # one whose raise was lost (`stopping`)
            return status
        # outside `_run`'s handlers, so that a signal landing inside one of them is caught too
        except Terminated:  # cleaned up: now die by the signal, as the caller expects
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
            raise


def _run(args: argparse.Namespace) -> int:
    """Runs the command; its errors become one line on stderr and an exit status."""
    try:
        return args.run(args)
    except (MlxkvError, ValueError) as error:
        print(f"mlxkv: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as error:  # a full disk, an unwritable directory
        print(f"mlxkv: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _reopen_closed_standard_streams() -> None:
    """A closed stdin/stdout/stderr (`0<&-`) would hand its descriptor to the next file opened,
    which then gets read or written as if it were that stream: put /dev/null there instead."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # takes the lowest free descriptor: this one
    if sys.stdin is None:
        sys.stdin = open(os.devnull)  # noqa: SIM115 (lives as long as the process)
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # bytes that are not UTF-8 become U+FFFD


def _as_text(arg: str) -> str:
    """A command-line argument with undecodable bytes (kept by Python as lone surrogates)
    turned into U+FFFD."""
    return arg.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
