"""Sampling settings and their translation into mlx-lm's samplers and logits processors.

Owns: `SamplingParams` (validated user settings). Does not own any sampling math: that is
`mlx_lm.sample_utils`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        max_tokens: most tokens to generate (0: only process the prompt).
        temperature: 0 picks the most likely token (greedy).
        top_p, top_k, min_p: nucleus, top-k and min-p filtering (0 turns each off).
        repetition_penalty: >1 discourages tokens seen in the last 20; None turns it off.
        seed: seeds MLX's random generator for reproducible sampling.
        stop: strings that end generation; the text returned stops before them.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        _check(self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 <= self.top_p <= 1, f"top_p must be in [0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        penalty = self.repetition_penalty
        _check(penalty is None or penalty > 0, f"repetition_penalty must be > 0, got {penalty}")
        _check(all(s for s in self.stop), "stop strings must be non-empty")

    def make_sampler(self) -> Sampler:
        return make_sampler(
            temp=self.temperature, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k
        )

    def make_logits_processors(self) -> list[LogitsProcessor]:
        return make_logits_processors(repetition_penalty=self.repetition_penalty)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
