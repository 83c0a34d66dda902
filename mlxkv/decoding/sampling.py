"""Sampling settings and their translation into mlx-lm's samplers and logits processors.

Owns: `SamplingParams` (validated user settings) and `Sampling` (what they translate to, made
once per request). Does not own any sampling math: that is `mlx_lm.sample_utils`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from mlxkv.errors import check_int, check_real

Sampler = Callable[[mx.array], mx.array]

# Positive settings the sampler divides or multiplies float32 logits by must stay normal
# float32 numbers, their inverse too: 1e-39 is 0 in float32 (NaN and infinite logits came out).
_FLOAT32_SAFE = (1e-30, 1e30)
# Stop strings are matched as text streams; more or longer ones than any client needs would
# only make each token's check cost more (OpenAI takes 4).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
Distribution = Callable[[mx.array], mx.array]


@dataclass(frozen=True)
class Sampling:
    """What a request's `SamplingParams` translate to, made together once per request
    (`SamplingParams.make_sampling`): each decoding strategy takes the parts it uses.

    Attributes:
        sampler: logprobs (1, vocab) -> the next token.
        processors: the logits processors, in order (a grammar's joins them per request).
        distribution: the probabilities the sampler draws from (`make_distribution`); None
            when greedy (temperature 0), where there is no distribution to draw from.
    """

    sampler: Sampler
    processors: tuple[LogitsProcessor, ...]
    distribution: Distribution | None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Every field is checked for type and range when the object is built, before a request
    touches the cache or MLX (a sampler that fails inside MLX's compiled code would leave the
    process's random state broken).

    Attributes:
        max_tokens: most tokens to generate (0: only process the prompt).
        temperature: 0 picks the most likely token (greedy); else in [1e-30, 1e30], a range
            float32 logits can be scaled by.
        top_p, top_k, min_p: nucleus, top-k and min-p filtering (0 turns each off; a top_k of
            at least the vocabulary size keeps every token, as 0 does).
        repetition_penalty: >1 discourages tokens seen in the last 20; None turns it off; in
            [1e-30, 1e30].
        presence_penalty, frequency_penalty: subtracted from the logit of each token seen in
            the last 20, once (presence) or once per time seen (frequency), as mlx-lm's (and
            mlx_lm.server's) penalties; negative values favour them; 0 turns each off.
        logit_bias: added to the logits of the token ids given (a mapping of id -> bias, or
            (id, bias) pairs), as OpenAI's `logit_bias`; kept as sorted pairs. The ids are
            checked against the model's vocabulary when a request is built.
        seed: seeds MLX's random generator for reproducible sampling; 0 <= seed < 2**64.
        stop: strings that end generation; the text returned stops before them. A single
            string or None is accepted; at most `MAX_STOP_STRINGS`, each at most
            `MAX_STOP_CHARS` characters.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, low=0)
        check_real("temperature", self.temperature, low=0.0)
        if self.temperature != 0:
            _check_float32_safe("temperature", self.temperature, "0 for greedy, or ")
        check_real("top_p", self.top_p, low=0.0, high=1.0)
        check_int("top_k", self.top_k, low=0)
        check_real("min_p", self.min_p, low=0.0, high=1.0)
        if self.repetition_penalty is not None:
            check_real("repetition_penalty", self.repetition_penalty, low=0.0)
            if self.repetition_penalty == 0:
                raise ValueError("repetition_penalty must be > 0 (None turns it off), got 0")
            _check_float32_safe("repetition_penalty", self.repetition_penalty, "")
        low, high = _FLOAT32_SAFE
        for name in ("presence_penalty", "frequency_penalty"):
            check_real(name, getattr(self, name), low=-high, high=high)
        if self.seed is not None:
            check_int("seed", self.seed, low=0, high=2**64 - 1)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    def make_sampling(self, vocab_size: int, placeholders: bool = False) -> Sampling:
        """The sampler, logits processors and (when sampling) the distribution, for a model
        of `vocab_size` tokens; `placeholders`: the history holds image placeholder ids
        (`make_logits_processors`)."""
        greedy = self.temperature == 0
        return Sampling(
            self.make_sampler(vocab_size),
            tuple(self.make_logits_processors(placeholders)),
            None if greedy else self.make_distribution(vocab_size),
        )

    def make_sampler(self, vocab_size: int) -> Sampler:
        top_k = self.top_k if self.top_k < vocab_size else 0  # keeping every token: no filter
        return make_sampler(temp=self.temperature, top_p=self.top_p, min_p=self.min_p, top_k=top_k)

    def make_distribution(self, vocab_size: int) -> Distribution:
        """logprobs (1, vocab) -> the probabilities (1, vocab) the sampler draws from when
        temperature > 0: mlx-lm's filters in `make_sampler`'s order (top-p, min-p, top-k),
        then softmax at the temperature. Speculative sampling's acceptance rule needs them."""
        top_k = self.top_k if self.top_k < vocab_size else 0
        inverse_temperature = 1.0 / self.temperature

        def distribution(logprobs: mx.array) -> mx.array:
            if 0 < self.top_p < 1.0:
                logprobs = apply_top_p(logprobs, self.top_p)
            if self.min_p != 0.0:
                logprobs = apply_min_p(logprobs, self.min_p)
            if top_k > 0:
                logprobs = apply_top_k(logprobs, top_k)
            return mx.softmax(logprobs * inverse_temperature, axis=-1)

        return distribution

    def make_logits_processors(self, placeholders: bool = False) -> list[LogitsProcessor]:
        """mlx-lm's processors; with `placeholders` (a prompt with images), each reading only
        the history's ids within the logits (`_within_logits`): a text history needs no
        remapping."""
        made = make_logits_processors(
            logit_bias=dict(self.logit_bias) or None,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty or None,
            frequency_penalty=self.frequency_penalty or None,
        )
        return [_within_logits(processor) for processor in made] if placeholders else made


def _within_logits(processor: LogitsProcessor) -> LogitsProcessor:
    """`processor` given the history with each id past the logits' end (a vision prompt's image
    placeholders, `mlxkv.models.vision.PLACEHOLDER_BASE` and up) moved to one spare column
    added after them and dropped after: mlx-lm's repetition penalty gathers and scatters the
    logits at the history's ids, out of bounds there (the process died with SIGSEGV). The
    other ids' logits are what it gives them alone."""

    def within(tokens: mx.array, logits: mx.array) -> mx.array:
        width = logits.shape[-1]
        ids = mx.where(tokens < width, tokens, width).astype(tokens.dtype)
        spare = mx.zeros((*logits.shape[:-1], 1), dtype=logits.dtype)
        return processor(ids, mx.concatenate([logits, spare], axis=-1))[..., :width]

    return within


def _check_float32_safe(name: str, value: float, alternative: str) -> None:
    low, high = _FLOAT32_SAFE
    if not low <= value <= high:
        raise ValueError(
            f"{name} must be {alternative}between {low:g} and {high:g} (logits are float32), "
            f"got {value:g}"
        )


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (id, bias) pairs, from a mapping or pairs (a JSON round trip
    makes them lists)."""
    if isinstance(bias, Mapping):
        bias = list(bias.items())
    if not isinstance(bias, Sequence) or isinstance(bias, str | bytes):
        raise ValueError(f"logit_bias must map token ids to biases, got {type(bias).__name__}")
    pairs = {}
    for pair in bias:
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        token, value = pair
        check_int("logit_bias token id", token, low=0)
        check_real("logit_bias value", value, low=-_FLOAT32_SAFE[1], high=_FLOAT32_SAFE[1])
        pairs[int(token)] = float(value)
    return tuple(sorted(pairs.items()))


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence | set | frozenset) or isinstance(stop, bytes):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got {longest}")
    return tuple(stop)
