"""The `serve` command: the HTTP server on a socket, and its cache saved on the way out
(Ctrl-C and SIGTERM alike)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxkv.cli.common import EXIT_OUT_OF_STEP, MEMORY_LOGGER, follow, load_runner, runner_config
from mlxkv.cli.stopping import stopped_by
from mlxkv.config import ServerConfig, env, format_bytes
from mlxkv.errors import UnsupportedFormatError
from mlxkv.models.loading import expected_weights_bytes
from mlxkv.models.sharding import world
from mlxkv.models.sources import find_models
from mlxkv.platform.open_files import OPEN_FILES_WANTED, raise_open_files
from mlxkv.runner.runner import Runner

if TYPE_CHECKING:  # the server's modules load when it starts (other commands start faster)
    from mlxkv.server.connections import Server
    from mlxkv.server.models.model import ModelLoader

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_DEFAULT_NAME = "SmolLM2-135M-Instruct"


def serve_command(args: argparse.Namespace) -> int:
    from mlxkv.server.connections import Server, uvicorn_config

    logging.getLogger("mlxkv.server").setLevel(logging.INFO)  # one access line per request
    if not args.verbose:  # the access line carries the memory line already
        logging.getLogger(MEMORY_LOGGER).setLevel(logging.WARNING)
    config = _server_config(args)
    _check_open_files(config)
    sources = _model_sources(args)
    if sources is None:
        return 2
    loaded = [source for source in sources.values() if isinstance(source, Runner)]
    if loaded and loaded[0].rank:  # rank 0 alone serves HTTP
        return follow(loaded[0])
    try:  # whatever fails from here (a bad --alias, an address in use), the caches are saved
        app, sock, url = _listen(args, config, sources)
        for name, source in sources.items():
            print(f"mlxkv: {name}: {_describe(source)}", file=sys.stderr)
        server = Server(uvicorn_config(app, config, timeout_graceful_shutdown=5))
        if world() is not None:
            _stop_when_out_of_step(loaded[0], server)
        # from the ready line on, a stop signal sets the server's flag: a caller sends one as
        # soon as it reads the line, and a raise landing before uvicorn's handler could be lost
        with stopped_by(server.handle_exit):
            names = ", ".join(sources)
            print(
                f"mlxkv: serving {names} at {url} (OpenAI: {url}/v1, Anthropic: {url})", flush=True
            )
            server.run(sockets=[sock])  # models loaded on demand are closed as it stops
    finally:  # on the way out, the caches go to their disk tiers (if any)
        _close(loaded)
    if loaded and loaded[0].health is not None:  # said in the log when it happened
        return EXIT_OUT_OF_STEP
    if signal.SIGTERM in server.signals:  # die by it, as a process stopped by SIGTERM does
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 130 if signal.SIGINT in server.signals else 0


def _check_open_files(config: ServerConfig) -> None:
    """Raises the process's open-file limit to what the server may need (a Mac starts it at
    256: a burst of connections failed to be accepted, and disk-tier files to open); says so
    where the hard limit keeps it lower."""
    from mlxkv.server.connections import open_files_needed

    needed = open_files_needed(config)
    allowed = raise_open_files(max(needed, OPEN_FILES_WANTED))
    if allowed < needed:
        print(
            f"mlxkv: warning: {allowed} open files allowed (ulimit -n), under the {needed} that "
            f"{config.max_connections} connections and the model's files may need: a burst of "
            f"connections may then fail; raise the hard limit (ulimit -Hn {needed})",
            file=sys.stderr,
        )


def _stop_when_out_of_step(runner: Runner, server: Server) -> None:
    """Stops the server once the sharded model's ranks fall out of step: they never recover
    (a rank's ring cannot be rejoined), so the process exits (`EXIT_OUT_OF_STEP`) for its
    supervisor, and `mlx.launch`, which then stops the other ranks, to see; the requests
    open then are answered 503 first, within the server's graceful shutdown."""

    def stop() -> None:
        runner.wait_unhealthy()
        server.should_exit = True

    threading.Thread(target=stop, name="mlxkv-out-of-step", daemon=True).start()


def _listen(
    args: argparse.Namespace, config: ServerConfig, sources: dict[str, Runner | ModelLoader]
) -> tuple[Any, socket.socket, str]:
    """The app, its listening socket and its URL."""
    from mlxkv.server import create_app

    app = create_app(sources, config)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))  # an address in use fails here, as one line
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if family == socket.AF_INET6 else f"http://{host}:{port}"
    if args.host not in _LOOPBACK and not config.api_key:
        print(f"mlxkv: warning: listening on {args.host} without --api-key", file=sys.stderr)
    return app, sock, url


