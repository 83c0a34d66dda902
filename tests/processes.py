"""Test helpers for `mlxkv serve` run as a user runs it: a subprocess that prints its URL."""

from __future__ import annotations

import re
import selectors
import subprocess
import time


def ready_url(process: subprocess.Popen, timeout_s: float) -> str:
    """The URL from the server's ready line ("... at http://..."), read from its stdout
    (text mode); fails with its stderr if it exits first, or after `timeout_s`."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = selector.select(timeout=1)
        if ready and (found := re.search(r"at (http://\S+)", process.stdout.readline())):
            return found.group(1)
        assert process.poll() is None, process.stderr.read()
    raise AssertionError(f"mlxkv serve printed no ready line in {timeout_s:.0f} s")
