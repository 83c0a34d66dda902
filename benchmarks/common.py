"""Shared pieces of the benchmarks: repetition statistics, models, prompts, peak memory."""

from __future__ import annotations

import random
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlxkv  # noqa: F401  (picks the BLAS before mlx is imported)
from mlxkv.models.loading import LoadedModel, load_model
from mlxkv.testing.factory import build_model

WORDS = [
    *(
        [
            "cache",
            "token",
            "model",
            "window",
            "prefix",
            "memory",
            "layer",
            "attention",
            "river",
            "city",
            "museum",
            "story",
        ]
    ),
    *(
        [
            "keeper",
            "light",
            "number",
            "answer",
            "question",
            "garden",
            "winter",
            "summer",
            "engine",
            "bridge",
            "market",
        ]
    ),
    *(
        [
            "letter",
            "mountain",
            "ocean",
            "forest",
            "signal",
            "planet",
            "music",
            "paper",
            "silver",
            "orange",
        ]
    ),
]


@dataclass(frozen=True)
class Stat:
    """Median, min and max of repeated measurements (same unit as the samples)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Stat:
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def __str__(self) -> str:
        return f"{self.median:.3g} [{self.min:.3g}-{self.max:.3g}]"

    def to_dict(self) -> dict:
        return asdict(self)


def repeat(fn: Callable[[], float], reps: int) -> Stat:
    """Calls fn (which returns one measurement) `reps` times."""
    return Stat.of([fn() for _ in range(reps)])


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def filler_text(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def token_prompt(loaded: LoadedModel, num_tokens: int, seed: int = 0) -> list[int]:
    """Exactly `num_tokens` token ids of ordinary text for this model's tokenizer."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += loaded.tokenizer.encode(filler_text(400, seed + len(ids)))
    return ids[:num_tokens]


def load_models(names: list[str], work_dir: Path) -> dict[str, LoadedModel]:
    """ "smollm2" is the bundled default model; "factory-100m" a ~100M-parameter llama."""
    models = {}
    for name in names:
        if name == "smollm2":
            models[name] = load_model(None)
        elif name == "factory-100m":
            path = work_dir / "factory-100m"
            if not (path / "config.json").exists():
                build_model("llama", path, size="100m", vocab_size=512)
            models[name] = load_model(path)
        else:
            raise ValueError(f"unknown benchmark model {name!r}")
    return models


def peak_rss_bytes() -> int:
    """The process's peak resident memory (Linux reports KiB, macOS bytes)."""
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
