"""The `mlxkv` command: generate, chat, serve, convert, info.

Owns: argument parsing, logging setup and everything printed (the only module that prints).
Text goes to stdout; statistics, progress and logs go to stderr, so piping stays clean.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import mlxkv  # noqa: F401  (picks the BLAS before mlx is imported)
from mlxkv.config import DEFAULT_DISK_BYTES, RunnerConfig, ServerConfig, env, format_bytes
from mlxkv.engine.results import Completion
from mlxkv.engine.runner import Runner
from mlxkv.errors import MlxkvError
from mlxkv.models.sharding import world

CHAT_COMMANDS = {
    "/reset": "forget the conversation and the cache",
    "/stats": "show the cache's tokens and memory",
    "/help": "list these commands",
    "/quit": "leave (Ctrl-D too; Ctrl-C stops a reply, or leaves at the prompt)",
}
_MODEL_HELP = "model directory, .gguf file, Ollama name or Hugging Face repo (default: SmolLM2)"
_MAX_CONTEXT_HELP = "tokens the cache holds (None: model's)"
_KV_BITS_HELP = "quantize K/V (None: off)"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_RUNNER = RunnerConfig()
_SERVER = ServerConfig()
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process ended by SIGPIPE


def main(argv: list[str] | None = None) -> int:
    _reopen_closed_standard_streams()
    argv = [_as_text(a) for a in (sys.argv[1:] if argv is None else argv)]
    args = _parser().parse_args(argv)
    _setup_logging(args.verbose)
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxkv", description="Run LLMs on MLX with a prompt cache that is never paid twice."
    )
    parser.add_argument("--version", action="version", version=f"mlxkv {version('mlxkv')}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND", parser_class=_DefaultsParser)

    generate = commands.add_parser("generate", help="generate a completion for one prompt")
    generate.add_argument("-p", "--prompt", required=True, help="the user message")
    generate.add_argument(
        "--raw", action="store_true", help="send the prompt without the chat template"
    )
    _add_model_options(generate)
    _add_speculative_options(generate)
    generate.set_defaults(run=_generate)

    chat = commands.add_parser(
        "chat",
        help="multi-turn chat (one user line per turn)",
        epilog="commands: " + "; ".join(f"{c} {h}" for c, h in CHAT_COMMANDS.items()),
    )
    chat.add_argument("--system", help="system prompt")
    _add_model_options(chat)
    _add_speculative_options(chat)
    _add_cache_options(chat, server=False)
    chat.set_defaults(run=_chat)

    serve = commands.add_parser(
        "serve",
        help="OpenAI- and Anthropic-compatible HTTP server",
        epilog="OpenAI clients: base_url http://HOST:PORT/v1; Anthropic clients: "
        "ANTHROPIC_BASE_URL=http://HOST:PORT",
    )
    serve.add_argument("-m", "--model", default=None, help=_MODEL_HELP)
    serve.add_argument("--host", default=_SERVER.host, help="address to listen on")
    serve.add_argument("--port", type=_port, default=_SERVER.port, help="port (0: any free one)")
    serve.add_argument("--max-context", type=int, default=None, help=_MAX_CONTEXT_HELP)
    serve.add_argument("--kv-bits", type=int, choices=(4, 8), default=None, help=_KV_BITS_HELP)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key from clients (default: $MLXKV_API_KEY, else none)",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="URL",
        help="a browser origin allowed to call the API; repeat for more, '*' for any",
    )
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients reach the server by (the Host header), besides localhost and "
        "--host; repeat for more, '*' for any",
    )
    serve.add_argument(
        "--max-tokens",
        type=int,
        default=_SERVER.default_max_tokens,
        help="tokens generated when a request sets none",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=_SERVER.max_body_bytes,
        help="largest request body accepted",
    )
    serve.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        metavar="N",
        help="most tokens one request may generate (default: the context window)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=_SERVER.max_queue,
        metavar="N",
        help="most requests running or waiting; more are answered 429",
    )
    serve.add_argument("-v", "--verbose", action="store_true", help="the cache log on stderr")
    _add_warmup_option(serve)
    _add_speculative_options(serve)
    _add_cache_options(serve, server=True)
    serve.set_defaults(run=_serve)

    convert = commands.add_parser("convert", help="convert a GGUF file to an mlx-lm directory")
    convert.add_argument("gguf", type=Path)
    convert.add_argument("out_dir", type=Path)
    convert.add_argument("-v", "--verbose", action="store_true")
    convert.set_defaults(run=_convert)

    info = commands.add_parser("info", help="architecture, layers and KV bytes per token")
    info.add_argument("model", nargs="?", default=None, help="default: the bundled SmolLM2")
    info.add_argument("-v", "--verbose", action="store_true")
    info.set_defaults(run=_info)
    return parser


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; use 0..65535 (0: any free one)")
    return port


class _DefaultsParser(argparse.ArgumentParser):
    """Every command's --help shows each option's default."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", default=None, help=_MODEL_HELP)
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    parser.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling; 0 = off")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument("--max-context", type=int, default=None, help=_MAX_CONTEXT_HELP)
    parser.add_argument("--kv-bits", type=int, choices=(4, 8), default=None, help=_KV_BITS_HELP)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="statistics and the cache log on stderr"
    )
    _add_warmup_option(parser)


