"""Every option of mlxkv: its default, its check and its environment variable, in one place.

Owns:
  - `RunnerConfig`: what `Runner`, `Runner.load`, the CLI and the server build a Runner from;
  - `ServerConfig`: what `mlxkv serve` adds around it;
  - `ENVIRONMENT`: each `MLXKV_*` variable and what it sets, read through `env` and nowhere
    else;
  - `check_speculative`: the speculative decoding modes, for a config and for a request;
  - `check_kv_quantization`: the widths and groups quantized K/V takes (`KV_BITS`,
    `KV_GROUP_SIZES`), for a config and for a cache built without one;
  - `parse_bytes` ("4GiB" -> bytes) and `format_bytes` (bytes -> "4.0 GiB").

Defaults that depend on the machine (memory, device) are resolved from `platform.machine`
when a config is made for a purpose (`RunnerConfig.for_server`), never at import or while a
command line is parsed. Imports nothing from mlxkv but `errors` and `platform`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mlxkv.errors import check_int, check_real

# A sharded Runner's wait for the other ranks during a request: a prefill chunk of a large
# model stays well inside it.
DEFAULT_RANK_TIMEOUT_S = 120.0

# Every environment variable mlxkv reads, and when it takes effect.
ENVIRONMENT = {
    "MLXKV_OPENBLAS": "1 (find the system's OpenBLAS), 0 (MLX's reference BLAS) or a libblas.so "
    "path; read at `import mlxkv`",
    "MLXKV_PREFILL_LANES": "CPU streams a prefill chunk is spread over (1: off); read when a "
    "Runner is made",
    "MLXKV_CACHE_DIR": "where converted GGUF models (gguf/) and the server's disk tier (kv/) go; "
    "default $XDG_CACHE_HOME/mlxkv, else ~/.cache/mlxkv",
    "MLXKV_API_KEY": "mlxkv serve's --api-key when the flag is not given",
    "MLXKV_RANK_TIMEOUT_S": "seconds a rank of a sharded Runner waits for the others during one "
    "step of a request (a prefill chunk or a decode step) before failing it (default "
    f"{DEFAULT_RANK_TIMEOUT_S:g}); read when the Runner is made",
}

DEFAULT_DISK_BYTES = 16 * 2**30
# What `keep` None keeps of a prompt without a system prompt: as llama.cpp's attention sinks.
DEFAULT_KEEP_TOKENS = 4
DISK_KV_BITS = (4, 8)  # what `cache_dir_kv_bits` accepts (mx.quantize's affine bits)
# What `kv_bits` and `kv_group_size` accept: the widths and groups of `mx.quantize` that
# mlxkv's quantized K/V layer (`cache.layers.quantized`) and mlx-lm's quantized attention run.
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)
# `mlxkv serve`'s defaults: a few conversations and their side requests, a quarter of the
# machine's memory, and a disk tier that survives restarts.
SERVER_CACHE_ENTRIES = 8
SERVER_MEMORY_FRACTION = 0.25
# Where no context window is given: the window's K/V may take this share of memory when no
# cache budget says otherwise.
CONTEXT_MEMORY_FRACTION = 0.5
# Where no max_batch is given: as many rows as fit, each a whole window of K/V, in this share
# of memory, and at most DEFAULT_MAX_BATCH (decoding gains little past that on a laptop).
BATCH_MEMORY_FRACTION = 0.25
DEFAULT_MAX_BATCH = 8
# A vision model's encoder outputs kept by image digest (an image sent again skips the
# encoder) may take this share of `cache_bytes` (they count inside it); with no byte budget,
# this share of the server's default budget (SERVER_MEMORY_FRACTION of memory).
ENCODER_CACHE_FRACTION = 0.125

# "auto": drafts (from the draft model if one is loaded, else n-grams) only while they pay;
# "ngram" / "draft": always that drafter; None: plain decoding.
SPECULATIVE_MODES = ("auto", "ngram", "draft", None)

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def encoder_cache_bytes(cache_bytes: int | None) -> int:
    """The most bytes a vision model's encoder-output cache keeps, for a Runner whose entries'
    budget is `cache_bytes` (parsed; None: no budget)."""
    if cache_bytes is None:
        from mlxkv.platform.machine import memory_bytes

        cache_bytes = int(memory_bytes() * SERVER_MEMORY_FRACTION)
    return int(cache_bytes * ENCODER_CACHE_FRACTION)


def check_kv_quantization(bits: object, group_size: object) -> None:
    """Raises ValueError, naming the allowed values, unless `bits` is None (K/V kept in the
    model's dtype) or one of `KV_BITS`, and `group_size` one of `KV_GROUP_SIZES`: checked
    when a config is made, not when a model has loaded and its first cache is built."""
    if bits is not None and (not _is_int(bits) or bits not in KV_BITS):
        raise ValueError(
            f"kv_bits={bits!r} is not supported; use one of {KV_BITS} or None (the model's dtype)"
        )
    if not _is_int(group_size) or group_size not in KV_GROUP_SIZES:
        raise ValueError(
            f"kv_group_size={group_size!r} is not supported; use one of {KV_GROUP_SIZES}"
        )


def _is_int(value: object) -> bool:
    """An int of any kind but bool (True would pass as 1, 4.0 as 4)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_speculative(mode: object, *, has_draft_model: bool = True) -> str | None:
    """The speculative decoding mode `mode` names ("off": None), or ValueError saying what is
    accepted; "draft" also needs a draft model (`has_draft_model`: known once one is loaded)."""
    if mode == "off":
        return None
    if mode not in SPECULATIVE_MODES:
        raise ValueError(
            f"speculative must be one of 'auto', 'ngram', 'draft', 'off' or None; got {mode!r}"
        )
    if mode == "draft" and not has_draft_model:
        raise ValueError(
            "speculative='draft' needs a draft model: Runner.load(..., draft_model=PATH) or "
            "--draft-model PATH"
        )
    return mode


def env(name: str) -> str | None:
    """The value of one of `ENVIRONMENT`'s variables (None when unset or empty)."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name} is not one of mlxkv's environment variables")
    return os.environ.get(name) or None


def rank_timeout_s() -> float:
    """$MLXKV_RANK_TIMEOUT_S, else `DEFAULT_RANK_TIMEOUT_S`.

    Raises:
        ValueError: the variable is not a number of seconds above 0.
    """
    setting = env("MLXKV_RANK_TIMEOUT_S")
    if setting is None:
        return DEFAULT_RANK_TIMEOUT_S
    try:
        seconds = float(setting)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(
            f"MLXKV_RANK_TIMEOUT_S={setting!r} is not a number of seconds above 0; set one "
            f"(the default is {DEFAULT_RANK_TIMEOUT_S:g}) or unset it"
        )
    return seconds


def cache_root() -> Path:
    """mlxkv's own cache directory: $MLXKV_CACHE_DIR, else $XDG_CACHE_HOME/mlxkv, else
    ~/.cache/mlxkv (it may not exist yet).

    Raises:
        ValueError: MLXKV_CACHE_DIR names something that is not a directory.
    """
    setting = env("MLXKV_CACHE_DIR")
    if setting:
        root = Path(setting).expanduser()
        if root.exists() and not root.is_dir():
            raise ValueError(
                f"MLXKV_CACHE_DIR={root} is not a directory; point it at a directory (or unset "
                "it to use ~/.cache/mlxkv)"
            )
        return root
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mlxkv"


def default_cache_dir() -> Path:
    """The disk tier's directory when `mlxkv serve` is given none: `cache_root()/kv`."""
    return cache_root() / "kv"


def parse_bytes(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string such as "4GiB", "512MiB", "1.5GB", "800000".

    Raises:
        ValueError: not a size, or not positive.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of bytes such as 4GiB; got {value!r}")
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name} must be a number of bytes such as 4GiB, 512MiB or 1000000; got {value!r}"
            )
        number = int(float(match.group(1)) * _UNITS[unit])
    if number <= 0:
        raise ValueError(f"{name} must be more than 0 bytes; got {value!r}")
    return number