def _close(runners: list[Runner]) -> None:
    """Closes each Runner (its entries to its disk tier); one that fails is said, and the
    others still close."""
    from mlxkv.server.models.resident import SHUTDOWN_SAVE_S

    for runner in runners:
        try:
            runner.close(save_timeout_s=SHUTDOWN_SAVE_S / len(runners))
        except Exception as error:
            print(
                f"mlxkv: error: saving the cache of {runner.loaded.path.name}: {error}",
                file=sys.stderr,
            )


def _server_config(args: argparse.Namespace) -> ServerConfig:
    # None: --no-cache-dir, or sharded (no disk tier: `load_runner`): nothing on disk
    cache_dir = runner_config(args).cache_dir if world() is None else None
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
        keep_alive_s=args.keep_alive,
        max_memory_bytes=args.max_memory,
        state_dir=None if cache_dir is None else Path(cache_dir).expanduser() / "responses",
    )


def _model_sources(args: argparse.Namespace) -> dict[str, Runner | ModelLoader] | None:
    """The served models by name: one model is loaded now, and stays; several load on their
    first request (`ModelLoader`). None (said on stderr) for several under `mlx.launch`."""
    from mlxkv.server.models.model import ModelLoader

    models = _named_models(args.model, args.models_dir)
    if len(models) > 1 and world() is not None:
        print("mlxkv: a sharded server serves one model; give one -m", file=sys.stderr)
        return None
    if len(models) == 1:
        name, model = next(iter(models.items()))
        return {name: load_runner(_for_model(args, model))}
    cache_bytes = runner_config(args).cache_bytes or 0
    loaders: dict[str, Runner | ModelLoader] = {}
    for name, model in models.items():
        weights_bytes = _weights_bytes(name, model)
        loaders[name] = ModelLoader(
            functools.partial(load_runner, _for_model(args, model)),
            estimated_bytes=weights_bytes + cache_bytes,
            path=Path(model).expanduser() if model else None,  # a local one's tokenizer files
            weights_bytes=weights_bytes,
        )
    return loaders


def _weights_bytes(name: str, model: str | None) -> int:
    """`expected_weights_bytes`, or 0 (unknown, as for a repo id) for a GGUF tensor table or a
    safetensors header that cannot be read (a download cut short): the other models are
    served, and this one says what is wrong when it loads."""
    try:
        return expected_weights_bytes(model)
    except UnsupportedFormatError as error:
        print(f"mlxkv: {name}: its size is unknown until it loads: {error}", file=sys.stderr)
        return 0


def _for_model(args: argparse.Namespace, model: str | None) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "model": model})


def _named_models(specs: list[str], folders: list[str]) -> dict[str, str | None]:
    """The models `-m` names and those found in each `--models-dir`, by the name requests
    use: `NAME=MODEL`, else the directory or file name of a local model, else the repo id or
    Ollama name as given; none: the default.

    Raises:
        SystemExit: two models with one name (say which, and how to name them apart), or a
            name given no model (`-m small=`).
    """
    if not specs and not folders:
        return {_DEFAULT_NAME: None}
    named = []
    for spec in specs:
        name, sep, model = spec.partition("=")
        if not sep or not name or os.path.exists(spec):  # a path may hold '='
            name, model = _name_of(spec), spec
        if not model.strip():
            raise SystemExit(f"mlxkv: -m {spec!r} names no model; give one: -m {name}=MODEL")
        named.append((name, model))
    for folder in folders:
        named += [(name, str(path)) for name, path in find_models(folder).items()]
    models: dict[str, str | None] = {}
    for name, model in named:
        if name in models:
            raise SystemExit(
                f"mlxkv: two models are named {name!r}; name them apart with -m NAME=MODEL"
            )
        models[name] = model
    if not models:
        raise SystemExit(f"mlxkv: no models found in {', '.join(folders)}")
    return models


def _name_of(model: str) -> str:
    path = Path(model).expanduser()
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return model


def _describe(source: Runner | ModelLoader) -> str:
    if not isinstance(source, Runner):
        return "loads on its first request"
    info = source.cache_info()
    budget = format_bytes(info.budget_bytes) if info.budget_bytes else "no memory limit"
    line = f"prompt cache: up to {info.max_entries} entries, {budget}"
    if info.disk_budget_bytes is not None:
        line += (
            f"; disk tier {source.cache_dir} ({info.disk_entries} entries, "
            f"{format_bytes(info.disk_bytes)} of {format_bytes(info.disk_budget_bytes)})"
        )
    return line
