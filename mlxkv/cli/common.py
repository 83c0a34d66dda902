"""What every command shares: logging, a progress bar, and the Runner its arguments describe
(and, on ranks other than 0 of a sharded model, following rank 0)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from mlxkv.config import RunnerConfig
from mlxkv.errors import RanksOutOfStepError
from mlxkv.models.sharding import world
from mlxkv.runner import context, request_builder
from mlxkv.runner.prompt_cache import report
from mlxkv.runner.runner import Runner
from mlxkv.runner.text import vision_cuts

EXIT_OUT_OF_STEP = 1  # a sharded model's ranks fell out of step for good (`Runner.health`)

# The logger of the memory line each request ends with (`Runner.memory_line`): its module's,
# named from the module so that a move cannot leave the CLI quieting a logger nobody uses.
MEMORY_LOGGER = report.logger.name
# The loggers whose INFO lines are shown without --verbose: each says that the model sees
# less than it was sent (a prompt cut to the window, with images or not; a reply with images
# whose max_tokens was lowered or whose prompt was cut mid-reply; a context shift), at most a
# line per request or shift. Named from their modules, as MEMORY_LOGGER is.
NOTICE_LOGGERS = (context.logger.name, request_builder.logger.name, vision_cuts.logger.name)


def setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root = logging.getLogger("mlxkv")
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    for name in NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def progress_bar(label: str) -> Callable[[int, int], None] | None:
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


def runner_config(args: argparse.Namespace) -> RunnerConfig:
    """The Runner settings the arguments ask for (`serve` starts from the server's defaults)."""
    options = {
        "max_context": args.max_context,
        "kv_bits": args.kv_bits,
        "speculative": args.speculative,
        "draft_model": args.draft_model,
        "warmup": not args.no_warmup,
    }
    for key in (
        "cache_entries",
        "cache_bytes",
        "cache_dir",
        "cache_dir_bytes",
        "cache_dir_kv_bits",
        "max_batch",
    ):
        if hasattr(args, key):
            options[key] = getattr(args, key)
    if getattr(args, "serving", False):
        config = RunnerConfig.for_server(**options)
        return config.replace(cache_dir=None) if args.no_cache_dir else config
    return RunnerConfig(**options)


def load_runner(args: argparse.Namespace) -> Runner:
    """The Runner the arguments ask for; under `mlx.launch`, this process's shard of it."""
    config = runner_config(args)
    group = world()
    if group is not None and config.cache_dir is not None:
        if group.rank() == 0:
            print("mlxkv: sharded: no disk tier (--cache-dir is ignored)", file=sys.stderr)
        config = config.replace(cache_dir=None)
    return Runner.load(args.model, config, progress=progress_bar("converting GGUF (tensors)"))


def follow(runner: Runner) -> int:
    """Ranks other than 0 of a sharded model: run rank 0's requests until it is done. Only
    rank 0 prints (its memory line adds up the ranks' bytes)."""
    for handler in logging.getLogger("mlxkv").handlers:
        handler.setLevel(logging.WARNING)
    try:
        for _ in runner.follow():
            pass
    except RanksOutOfStepError:  # said in the log when it happened
        return EXIT_OUT_OF_STEP
    return 0