def format_bytes(num_bytes: int) -> str:
    """Human-readable IEC size: 512 B, 40.2 MiB, 1.5 GiB."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class _Options:
    """`replace(**options)` with an error naming the accepted options (mixin)."""

    def replace(self, **options: Any):
        names = {f.name for f in fields(self)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(
                f"unknown {type(self).__name__} option(s) {', '.join(unknown)}; use "
                f"{', '.join(sorted(names))}"
            )
        return dataclasses.replace(self, **options)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalizing a frozen dataclass's own field


@dataclass(frozen=True)
class RunnerConfig(_Options):
    """A Runner's settings, checked when the config is made.

    Attributes:
        max_context: most tokens (prompt + generated) a cache entry holds; None: the model's
            `max_position_embeddings`, capped to the tokens whose K/V fit in `cache_bytes`
            (else in half the machine's memory).
        keep: tokens at the start that truncation and shifts never drop; None keeps the
            system prompt's tokens for chat messages, else the first `DEFAULT_KEEP_TOKENS`.
        kv_bits: quantize global-attention K/V to 8 or 4 bits; None keeps the model's dtype.
        kv_group_size: head-dimension elements per quantization scale.
        prefill_step_size: most prompt tokens fed per model call (bounds prefill memory);
            None: chosen for the device (see `mlxkv.decoding.prefill.chunks.PrefillPlan`).
        prefill_lanes: CPU streams a prefill chunk is spread over; None: $MLXKV_PREFILL_LANES,
            else 2 on a CPU of several cores, 1 on a GPU or under `mlx.launch`.
        cache_entries: most prompt-cache entries (conversations) kept in memory; 1 keeps one
            entry and trims it in place.
        cache_bytes: the entries' byte budget (bytes, or a string such as "4GiB"), held after
            every request; None for no limit. A vision model's encoder-output cache counts
            inside it (at most `ENCODER_CACHE_FRACTION` of it; `encoder_cache_bytes`).
        cache_dir: a directory for the disk tier (evicted entries are written there and
            loaded back; a restart starts warm); None for none.
        cache_dir_bytes: the disk tier's byte budget.
        cache_dir_kv_bits: store float K/V on disk quantized to 8 (or 4) bits, in groups of 64
            head-dimension elements (half the bytes and read time at 8 bits; log-probabilities
            move, see docs/disk.md); None stores them as computed. Files are read whatever
            their setting.
        draft_model: a small model with the same tokenizer for speculative decoding, loaded by
            `Runner.load` (any form a model path takes); None for none.
        speculative: the requests' default speculative decoding mode: "auto", "ngram",
            "draft", or None / "off" (plain decoding).
        warmup: run a few small forward passes when the Runner is made, so MLX compiles its
            kernels then (seconds on a GPU) rather than during the first request.
        max_batch: most batched streams (`stream(batched=True)`, the server's) decoding
            together; more wait for a place. None: as many whole windows of K/V as fit in a
            quarter of memory, at most 8. 1 runs them one at a time.
    """

    max_context: int | None = None
    keep: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    prefill_step_size: int | None = None
    prefill_lanes: int | None = None
    cache_entries: int = 1
    cache_bytes: int | str | None = None
    cache_dir: str | Path | None = None
    cache_dir_bytes: int | str = DEFAULT_DISK_BYTES
    cache_dir_kv_bits: int | None = None
    draft_model: str | Path | None = None
    speculative: str | None = "auto"
    warmup: bool = True
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.max_context is not None:
            check_int("max_context (tokens)", self.max_context, low=2)
        if self.keep is not None:
            check_int("keep (tokens)", self.keep, low=0)
        check_kv_quantization(self.kv_bits, self.kv_group_size)
        if self.prefill_step_size is not None:
            check_int("prefill_step_size (tokens)", self.prefill_step_size, low=1)
        if self.prefill_lanes is not None:
            check_int("prefill_lanes", self.prefill_lanes, low=1)
        check_int("cache_entries", self.cache_entries, low=1)
        if self.max_batch is not None:
            check_int("max_batch", self.max_batch, low=1)
        if self.cache_bytes is not None:
            self._set("cache_bytes", parse_bytes(self.cache_bytes, "cache_bytes"))
        self._set("cache_dir_bytes", parse_bytes(self.cache_dir_bytes, "cache_dir_bytes"))
        if self.cache_dir_kv_bits not in (None, *DISK_KV_BITS):
            raise ValueError(
                f"cache_dir_kv_bits={self.cache_dir_kv_bits!r} is not supported; use one of "
                f"{DISK_KV_BITS} or None (stored as computed)"
            )
        if self.cache_dir is not None:
            path = Path(self.cache_dir).expanduser()
            if path.exists() and not path.is_dir():
                raise ValueError(f"cache_dir {str(path)!r} exists and is not a directory")
            self._set("cache_dir", path)
        self._set("speculative", check_speculative(self.speculative))

    @classmethod
    def of(cls, config: RunnerConfig | None, options: dict[str, Any]) -> RunnerConfig:
        """`config` (default: all defaults) with `options` replacing its fields.

        Raises:
            ValueError: an unknown option, or one of the wrong type or out of range.
        """
        return (config or cls()).replace(**options)

    @classmethod
    def for_server(cls, **options: Any) -> RunnerConfig:
        """`mlxkv serve`'s defaults (8 entries, a quarter of the machine's memory, a 16 GiB
        disk tier under `default_cache_dir()`), with `options` replacing them; an option
        given as None keeps the server's default."""
        from mlxkv.platform.machine import memory_bytes

        defaults = {
            "cache_entries": SERVER_CACHE_ENTRIES,
            "cache_bytes": int(memory_bytes() * SERVER_MEMORY_FRACTION),
            "cache_dir": default_cache_dir(),
        }
        given = {k: v for k, v in options.items() if v is not None or k not in defaults}
        return cls().replace(**{**defaults, **given})


DEFAULT_MAX_BODY_BYTES = 32 * 1024**2  # far above a 128k-token prompt as JSON
DEFAULT_MAX_TOKENS = 1024  # generated when a request sets no limit (OpenAI's may leave it out)
DEFAULT_MAX_QUEUE = 32  # requests running or waiting; each waiting one holds its body
DEFAULT_QUEUE_TIMEOUT_S = 600.0
DEFAULT_MAX_CONNECTIONS = 256  # well within the open files `mlxkv serve` allows itself
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: an idle model unloads after 5 minutes


@dataclass(frozen=True)
class ServerConfig(_Options):
    """What `mlxkv serve` adds around a Runner.

    Attributes:
        host: the address to listen on.
        port: the port (0: any free one).
        model_name: the id `/v1/models` lists; None: the model directory's name.
        api_key: when set, every path but /health and the chat page needs it.
        cors_origins: browser origins allowed to call the API and read its answers ("*" for
            any).
        allowed_origins: browser origins allowed to send requests, besides the server's own
            page, loopback pages and `cors_origins` ("*" for any); others get 403.
        allowed_hosts: names the server answers to besides loopback names and `host` (the Host
            header; "*" for any); a server bound to 0.0.0.0 or :: answers any unless set.
        max_body_bytes: largest request body accepted, in bytes.
        default_max_tokens: tokens generated when a request sets no limit.
        max_tokens_limit: most tokens one request may ask for; None: the context window.
        max_queue: most generations running or waiting; more get 429 with Retry-After.
        queue_timeout_s: seconds a generation may wait for its turn before it gets an error.
        fetch_images: fetch the http(s) image URLs requests name (within the image byte limit
            and `server.images.FETCH_TIMEOUT_S`); off, such a request gets a 400.
        max_connections: most open connections; more get 503.
        model_aliases: "PATTERN=NAME" entries: with several models served, request names
            matching PATTERN (fnmatch: "claude-*") go to the model NAME.
        keep_alive_s: seconds a model loaded on demand stays loaded after its last request
            when the request gives no `keep_alive` (negative: for good; 0: unloaded at once).
        max_memory_bytes: most bytes the models loaded on demand and those given loaded may
            take together, weights and cache budgets (bytes, or a string such as "24GiB");
            loading one over it unloads the least recently used idle ones. None: no limit.
        state_dir: a directory where the Responses API's stored responses and conversations
            are kept too, read back when a server starts on it (`mlxkv serve`: `responses`
            in its disk tier's directory). None: in memory only, forgotten on restart.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str | None = None
    api_key: str | None = None
    cors_origins: tuple[str, ...] = field(default_factory=tuple)
    allowed_origins: tuple[str, ...] = field(default_factory=tuple)
    allowed_hosts: tuple[str, ...] = field(default_factory=tuple)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    fetch_images: bool = False
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    model_aliases: tuple[str, ...] = field(default_factory=tuple)
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S
    max_memory_bytes: int | str | None = None
    state_dir: str | Path | None = None

    def __post_init__(self) -> None:
        check_int("port", self.port, low=0, high=65535)
        check_real("keep_alive_s", self.keep_alive_s, low=-math.inf)
        if self.max_memory_bytes is not None:
            self._set("max_memory_bytes", parse_bytes(self.max_memory_bytes, "max_memory_bytes"))
        check_int("max_body_bytes", self.max_body_bytes, low=1)
        check_int("default_max_tokens", self.default_max_tokens, low=1)
        if self.max_tokens_limit is not None:
            check_int("max_tokens_limit", self.max_tokens_limit, low=1)
        check_int("max_queue", self.max_queue, low=1)
        check_real("queue_timeout_s", self.queue_timeout_s, low=0.001)
        check_int("max_connections", self.max_connections, low=1)
        for name in ("cors_origins", "allowed_origins", "allowed_hosts", "model_aliases"):
            self._set(name, tuple(getattr(self, name)))

    @classmethod
    def of(cls, config: ServerConfig | None, options: dict[str, Any]) -> ServerConfig:
        """`config` (default: all defaults) with `options` replacing its fields."""
        return (config or cls()).replace(**options)
