"""A conversation about one image over HTTP: `mlxkv serve` vs `mlx_vlm.server`, same weights.

A random-weight Qwen2-VL of the factory's "small" size (8 text layers of width 512, 4 vision
blocks; `mlxkv.testing.vision_factory`) and one 448x448 image (256 image tokens). Turn 1 asks
about the image; each next turn adds the reply and a short question, 8 turns in all, sent
through the `openai` client with streaming, greedy; time to first token (first non-empty
content) per turn. mlx_vlm.server runs with the same OpenBLAS (LD_PRELOAD, see
`serve_agent`). Every reply is compared with mlx_vlm.server's in the same turn.

Each conversation has an image of its own (turn 1 always runs the encoder on both servers),
and the servers take turns going first. Also measured in process: the vision encoder's share
of turn 1's TTFT (the encoder timed alone on the engine thread, over the Runner's turn-1
TTFT), beside mlx-vlm's own `stream_generate` in the same process. Goal: turns 2-8 at most
0.2x mlx_vlm.server's TTFT. Prints Markdown tables and writes JSON.

    python -m benchmarks.vision_chat [--reps 2] [--turns 8] [--reply-tokens 16]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import openai

from benchmarks.common import filler_text
from benchmarks.serve_agent import blas_env, free_port, start_server
from mlxkv import Runner
from mlxkv.models.vision import EncoderCache
from mlxkv.testing.vision_factory import build_vision_model

REFERENCE = "mlx_vlm.server"
IMAGE_SIDE_PIXELS = 448


def image_data_url(seed: int = 0) -> str:
    """A random image; another `seed` for each conversation, so each server's turn 1 encodes
    it (neither finds it in its encoder cache from the conversation before)."""
    from mlxkv.testing.vision_factory import noise_image

    out = io.BytesIO()
    noise_image(seed, (IMAGE_SIDE_PIXELS, IMAGE_SIDE_PIXELS, 3)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def conversation(url: str, model: str, reply_tokens: int, turns: int, rep: int):
    """TTFT per turn, in seconds, and the replies."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)
    image = {"type": "image_url", "image_url": {"url": image_data_url(seed=rep)}}
    first = {"type": "text", "text": f"Describe this picture. {filler_text(20, seed=rep)}"}
    messages = [{"role": "user", "content": [image, first]}]
    ttfts, replies = [], []
    for turn in range(turns):
        start, ttft, pieces = time.perf_counter(), None, []
        for piece in _stream(client, model, messages, reply_tokens):
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            pieces.append(piece)
        ttfts.append(ttft if ttft is not None else time.perf_counter() - start)
        replies.append("".join(pieces))
        question = f"And then? {filler_text(12, seed=100 * rep + turn)}"
        messages += [
            {"role": "assistant", "content": replies[-1]},
            {"role": "user", "content": question},
        ]
    return ttfts, replies


def _stream(client, model: str, messages: list[dict], reply_tokens: int) -> Iterator[str]:
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=reply_tokens, temperature=0.0, stream=True
    ):
        if chunk.choices:
            yield chunk.choices[0].delta.content or ""


