"""The command line's arguments: one subcommand each, defaults read from `RunnerConfig` and
`ServerConfig` (never sized while parsing: `--version` stays instant)."""

from __future__ import annotations

import argparse
from importlib.metadata import version
from pathlib import Path

from mlxkv.cli.chat import CHAT_COMMANDS, chat_command, generate_command
from mlxkv.cli.models import convert_command, info_command
from mlxkv.cli.serve import serve_command
from mlxkv.config import (
    DEFAULT_DISK_BYTES,
    DISK_KV_BITS,
    KV_BITS,
    SERVER_CACHE_ENTRIES,
    SPECULATIVE_MODES,
    RunnerConfig,
    ServerConfig,
    format_bytes,
)
from mlxkv.decoding.sampling import SamplingParams

_MODEL_HELP = "model directory, .gguf file, Ollama name or Hugging Face repo (default: SmolLM2)"
_MAX_CONTEXT_HELP = "tokens the cache holds (None: model's)"
_RUNNER = RunnerConfig()
_SERVER = ServerConfig()


def build_parser() -> argparse.ArgumentParser:
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
    generate.set_defaults(run=generate_command)

    chat = commands.add_parser(
        "chat",
        help="multi-turn chat (one user line per turn)",
        epilog="commands: " + "; ".join(f"{c} {h}" for c, h in CHAT_COMMANDS.items()),
    )
    chat.add_argument("--system", help="system prompt")
    _add_model_options(chat)
    _add_speculative_options(chat)
    _add_cache_options(chat, server=False)
    chat.set_defaults(run=chat_command)

    _add_serve_command(commands)

    convert = commands.add_parser("convert", help="convert a GGUF file to an mlx-lm directory")
    convert.add_argument("gguf", type=Path, help="the .gguf file to convert")
    convert.add_argument(
        "out_dir",
        type=Path,
        help="where the mlx-lm directory goes: new, empty, or an earlier conversion",
    )
    convert.add_argument("-v", "--verbose", action="store_true", help="the log on stderr")
    convert.set_defaults(run=convert_command)

    info = commands.add_parser("info", help="architecture, layers and KV bytes per token")
    info.add_argument("model", nargs="?", default=None, help=_MODEL_HELP)
    info.add_argument("-v", "--verbose", action="store_true", help="the log on stderr")
    info.set_defaults(run=info_command)
    return parser


def _add_serve_command(commands: argparse._SubParsersAction) -> None:
    """`mlxkv serve`: its options are most of the command line, so they have a function."""
    serve = commands.add_parser(
        "serve",
        help="HTTP server: OpenAI, Anthropic and Ollama APIs",
        epilog="OpenAI clients: base_url http://HOST:PORT/v1; Anthropic clients: "
        "ANTHROPIC_BASE_URL=http://HOST:PORT",
    )
    _add_served_models(serve)
    serve.add_argument("--host", default=_SERVER.host, help="address to listen on")
    serve.add_argument("--port", type=_port, default=_SERVER.port, help="port (0: any free one)")
    serve.add_argument("--max-context", type=int, default=None, help=_MAX_CONTEXT_HELP)
    _add_kv_bits_option(serve)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key from clients (default: $MLXKV_API_KEY, else none)",
    )
    _add_browser_options(serve)
    _add_limit_options(serve)
    serve.add_argument("-v", "--verbose", action="store_true", help="the cache log on stderr")
    _add_warmup_option(serve)
    _add_speculative_options(serve)
    _add_cache_options(serve, server=True)
    serve.set_defaults(run=serve_command, serving=True)


def _add_served_models(serve: argparse.ArgumentParser) -> None:
    """The models a server serves, and the names requests reach them by."""
    serve.add_argument(
        "-m",
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]MODEL",
        help=f"{_MODEL_HELP}; repeat to serve several, each known by NAME (default: its "
        "directory or file name, repo id or Ollama name); the request's model chooses",
    )
    serve.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="PATTERN=NAME",
        help="with several models, request names matching PATTERN (shell-style: 'claude-*') "
        "go to the model NAME; repeat for more",
    )
    serve.add_argument(
        "--models-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="serve every model found in DIR (model directories and .gguf files, a Hugging "
        "Face hub cache, or Ollama's models directory), each by its name; repeat for more",
    )
    serve.add_argument(
        "--keep-alive",
        type=_keep_alive,
        default=_SERVER.keep_alive_s,
        metavar="DURATION",
        help="with several models: how long an idle model stays loaded when a request gives "
        "no keep_alive (seconds or a duration such as 5m, 1h; negative: for good; default 5m)",
    )
    serve.add_argument(
        "--max-memory",
        default=None,
        metavar="BYTES",
        help="with several models: most memory the loaded models' weights and cache budgets "
        "take together (such as 24GiB); loading one over it unloads the least recently used "
        "idle one (default: no limit)",
    )


def _add_browser_options(serve: argparse.ArgumentParser) -> None:
    """Which web pages may call the server, and by which host names it is reached."""
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="URL",
        help="a browser origin allowed to call the API; repeat for more, '*' for any",
    )
    serve.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="URL",
        help="a web page's origin allowed to send requests (as Ollama's OLLAMA_ORIGINS), "
        "besides the server's own page, loopback pages and --cors-origin; repeat for more, "
        "'*' for any",
    )
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name clients reach the server by (the Host header), besides localhost and "
        "--host; repeat for more, '*' for any",
    )


