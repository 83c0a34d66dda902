"""The `serve` command: the HTTP server on a socket, and its cache saved on the way out
(Ctrl-C and SIGTERM alike)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from mlxkv.cli.common import MEMORY_LOGGER, follow, load_runner
from mlxkv.config import ServerConfig, env, format_bytes
from mlxkv.models.sharding import world
from mlxkv.runner.runner import Runner

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_DEFAULT_NAME = "SmolLM2-135M-Instruct"


def serve_command(args: argparse.Namespace) -> int:
    from mlxkv.server import create_app
    from mlxkv.server.connections import Server, uvicorn_config

    logging.getLogger("mlxkv.server").setLevel(logging.INFO)  # one access line per request
    if not args.verbose:  # the access line carries the memory line already
        logging.getLogger(MEMORY_LOGGER).setLevel(logging.WARNING)
    config = _server_config(args)
    runners = _load_runners(args)
    if runners is None:
        return 2
    first = next(iter(runners.values()))
    if first.rank:  # rank 0 alone serves HTTP
        return follow(first)
    app = create_app(runners, config)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))  # an address in use fails here, as one line
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
    if args.host not in _LOOPBACK and not config.api_key:
        print(f"mlxkv: warning: listening on {args.host} without --api-key", file=sys.stderr)
    for name, runner in runners.items():
        print(f"mlxkv: {name}: {_describe_cache(runner)}", file=sys.stderr)
    names = ", ".join(runners)
    print(f"mlxkv: serving {names} at {url} (OpenAI: {url}/v1, Anthropic: {url})", flush=True)
    server = Server(uvicorn_config(app, config, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:  # on the way out, the caches go to their disk tiers (if any)
        for runner in runners.values():
            runner.close(save_timeout_s=_SHUTDOWN_SAVE_S / len(runners))
    if signal.SIGTERM in server.signals:  # die by it, as a process stopped by SIGTERM does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 130 if signal.SIGINT in server.signals else 0


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        model_name=None,
        model_aliases=tuple(args.alias),
        api_key=args.api_key or env("MLXKV_API_KEY"),
        cors_origins=tuple(args.cors_origin),
        allowed_origins=tuple(args.allowed_origin),
        allowed_hosts=tuple(args.allowed_host),
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_queue=args.max_queue,
        fetch_images=args.fetch_images,
    )


def _load_runners(args: argparse.Namespace) -> dict[str, Runner] | None:
    """A Runner for each model `-m` names, by name; None (said on stderr) for several models
    under `mlx.launch`. A model that fails to load closes those loaded before it."""
    models = _named_models(args.model)
    if len(models) > 1 and world() is not None:
        print("mlxkv: a sharded server serves one model; give one -m", file=sys.stderr)
        return None
    runners = {}
    try:
        for name, model in models.items():
            runners[name] = load_runner(argparse.Namespace(**{**vars(args), "model": model}))
    except BaseException:
        for runner in runners.values():
            runner.close()
        raise
    return runners


# Seconds a stopping server may spend starting to write its entries to the disk tier (a
# second Ctrl-C or SIGTERM stops at once; docker waits 10 s before SIGKILL, systemd 90 s).
_SHUTDOWN_SAVE_S = 8.0


def _named_models(specs: list[str]) -> dict[str, str | None]:
    """The models `-m` names, by the name requests use: `NAME=MODEL`, else the directory or
    file name of a local model, else the repo id or Ollama name as given; none: the default.

    Raises:
        SystemExit: two models with one name (say which, and how to name them apart).
    """
    if not specs:
        return {_DEFAULT_NAME: None}
    models: dict[str, str | None] = {}
    for spec in specs:
        name, sep, model = spec.partition("=")
        if not sep or not name or os.path.exists(spec):  # a path may hold '='
            name, model = _name_of(spec), spec
        if name in models:
            raise SystemExit(
                f"mlxkv: two models are named {name!r}; name them apart with -m NAME=MODEL"
            )
        models[name] = model
    return models


def _name_of(model: str) -> str:
    path = Path(model).expanduser()
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return model


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
