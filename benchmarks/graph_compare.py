"""What MLX evaluates for one prefill chunk and one decode step: mlxkv vs mlx-lm, same weights.

    python -m benchmarks.graph_compare [--model DIR] [--cached 6144] [--chunk 2048] [--json F]

Device-independent evidence for a throughput gap seen on a GPU, where no profile can be
taken: both sides run the same model on caches of their own (mlxkv's `make_cache`, mlx-lm's
`make_prompt_cache`), and every `mx.eval` / `mx.async_eval` / `.item()` call is intercepted.
Before it runs, the lazy graph it is about to evaluate is exported (`mx.export_to_dot`) and its
operations counted by primitive. Per phase it records:
  syncs       eval / async_eval / item calls (host round trips a GPU may wait on)
  ops         primitives evaluated, by kind (Concatenate, SliceUpdate, AsType, ...)
  arrays      arrays the graph materializes (intermediates included)
  peak_bytes  `mx.get_peak_memory` above what was in use before the phase
  clears      `mx.clear_cache` calls

Phases: a chunk of `--chunk` tokens on an empty cache and after `--cached` tokens, the last
prompt token (its logits), and decode steps. mlx-lm's are driven through `generate_step`, as
`stream_generate` runs it; mlxkv's through `mlxkv.decoding.prefill.chunks` and
`decode_tokens` with the Runner's greedy picker, and through a whole `Runner.generate` (what
the request around them adds). Without `--model` a small factory llama is built, as bf16 and
4-bit (mlx-lm's convert).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

_LABEL = re.compile(r'label ="([A-Za-z0-9_]+)"')
_ARRAY = re.compile(r'^\{ (?:rank=\w+; )?"([^"]+)"; \}$', re.M)


@dataclass
class Sync:
    """One host call into MLX (eval, async_eval or item) and the graph it evaluated."""

    kind: str
    ops: Counter
    arrays: int


@dataclass
class Phase:
    """What one phase evaluated, call by call."""

    name: str
    syncs: list[Sync] = field(default_factory=list)
    peak_bytes: int = 0
    clears: int = 0

    def to_dict(self, syncs: list[Sync] | None = None) -> dict:
        """Totals over `syncs` (default: all of the phase's)."""
        syncs = self.syncs if syncs is None else syncs
        ops = sum((s.ops for s in syncs), Counter())
        return {
            "syncs": dict(Counter(s.kind for s in syncs)),
            "ops": dict(sorted(ops.items())),
            "num_ops": sum(ops.values()),
            "arrays": sum(s.arrays for s in syncs),
            "peak_bytes": self.peak_bytes,
            "clears": self.clears,
        }

    def graphs(self) -> list[Sync]:
        """The syncs that evaluated something, in order."""
        return [s for s in self.syncs if s.arrays]


class Recorder:
    """Intercepts MLX's evaluation entry points while active; `phase(name)` opens a phase."""

    def __init__(self) -> None:
        self.phases: list[Phase] = []
        self._dot = Path(tempfile.mkdtemp()) / "graph.dot"
        self._base = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        phase = Phase(name)
        self.phases.append(phase)
        self._base = mx.get_active_memory()
        mx.reset_peak_memory()
        yield phase
        phase.peak_bytes = max(0, mx.get_peak_memory() - self._base)

    def _count(self, kind: str, arrays: list) -> None:
        if not self.phases:
            return
        flat = [a for _, a in tree_flatten(arrays) if isinstance(a, mx.array)]
        text = ""
        if flat:
            mx.export_to_dot(str(self._dot), *flat)
            text = self._dot.read_text()
        sync = Sync(kind, Counter(_LABEL.findall(text)), len(_ARRAY.findall(text)))
        self.phases[-1].syncs.append(sync)

    @contextlib.contextmanager
    def active(self) -> Iterator[Recorder]:
        eval_, async_eval, item, clear = mx.eval, mx.async_eval, mx.array.item, mx.clear_cache

        def patched(kind: str, call: Callable) -> Callable:
            def run(*args):
                self._count(kind, list(args))
                return call(*args)

            return run

        def counted_clear() -> None:
            if self.phases:
                self.phases[-1].clears += 1
            clear()

        mx.eval, mx.async_eval = patched("eval", eval_), patched("async_eval", async_eval)
        mx.array.item = patched("item", item)
        mx.clear_cache = counted_clear
        try:
            yield self
        finally:
            mx.eval, mx.async_eval, mx.array.item, mx.clear_cache = eval_, async_eval, item, clear


def _prompt(num_tokens: int, vocab: int, seed: int) -> list[int]:
    key = mx.random.key(seed)
    return mx.random.randint(3, vocab, (num_tokens,), key=key).tolist()


def mlx_lm_phases(model, cached: list[int], chunk: list[int], decode_steps: int) -> list[Phase]:
    """mlx-lm's `generate_step` on its own cache: `cached` prefilled untraced, then `chunk`
    plus one token (its prefill loop feeds the chunk, then the last token for logits), then
    `decode_steps` steps."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    step = len(chunk)
    if cached:
        for _ in generate_step(mx.array(cached), model, prompt_cache=cache, max_tokens=0,
                               prefill_step_size=step):  # fmt: skip
            pass
    recorder = Recorder()
    prompt = mx.array(chunk + chunk[:1])
    with recorder.active():
        steps = generate_step(prompt, model, prompt_cache=cache, max_tokens=decode_steps + 1,
                              prefill_step_size=step)  # fmt: skip
        with recorder.phase("chunk"):
            # the generator's first next() runs the chunk, the last token and queues step 1
            first = next(steps)
        del first
        for i in range(decode_steps):
            with recorder.phase(f"decode {i + 1}"):
                next(steps)
        steps.close()
    return recorder.phases


def mlxkv_phases(model, cached: list[int], chunk: list[int], decode_steps: int, lanes: int):
    """mlxkv's chunked prefill and plain decoding (greedy picker, as a Runner builds it) on
    `make_cache`, with the same chunk size as mlx-lm and `lanes` CPU lanes."""
    from mlxkv.cache.building import make_cache
    from mlxkv.decoding.picker import TokenPicker
    from mlxkv.decoding.plain import decode_tokens
    from mlxkv.decoding.prefill.chunks import PrefillPlan, fill, prefill_steps
    from mlxkv.decoding.sampling import SamplingParams

    plan = PrefillPlan(len(chunk), lanes, PrefillPlan.make().kept_buffers_bytes)
    cache = make_cache(model)
    fill(model, cache, cached, plan)
    sampling = SamplingParams(temperature=0.0).make_sampling(model.args.vocab_size)
    pick = TokenPicker(sampling.sampler, [], cached + chunk, greedy=True)
    recorder = Recorder()
    with recorder.active():
        with recorder.phase("chunk"):
            logits = yield_all(prefill_steps(model, cache, chunk + chunk[:1], plan))
            tokens = decode_tokens(model, cache, logits, pick, decode_steps + 1)
            next(tokens)
        for i in range(decode_steps):
            with recorder.phase(f"decode {i + 1}"):
                next(tokens)
        tokens.close()
    return recorder.phases


def yield_all(steps):
    """Runs a generator to its end; returns its value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


@contextlib.contextmanager
def _model_calls(model) -> Iterator[list[int]]:
    """Records the tokens of every call of `model` (its class's `__call__`, patched while
    active), in order."""
    lengths: list[int] = []
    cls = type(model)
    call = cls.__call__

    def recorded(self, inputs, *args, **kwargs):
        lengths.append(int(inputs.shape[-1]))
        return call(self, inputs, *args, **kwargs)

    cls.__call__ = recorded
    try:
        yield lengths
    finally:
        cls.__call__ = call


def request_totals(loaded, cached: list[int], chunk: list[int], new_tokens: int) -> dict:
    """One whole request each side, `cached` already held: mlxkv's Runner (prefill in chunks
    of len(chunk), one lane, after a first request of `cached`) and mlx-lm's
    `stream_generate` on a prompt cache holding `cached` (as mlx_lm.server keeps one). Totals
    per request, and the model calls' token counts."""
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from mlxkv import Runner

    model, found = loaded.model, {}
    runner = Runner(loaded, prefill_step_size=len(chunk), prefill_lanes=1)
    if cached:
        runner.generate(cached, max_tokens=1)
    recorder = Recorder()
    with recorder.active(), _model_calls(model) as lengths, recorder.phase("request"):
        runner.generate(cached + chunk, max_tokens=new_tokens)
    runner.close()
    found["mlxkv"] = {**recorder.phases[0].to_dict(), "model_calls": list(lengths)}
    cache = make_prompt_cache(model)
    for _ in stream_generate(model, loaded.tokenizer, cached or chunk[:1], max_tokens=1,
                             prompt_cache=cache, prefill_step_size=len(chunk)):  # fmt: skip
        pass
    recorder = Recorder()
    with recorder.active(), _model_calls(model) as lengths, recorder.phase("request"):
        for _ in stream_generate(model, loaded.tokenizer, chunk, max_tokens=new_tokens,
                                 prompt_cache=cache, prefill_step_size=len(chunk)):  # fmt: skip
            pass
    found["mlx_lm"] = {**recorder.phases[0].to_dict(), "model_calls": list(lengths)}
    return found


def _summarize(phases: list[Phase]) -> dict:
    """The chunk (the first graph evaluated), the last prompt token (the second: its logits
    and the first pick), and one decode step in steady state (the median phase after the
    pipeline's first two; mlx-lm's first next() also queues step 1)."""
    first = phases[0]
    graphs = first.graphs()
    chunk, last = first.to_dict(graphs[:1]), first.to_dict(graphs[1:2])
    chunk["clears"] = first.clears
    last["peak_bytes"] = 0
    steady = sorted(phases[3:], key=lambda p: p.to_dict()["num_ops"])
    step = steady[len(steady) // 2].to_dict() if steady else {}
    return {"chunk": chunk, "last_token": last, "decode_step": step,
            "chunk_phase_syncs": first.to_dict()["syncs"]}  # fmt: skip


def compare(loaded, cached_tokens: int, chunk_tokens: int, lanes: int) -> dict:
    """Both sides' phases for one chunk after `cached_tokens` and a few decode steps, then a
    whole request each."""
    model, vocab = loaded.model, loaded.vocab_size
    cached = _prompt(cached_tokens, vocab, seed=1)
    chunk = _prompt(chunk_tokens, vocab, seed=2)
    mlx_lm_side = _summarize(mlx_lm_phases(model, cached, chunk, 6))
    ours = _summarize(mlxkv_phases(model, cached, chunk, 6, lanes))
    requests = request_totals(loaded, cached, chunk, 8)
    ours["request"], mlx_lm_side["request"] = requests["mlxkv"], requests["mlx_lm"]
    return {"mlx_lm": mlx_lm_side, "mlxkv": ours}


def differences(found: dict) -> list[str]:
    """Lines naming what differs between the two sides, phase by phase."""
    lines = []
    for phase in ("chunk", "last_token", "decode_step", "request"):
        ours, theirs = found["mlxkv"][phase], found["mlx_lm"][phase]
        for key in ("syncs", "ops"):
            for name in sorted(set(ours[key]) | set(theirs[key])):
                a, b = ours[key].get(name, 0), theirs[key].get(name, 0)
                if a != b:
                    lines.append(f"{phase} {key} {name}: mlxkv {a}, mlx-lm {b}")
        for key in ("arrays", "peak_bytes", "clears", "model_calls"):
            if key not in ours:
                continue
            if ours[key] != theirs[key]:
                lines.append(f"{phase} {key}: mlxkv {ours[key]}, mlx-lm {theirs[key]}")
    return lines


def _models(work: Path) -> dict[str, Path]:
    """A small factory llama as bf16 and 4-bit (built once into `work`)."""
    from mlx_lm import convert

    from benchmarks.gpu_check_parts import SHAPES, WINDOW_TOKENS
    from mlxkv.testing.factory import build_model

    paths = {}
    for dtype, options in (("bf16", {}), ("q4", {"quantize": True, "q_bits": 4})):
        out = work / f"llama-{dtype}"
        if not (out / "config.json").exists():
            shape = {**SHAPES["small"], "max_position_embeddings": WINDOW_TOKENS}
            f32 = build_model("llama", work / "llama-f32", config_overrides=shape)
            convert(str(f32), str(out), dtype="bfloat16", **options)
        paths[dtype] = out
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="model directory (repeatable)")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "mlxkv-graph"))
    parser.add_argument("--cached", type=int, nargs="+", default=[0, 6144])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--json", help="write every count here")
    args = parser.parse_args()
    from mlxkv.models.loading import load_model

    paths = {Path(m).name: Path(m) for m in args.model} if args.model else _models(Path(args.work))
    report = {}
    for name, path in paths.items():
        loaded = load_model(path)
        for cached in args.cached:
            found = compare(loaded, cached, args.chunk, args.lanes)
            report[f"{name} after {cached}"] = found
            print(f"## {name}: {args.chunk}-token chunk after {cached} cached tokens")
            for line in differences(found) or ["no difference"]:
                print(f"- {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
