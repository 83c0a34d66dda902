"""The `generate` and `chat` commands: a reply streamed to stdout, its statistics to stderr."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from mlxkv.cli.common import MEMORY_LOGGER, follow, load_runner, progress_bar
from mlxkv.runner.results import Completion
from mlxkv.runner.runner import Runner

CHAT_COMMANDS = {
    "/reset": "forget the conversation and the cache",
    "/stats": "show the cache's tokens and memory",
    "/help": "list these commands",
    "/quit": "leave (Ctrl-D too; Ctrl-C stops a reply, or leaves at the prompt)",
}


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
    progress = progress_bar("prefill (tokens)")
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


def _print_stats(runner: Runner, out: Completion) -> None:
    print(
        f"[prompt {out.prompt_tokens} tokens, cached {out.cached_tokens} | "
        f"prefill {out.prompt_tps:.1f} tok/s | generation {out.generation_tokens} tokens, "
        f"{out.generation_tps:.1f} tok/s{_acceptance(out)} | ttft {out.ttft * 1000:.0f} ms | "
        f"finish {out.finish_reason}]\n[{runner.memory_line}]",
        file=sys.stderr,
    )


def _acceptance(out: Completion) -> str:
    """`, drafted N, accepted M (P%)`, or nothing when nothing was drafted."""
    if not out.drafted_tokens:
        return ""
    share = out.accepted_tokens / out.drafted_tokens
    return f", drafted {out.drafted_tokens}, accepted {out.accepted_tokens} ({share:.0%})"


def _quiet_memory_logger() -> None:
    """The memory line is printed after the reply (with `--verbose`), not logged in the middle
    of it: the request logs it before its last chunk reaches stdout."""
    logging.getLogger(MEMORY_LOGGER).setLevel(logging.WARNING)


def generate_command(args: argparse.Namespace) -> int:
    _quiet_memory_logger()
    runner = load_runner(args)
    if runner.rank:
        return follow(runner)
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    if not args.raw and not getattr(runner.tokenizer, "chat_template", None):
        prompt = args.prompt
    with runner:  # when sharded, closing ends the other ranks
        out = _stream_reply(runner, prompt, args)
    if args.verbose:
        _print_stats(runner, out)
    return 0


def chat_command(args: argparse.Namespace) -> int:
    _quiet_memory_logger()
    with load_runner(args) as runner:  # closing it writes the cache to the disk tier, if any
        if runner.rank:
            return follow(runner)
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
            _print_stats(runner, out)


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