def encoder_share(model_dir: Path, reps: int) -> dict[str, float]:
    """Turn 1 in process, each rep on an image of its own: mlxkv's TTFT (a fresh Runner) and
    mlx-vlm's own `stream_generate` to its first token on the same prompt, alternately; and the
    vision encoder's time alone (its cache emptied). Medians over `reps`."""
    from mlx_vlm import stream_generate
    from mlx_vlm.utils import load as vlm_load
    from PIL import Image

    loaded = Runner.load(model_dir).loaded
    vlm, processor = vlm_load(str(model_dir))
    question = {"type": "text", "text": "Describe this."}
    bare = [{"role": "user", "content": [{"type": "image"}, question]}]
    text = processor.tokenizer.apply_chat_template(bare, add_generation_prompt=True, tokenize=False)
    ours, theirs, encoder = [], [], []
    for rep in range(reps):
        image = Image.open(io.BytesIO(base64.b64decode(image_data_url(100 + rep).split(",")[1])))
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, question]}]
        runner = Runner(loaded)
        ours.append(runner.generate(messages, max_tokens=1, temperature=0.0).ttft)
        start = time.perf_counter()
        next(iter(stream_generate(vlm, processor, text, image=[image], max_tokens=1)))
        theirs.append(time.perf_counter() - start)
        cache = EncoderCache(loaded.vision, runner._pool.encoder.max_bytes)  # empty
        span = runner._builder._vision.encode(messages).spans[0]
        start = time.perf_counter()
        runner._dispatch.call(lambda cache=cache, span=span: cache.features(span))
        encoder.append(time.perf_counter() - start)
        runner.close()
    ttft, reference, encoder_s = (statistics.median(x) for x in (ours, theirs, encoder))
    return {
        "turn1_ttft_s": ttft,
        "mlx_vlm_turn1_ttft_s": reference,
        "encoder_s": encoder_s,
        "share": encoder_s / ttft,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="mlxkv-bench-"))
    model = build_vision_model(work / "qwen2-vl-small", size="small")
    env = blas_env()
    # a disk tier of its own: one left by an earlier run of this benchmark (same weights, same
    # first prompt) would serve turn 1 warm
    disk = ["--cache-dir", str(work / "kv")]
    servers = {
        "mlxkv serve": [
            sys.executable,
            "-m",
            "mlxkv.cli",
            "serve",
            *disk,
            "-m",
            str(model),
            "--port",
        ],
        REFERENCE: [sys.executable, "-m", "mlx_vlm.server", "--model", str(model), "--port"],
    }
    runs: dict[str, list[list[float]]] = {name: [] for name in servers}
    differing, failed, processes, urls = 0, 0, [], {}
    try:
        for name, command in servers.items():
            port = free_port()
            processes.append(start_server([*command, str(port)], port, env, work / f"{port}.log"))
            urls[name] = f"http://127.0.0.1:{port}"
        for rep in range(args.reps):
            replies, ttfts = {}, {}
            # each server goes first in every other conversation (the machine's load drifts)
            order = list(urls.items())[:: 1 if rep % 2 == 0 else -1]
            try:
                for name, url in order:
                    ttfts[name], replies[name] = conversation(
                        url, str(model), args.reply_tokens, args.turns, rep
                    )
                    print(f"  {name} conversation {rep + 1}: TTFT {sum(ttfts[name]):.2f} s")
            except openai.APIStatusError as error:  # mlx_vlm.server 500s on some replies
                print(f"  conversation {rep + 1} left out: {name} answered {error.status_code}")
                failed += 1
                continue
            for name in servers:
                runs[name].append(ttfts[name])
            pairs = zip(replies["mlxkv serve"], replies[REFERENCE], strict=True)
            differing += sum(a != b for a, b in pairs)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=60)
    share = encoder_share(model, max(3, args.reps))
    report(runs, differing, failed, share, args)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def report(runs, differing: int, failed: int, share: dict[str, float], args) -> None:
    medians = {
        name: [statistics.median(rep[t] for rep in reps) for t in range(args.turns)]
        for name, reps in runs.items()
    }
    done = len(runs["mlxkv serve"])
    print(f"\nTTFT per turn, s (median of {done} conversations; {failed} left out)\n")
    print("| turn | mlxkv serve | mlx_vlm.server | ratio |\n|---|---|---|---|")
    ratios = []
    for t in range(args.turns):
        mine, theirs = medians["mlxkv serve"][t], medians[REFERENCE][t]
        ratios.append(mine / theirs)
        print(f"| {t + 1} | {mine:.3f} | {theirs:.3f} | {ratios[-1]:.2f} |")
    worst = max(ratios[1:])
    print(f"\nreplies unlike {REFERENCE}'s: {differing} of {done * args.turns}")
    print(
        f"turns 2-{args.turns}, worst ratio: {worst:.2f} (goal <= 0.20: "
        f"{'PASS' if worst <= 0.2 else 'FAIL'})"
    )
    print(
        f"in process, turn 1 (median): mlxkv {share['turn1_ttft_s']:.3f} s, mlx-vlm's own "
        f"stream_generate {share['mlx_vlm_turn1_ttft_s']:.3f} s; vision encoder "
        f"{share['encoder_s']:.3f} s of mlxkv's ({share['share']:.0%})"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "reps": args.reps, "turns": args.turns, "reply_tokens": args.reply_tokens,
        "ttft_s": runs, "median_ttft_s": medians, "ratios": ratios,
        "replies_unlike_mlx_vlm_server": differing, "encoder": share,
        "conversations_left_out": failed,
    }  # fmt: skip
    (args.out / "vision_chat.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
