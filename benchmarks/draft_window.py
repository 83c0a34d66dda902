"""A draft model on a reply that passes the window: decode tokens per second, and what the
draft cache's following of a shift costs.

The pair: a 12-layer factory llama (hidden 768) as the target and its first 2 layers as the
draft model. The target's other 10 layers have zero output projections (attention's and the
MLP's), so they add nothing to the residual stream: the target's logits are the draft's,
every greedy draft is accepted, and the target costs what 12 layers cost. That is the best
case of a draft model (a real one agrees less), which shows what the window used to take
away: before, drafting stopped for good once the reply passed the window (and 16 tokens), so
a long reply on a full window decoded plainly. For the "before" numbers, run this file on an
older checkout, with mlxkv imported first (it picks the BLAS before mlx is imported, as
`benchmarks/__init__.py` does for `-m`): `cd OLD && PYTHONPATH=OLD python -c "import mlxkv,
runpy; runpy.run_path('NEW/benchmarks/draft_window.py', run_name='__main__')"`.

Then the draft cache's own cost of following one shift, two ways: shifted in place (a
rotation of its keys, what `ModelDrafter.follow` does where the layers allow) and prefilled
again from the kept text (what it does elsewhere), at a few window sizes.

    python -m benchmarks.draft_window [--reps 3] [--max-tokens 384]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import token_prompt
from mlxkv import Runner
from mlxkv.cache.building import make_cache
from mlxkv.decoding.prefill.chunks import PrefillPlan, fill
from mlxkv.models.loading import LoadedModel, load_model
from mlxkv.models.rope import rope_rotations
from mlxkv.testing.factory import build_model

DRAFT_LAYERS = 2
PROMPT_TOKENS = 96
WINDOW_TOKENS = 256  # passed after 160 generated tokens, then every 126 (a shift drops half)


def _pair(work_dir: Path) -> tuple[LoadedModel, LoadedModel]:
    """The target (draft layers + layers that add nothing) and the draft (its first layers)."""
    path = build_model("llama", work_dir / "target", size="100m")
    target, draft = load_model(path), load_model(path)
    for layer in target.model.layers[DRAFT_LAYERS:]:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            linear.weight = mx.zeros_like(linear.weight)
    draft.model.model.layers = draft.model.model.layers[:DRAFT_LAYERS]
    mx.eval(target.model.parameters())  # not lazy: the Runner's engine thread runs them
    return target, draft


def _decode_rates(target: LoadedModel, draft: LoadedModel, reps: int, max_tokens: int) -> None:
    prompt = token_prompt(target, PROMPT_TOKENS)
    runners = {
        "off": Runner(target, max_context=WINDOW_TOKENS, speculative=None),
        "draft model": Runner(target, max_context=WINDOW_TOKENS, draft=draft),
    }
    rates: dict[str, list[float]] = {name: [] for name in runners}
    outs = {}
    for _ in range(reps):
        for name, runner in runners.items():
            runner.reset()
            out = runner.generate(
                prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                speculative="draft" if name != "off" else None,
            )
            rates[name].append(out.generation_tps)
            outs[name] = out
    drafted = outs["draft model"]
    print(f"\n## Decode, {PROMPT_TOKENS}-token prompt, {max_tokens} tokens, window {WINDOW_TOKENS}")
    print("| configuration | tok/s (median) | all | drafted | accepted |")
    print("|---|---|---|---|---|")
    for name, values in rates.items():
        out = outs[name]
        every = ", ".join(f"{v:.1f}" for v in values)
        print(
            f"| {name} | {statistics.median(values):.1f} | {every} | "
            f"{out.drafted_tokens} | {out.accepted_tokens} |"
        )
    print(f"same tokens: {drafted.tokens == outs['off'].tokens}")


def _follow_costs(draft: LoadedModel, reps: int) -> None:
    """Milliseconds to bring a full draft cache to the text kept by a shift of half of it."""
    model, plan = draft.model, PrefillPlan(step_tokens=512)
    rotations = rope_rotations(model)
    print(f"\n## One shift followed by the draft cache ({DRAFT_LAYERS}-layer draft), ms")
    print("| window | in place (rotate keys) | prefill the kept text again |")
    print("|---|---|---|")
    for window in (256, 2048, 8192):
        tokens = token_prompt(draft, window)
        keep, drop = 4, (window - 4) // 2
        kept = tokens[:keep] + tokens[keep + drop :]
        in_place, again = [], []
        for _ in range(reps):
            cache = make_cache(model)
            fill(model, cache, tokens, plan)
            mx.eval(cache.arrays())
            start = time.perf_counter()
            cache.shift(keep, drop, rotations)
            mx.eval(cache.arrays())
            in_place.append(time.perf_counter() - start)
            cache.rewind_to(keep)
            start = time.perf_counter()
            fill(model, cache, kept[keep:], plan)
            mx.eval(cache.arrays())
            again.append(time.perf_counter() - start)
        print(
            f"| {window} | {1e3 * statistics.median(in_place):.2f} | "
            f"{1e3 * statistics.median(again):.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--no-follow-costs", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        target, draft = _pair(Path(work))
        _decode_rates(target, dataclasses.replace(draft), args.reps, args.max_tokens)
        if not args.no_follow_costs:
            _follow_costs(draft, args.reps)


if __name__ == "__main__":
    main()
