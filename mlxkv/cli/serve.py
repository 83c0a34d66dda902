"""The `serve` command: the HTTP server on a socket, and its cache saved on the way out
(Ctrl-C and SIGTERM alike)."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

from mlxkv.cli.common import follow, load_runner
from mlxkv.config import ServerConfig, env, format_bytes
from mlxkv.runner.runner import Runner

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve_command(args: argparse.Namespace) -> int:
    from mlxkv.server import create_app
    from mlxkv.server.connections import Server, uvicorn_config

    logging.getLogger("mlxkv.server").setLevel(logging.INFO)  # one access line per request
    if not args.verbose:  # the access line carries the memory line already
        logging.getLogger("mlxkv.runner.runner").setLevel(logging.WARNING)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        model_name=args.model or "SmolLM2-135M-Instruct",
        api_key=args.api_key or env("MLXKV_API_KEY"),
        cors_origins=tuple(args.cors_origin),
        allowed_origins=tuple(args.allowed_origin),
        allowed_hosts=tuple(args.allowed_host),
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_queue=args.max_queue,
    )
    runner = load_runner(args)
    if runner.rank:  # rank 0 alone serves HTTP
        return follow(runner)
    name = config.model_name
    app = create_app(runner, config)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))  # an address in use fails here, as one line
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
    if args.host not in _LOOPBACK and not config.api_key:
        print(f"mlxkv: warning: listening on {args.host} without --api-key", file=sys.stderr)
    print(f"mlxkv: {_describe_cache(runner)}", file=sys.stderr)
    print(f"mlxkv: serving {name} at {url} (OpenAI: {url}/v1, Anthropic: {url})", flush=True)
    server = Server(uvicorn_config(app, config, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:  # on the way out, the cache goes to the disk tier (if any)
        runner.close(save_timeout_s=_SHUTDOWN_SAVE_S)
    if signal.SIGTERM in server.signals:  # die by it, as a process stopped by SIGTERM does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 130 if signal.SIGINT in server.signals else 0


# Seconds a stopping server may spend starting to write its entries to the disk tier (a
# second Ctrl-C or SIGTERM stops at once; docker waits 10 s before SIGKILL, systemd 90 s).
_SHUTDOWN_SAVE_S = 8.0


def _describe_cache(runner: Runner) -> str:
    info = runner.cache_info()
    budget = format_bytes(info.budget_bytes) if info.budget_bytes else "no memory limit"
    line = f"prompt cache: up to {info.max_entries} entries, {budget}"
    if info.disk_budget_bytes is not None:
        line += (
            f"; disk tier {runner.cache_dir} ({info.disk_entries} entries, "
            f"{format_bytes(info.disk_bytes)} of {format_bytes(info.disk_budget_bytes)})"
        )
    return line
