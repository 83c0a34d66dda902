"""A draft model whose embedding table is narrower than the model's (same tokenizer, padded
apart: Qwen2.5-0.5B's 151,936 rows drafting for Qwen2.5-7B's 152,064) drafts through the
request's logits processors (penalties, logit bias) as the model samples: a token id the model
may pick past the draft's last logit (a bias on a padded id) must not index the draft's logits
past their end (mlx-lm's repetition penalty gathers and scatters the logits at the history's
ids: MLX writes out of bounds, 600 silently, 65000 with SIGSEGV; review rs11, after f41058d),
nor the draft's embedding table (fed that id as text: SIGSEGV before f41058d too). The
end-to-end cases run in a child process. Reference: the same request without speculation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv.decoding.drafts import DraftModel
from mlxkv.decoding.prefill.chunks import PrefillPlan
from mlxkv.decoding.sampling import SamplingParams
from tests.factories import tiny_model_dir

# The tiny models' tokenizer and table hold 512 tokens. An id far past the draft's end: reads and
# writes just past it land in the heap and crashed only once in a few runs; this far, every run.
PADDED_VOCAB = 65536
PADDED_ID = 65000

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from mlxkv import Runner
    from mlxkv.models.loading import load_model

    target_dir, draft_dir, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    settings["logit_bias"] = {int(k): v for k, v in settings["logit_bias"].items()}
    runner = Runner(load_model(target_dir), max_context=512, draft=load_model(draft_dir))
    answers = [
        runner.generate("one two three four five six", max_tokens=12, temperature=0.0,
                        speculative=mode, **settings).tokens
        for mode in (None, "draft")
    ]
    sampled = runner.generate("one two three", max_tokens=12, temperature=0.8, seed=1,
                              speculative="draft", **settings)  # q at the model's width
    assert sampled.drafted_tokens > 0
    print(json.dumps(answers))
    """
)


def _padded(source: Path, out: Path, rows: int) -> Path:
    """`source`'s model with its embedding and output tables padded to `rows` (zeros)."""
    shutil.copytree(source, out)
    weights = mx.load(str(source / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        table = weights[name]
        padding = mx.zeros((rows - table.shape[0], table.shape[1]), dtype=table.dtype)
        weights[name] = mx.concatenate([table, padding])
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return out


@pytest.fixture(scope="module")
def padded_dir(model_root, tmp_path_factory) -> Path:
    source = tiny_model_dir("llama", model_root)
    return _padded(source, tmp_path_factory.mktemp("padded") / "llama", PADDED_VOCAB)


@pytest.mark.parametrize(
    "settings",
    [
        {"logit_bias": {PADDED_ID: 100.0}, "repetition_penalty": 1.3},
        {"logit_bias": {PADDED_ID: 100.0}, "presence_penalty": 1.5},
        {"logit_bias": {PADDED_ID: 5.0}},
    ],
    ids=["repetition", "presence", "bias"],
)
def test_a_narrower_draft_model_drafts_through_the_processors(model_root, padded_dir, settings):
    draft_dir, target_dir = tiny_model_dir("llama", model_root), padded_dir
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [str(target_dir), str(draft_dir), json.dumps(settings)]
    child = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *args], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
    plain, drafted = json.loads(child.stdout.splitlines()[-1])
    assert drafted == plain


def test_the_processors_see_the_draft_logits_at_the_models_width(loaded_tiny):
    """Deterministic where the crash is not: every processor call gets logits as wide as the
    model's (640 here), whatever the draft's (512), with the history's id 600 in them."""
    loaded = loaded_tiny("llama")
    seen = []

    def spy(history, logits):
        seen.append((logits.shape[-1], max(history.tolist())))
        return logits

    draft = DraftModel(loaded, 640)
    distribution = SamplingParams(temperature=0.8).make_distribution(640)
    text = [5, 6, 7, 600]
    drafter = draft.drafter(draft.make_cache(), text, distribution, PrefillPlan(512), [spy])
    proposed = drafter.propose(3)  # a text within one chunk: drafts at once
    assert len(proposed.tokens) == 3 and max(proposed.tokens) < 512  # none the draft cannot read
    assert seen == [(640, 600)] * 3
    assert [q.shape for q in proposed.probabilities] == [(1, 640)] * 3  # p's width
