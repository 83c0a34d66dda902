"""`--fetch-images` against a host that sends an image's bytes one at a time: the fetch ends
within `FETCH_TIMEOUT_S` in all (a 400), not only between two reads (urllib's timeout is per
socket read, so a byte every few seconds held a request, and a thread, for as long as the host
liked)."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import pytest

from mlxkv.server import images
from mlxkv.server.errors import ApiError

DRIP_BYTES = 200  # a byte every DRIP_GAP_S: 10 s in all, far past the timeout set below
DRIP_GAP_S = 0.05


@pytest.fixture
def dripping_host():
    stop = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(DRIP_BYTES))
            self.end_headers()
            for _ in range(DRIP_BYTES):
                if stop.wait(DRIP_GAP_S):
                    return
                self.wfile.write(b"\0")
                self.wfile.flush()

        def log_message(self, *args):
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{host.server_address[1]}/slow.png"
    stop.set()
    host.shutdown()


def test_a_slow_host_is_cut_off_within_the_fetch_timeout(dripping_host, monkeypatch):
    monkeypatch.setattr(images, "FETCH_TIMEOUT_S", 0.5)
    part = {"type": "image", "image": dripping_host}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}]
    started = time.monotonic()
    with pytest.raises(ApiError, match="0.5 s") as refused:
        asyncio.run(images.fetched_images(messages, True))
    assert refused.value.status == 400
    # Cut at the timeout it takes 0.5-0.6 s on 2 loaded cores (a bound of 1.0 s left a stall
    # of 0.4 s to fail it); held per read, the fetch would take the whole drip, 10 s.
    assert time.monotonic() - started < DRIP_BYTES * DRIP_GAP_S / 2