def _add_warmup_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the forward passes at load that compile MLX's kernels before the first "
        "request (seconds on a GPU)",
    )


def _add_speculative_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "speculative decoding", "drafted tokens verified several per forward pass; exact"
    )
    group.add_argument(
        "--speculative",
        choices=("auto", "ngram", "draft", "off"),
        default="auto",
        help="auto: draft (from --draft-model, else from the text itself) only while drafts "
        "pay; ngram / draft: always; off: plain decoding (default: auto)",
    )
    group.add_argument(
        "--draft-model", default=None, help="a small model with the same tokenizer to draft with"
    )


def _add_cache_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """The prompt cache's options; the server's defaults are resolved when it starts
    (`RunnerConfig.for_server`), so parsing (and --help, --version) never sizes memory."""
    cache = parser.add_argument_group(
        "prompt cache", "entries kept in memory, their byte budget, and the disk tier"
    )
    cache.add_argument(
        "--cache-entries",
        type=int,
        default=None if server else _RUNNER.cache_entries,
        help="conversations kept in memory" + (" (default: 8)" if server else ""),
    )
    cache.add_argument(
        "--cache-bytes",
        default=None,
        metavar="SIZE",
        help="memory budget of the entries, e.g. 4GiB or 512MiB (default: "
        + ("a quarter of the machine's memory)" if server else "no limit)"),
    )
    cache.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="disk tier: evicted entries go there, and a restart starts warm (default: "
        + ("$MLXKV_CACHE_DIR/kv, else ~/.cache/mlxkv/kv)" if server else "none)"),
    )
    if server:
        cache.add_argument(
            "--no-cache-dir", dest="no_cache_dir", action="store_true", help="no disk tier"
        )
    cache.add_argument(
        "--cache-dir-bytes",
        default=format_bytes(DEFAULT_DISK_BYTES),
        metavar="SIZE",
        help="the disk tier's budget, e.g. 16GiB",
    )


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root = logging.getLogger("mlxkv")
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    # Cutting a prompt to the window or shifting the cache changes what the model sees: say so.
    logging.getLogger("mlxkv.engine.context").setLevel(logging.INFO)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _progress_bar(label: str) -> Callable[[int, int], None] | None:
    """A one-line progress bar on a terminal; nothing when stderr is piped."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        end = "\n" if done >= total else ""
        bar = "#" * filled + "-" * (width - filled)
        print(f"\r{label} [{bar}] {done}/{total}", end=end, file=sys.stderr, flush=True)

    return show


def _runner_config(args: argparse.Namespace) -> RunnerConfig:
    """The Runner settings the arguments ask for (`serve` starts from the server's defaults)."""
    options = {
        "max_context": args.max_context,
        "kv_bits": args.kv_bits,
        "speculative": args.speculative,
        "draft_model": args.draft_model,
        "warmup": not args.no_warmup,
    }
    for key in ("cache_entries", "cache_bytes", "cache_dir", "cache_dir_bytes"):
        if hasattr(args, key):
            options[key] = getattr(args, key)
    if args.run is _serve:
        config = RunnerConfig.for_server(**options)
        return config.replace(cache_dir=None) if args.no_cache_dir else config
    return RunnerConfig(**options)


def _load(args: argparse.Namespace) -> Runner:
    """The Runner the arguments ask for; under `mlx.launch`, this process's shard of it."""
    config = _runner_config(args)
    group = world()
    if group is not None and config.cache_dir is not None:
        if group.rank() == 0:
            print("mlxkv: sharded: no disk tier (--cache-dir is ignored)", file=sys.stderr)
        config = config.replace(cache_dir=None)
    return Runner.load(args.model, config, progress=_progress_bar("converting GGUF (tensors)"))


def _follow(runner: Runner) -> int:
    """Ranks other than 0 of a sharded model: run rank 0's requests until it is done. Only
    rank 0 prints (its memory line adds up the ranks' bytes)."""
    for handler in logging.getLogger("mlxkv").handlers:
        handler.setLevel(logging.WARNING)
    for _ in runner.follow():
        pass
    return 0


def _sampling(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temp,
        "top_p": args.top_p,
        "seed": args.seed,
    }


def _stream_reply(
    runner: Runner, prompt, args: argparse.Namespace, *, ctrl_c_cancels: bool = False
) -> Completion:
    """Streams one reply to stdout and returns its Completion. With `ctrl_c_cancels`, Ctrl-C
    ends the reply (finish "cancelled") instead of the program."""
    completion = None
    progress = _progress_bar("prefill (tokens)")
    previous = signal.signal(signal.SIGINT, lambda *_: runner.cancel()) if ctrl_c_cancels else None
    try:
        for chunk in runner.stream(prompt, progress=progress, **_sampling(args)):
            print(chunk.text, end="", flush=True)
            completion = chunk.completion or completion
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    print(flush=True)
    return completion


def _print_stats(out: Completion) -> None:
    print(
        f"[prompt {out.prompt_tokens} tokens, cached {out.cached_tokens} | "
        f"prefill {out.prompt_tps:.1f} tok/s | generation {out.generation_tokens} tokens, "
        f"{out.generation_tps:.1f} tok/s{_acceptance(out)} | ttft {out.ttft * 1000:.0f} ms | "
        f"finish {out.finish_reason}]",
        file=sys.stderr,
    )


def _acceptance(out: Completion) -> str:
    """`, drafted N, accepted M (P%)`, or nothing when nothing was drafted."""
    if not out.drafted_tokens:
        return ""
    share = out.accepted_tokens / out.drafted_tokens
    return f", drafted {out.drafted_tokens}, accepted {out.accepted_tokens} ({share:.0%})"


def _generate(args: argparse.Namespace) -> int:
    runner = _load(args)
    if runner.rank:
        return _follow(runner)
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    if not args.raw and not getattr(runner.tokenizer, "chat_template", None):
        prompt = args.prompt
    with runner:  # when sharded, closing ends the other ranks
        out = _stream_reply(runner, prompt, args)
    if args.verbose:
        _print_stats(out)
    return 0


def _chat(args: argparse.Namespace) -> int:
    with _load(args) as runner:  # closing it writes the cache to the disk tier, if any
        if runner.rank:
            return _follow(runner)
        return _chat_loop(runner, args)


def _chat_loop(runner: Runner, args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if interactive:
        print("mlxkv chat (/help lists the commands; Ctrl-C stops a reply)", file=sys.stderr)
    while True:
        line = _read_line(interactive)
        if line is None or line.strip() == "/quit":
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            messages = _chat_command(line, runner, messages, args)
            continue
        messages.append({"role": "user", "content": line})
        out = _stream_reply(runner, messages, args, ctrl_c_cancels=interactive)
        if out.finish_reason == "cancelled":
            print("[reply stopped]", file=sys.stderr)
        if out.text or out.finish_reason != "cancelled":
            messages.append({"role": "assistant", "content": out.text})
        else:
            messages.pop()  # stopped before a word: the question stays unasked
        if args.verbose:
            _print_stats(out)


def _chat_command(line: str, runner: Runner, messages: list, args: argparse.Namespace) -> list:
    """Runs a /command; returns the conversation after it. Nothing here reaches the model."""
    if line == "/reset":
        runner.reset()
        print("[conversation and cache cleared]", file=sys.stderr)
        return messages[:1] if args.system else []
    if line == "/stats":
        print(f"[{runner.cache_info().log_line()}]", file=sys.stderr)
    elif line == "/help":
        for command, what in CHAT_COMMANDS.items():
            print(f"  {command:8} {what}", file=sys.stderr)
    else:
        print(f"[unknown command {line.split()[0]}; /help lists them]", file=sys.stderr)
    return messages


def _read_line(interactive: bool) -> str | None:
    try:
        return input(">>> ") if interactive else sys.stdin.readline() or None
    except EOFError:
        return None


def _serve(args: argparse.Namespace) -> int:
    import socket

    from mlxkv.server import create_app
    from mlxkv.server.connections import uvicorn_config

    logging.getLogger("mlxkv.server").setLevel(logging.INFO)  # one access line per request
    if not args.verbose:  # the access line carries the memory line already
        logging.getLogger("mlxkv.engine.runner").setLevel(logging.WARNING)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        model_name=args.model or "SmolLM2-135M-Instruct",
        api_key=args.api_key or env("MLXKV_API_KEY"),
        cors_origins=tuple(args.cors_origin),
        allowed_hosts=tuple(args.allowed_host),
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_queue=args.max_queue,
    )
    runner = _load(args)
    if runner.rank:  # rank 0 alone serves HTTP
        return _follow(runner)
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
    server = _server_class()(uvicorn_config(app, config, timeout_graceful_shutdown=5))
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


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, remembering the signals that stopped it. uvicorn raises them
        again as soon as it has shut down, which for SIGTERM ends the process before the
        cache is saved; here they are kept in `signals` for the caller to act on once it
        has saved."""

        signals: tuple[int, ...] = ()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self.signals = tuple(self._captured_signals)
                self._captured_signals.clear()

    return Server


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


def _convert(args: argparse.Namespace) -> int:
    from mlxkv.models.gguf.convert import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, progress=_progress_bar("converting (tensors)"))
    print(out)
    return 0


def _info(args: argparse.Namespace) -> int:
    from mlxkv.models.inspect import describe
    from mlxkv.models.loading import load_model

    loaded = load_model(args.model, progress=_progress_bar("converting GGUF (tensors)"))
    for key, value in describe(loaded).items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