def _add_limit_options(serve: argparse.ArgumentParser) -> None:
    """The server's per-request and queue limits."""
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
        "--fetch-images",
        action="store_true",
        help="fetch the http(s) image URLs requests name (default: refuse them; send data: URLs)",
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
    serve.add_argument(
        "--max-batch",
        type=int,
        default=None,
        metavar="N",
        help="most requests decoding together in one batch (default: as many whole context "
        "windows as fit in a quarter of memory, at most 8; 1: one at a time)",
    )


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; use 0..65535 (0: any free one)")
    return port


class _HelpWithDefaults(argparse.HelpFormatter):
    """Adds an option's default to its help, unless the help already says it or there is
    none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # identity, not equality: a default of 0 or 0.0 is shown, a flag's False is not
        unset = default is None or default is False or default is argparse.SUPPRESS
        if "default" in text or unset or default == []:
            return text
        return f"{text} (default: %(default)s)"


# Options whose value may start with "-" (Ollama's negative keep-alive, "-5m"): argparse reads
# such a value as an option of its own ("expected one argument") unless it is joined with "=".
_SIGNED_VALUE_OPTIONS = ("--keep-alive",)


class _DefaultsParser(argparse.ArgumentParser):
    """Every command's --help shows each option's default; `--keep-alive -5m` reads as
    `--keep-alive=-5m`."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=_HelpWithDefaults, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args is not None:
            args = _joined_signed_values(list(args))
        return super().parse_known_args(args, namespace)


def _joined_signed_values(args: list[str]) -> list[str]:
    """`args` with each option of `_SIGNED_VALUE_OPTIONS` joined to the value after it."""
    joined: list[str] = []
    given = iter(args)
    for arg in given:
        if arg in _SIGNED_VALUE_OPTIONS:
            value = next(given, None)
            joined.append(arg if value is None else f"{arg}={value}")
        else:
            joined.append(arg)
    return joined


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", default=None, help=_MODEL_HELP)
    sampling = SamplingParams()  # a request's defaults, as the Python API gives them
    parser.add_argument(
        "--max-tokens", type=int, default=sampling.max_tokens, help="most tokens to generate"
    )
    parser.add_argument(
        "--temp", type=float, default=sampling.temperature, help="temperature; 0 = greedy"
    )
    parser.add_argument(
        "--top-p", type=float, default=sampling.top_p, help="nucleus sampling; 0 = off"
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    parser.add_argument("--max-context", type=int, default=None, help=_MAX_CONTEXT_HELP)
    _add_kv_bits_option(parser)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="statistics and the cache log on stderr"
    )
    _add_warmup_option(parser)


def _add_kv_bits_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=None,
        help="quantize the K/V cache to this many bits (default: the model's dtype)",
    )


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
        choices=[mode or "off" for mode in SPECULATIVE_MODES],
        default=_RUNNER.speculative or "off",
        help="auto: draft (from --draft-model, else from the text itself) only while drafts "
        "pay; ngram / draft: always; off: plain decoding",
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
        help="conversations kept in memory"
        + (f" (default: {SERVER_CACHE_ENTRIES})" if server else ""),
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
        help="disk tier: each finished turn and evicted entry is written there, and a restart "
        "starts warm (default: "
        + (
            "$MLXKV_CACHE_DIR/kv, else $XDG_CACHE_HOME/mlxkv/kv, else ~/.cache/mlxkv/kv)"
            if server
            else "none)"
        ),
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
    cache.add_argument(
        "--cache-dir-kv-bits",
        type=int,
        choices=DISK_KV_BITS,
        default=None,
        help="store K/V on the disk tier quantized to this many bits (8: half the bytes of "
        "16-bit K/V, a quarter of 32-bit; log-probabilities move slightly; default: as computed)",
    )


def _keep_alive(text: str) -> float:
    """Seconds from Ollama's spelling of a keep-alive (a number of seconds, or a duration)."""
    from mlxkv.server.models.keep_alive import FOREVER, keep_alive_ns

    try:
        value: float | str = float(text)
    except ValueError:
        value = text
    try:
        ns = keep_alive_ns(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return -1.0 if ns == FOREVER else (ns or 0) / 1e9
