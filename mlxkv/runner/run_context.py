"""What every request of a Runner runs with: `RunContext`, made once with the Runner and handed
to each request whole, instead of the same model, pool and settings passed one by one down
the request path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlxkv.cache.layers.kv import Rotation
from mlxkv.config import RunnerConfig
from mlxkv.decoding.drafts import DraftModel
from mlxkv.decoding.prefill.chunks import PrefillPlan
from mlxkv.models.loading import LoadedModel
from mlxkv.runner.prompt_cache.holdings import Holdings
from mlxkv.runner.prompt_cache.pool import CachePool


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """What every request of a Runner runs with (fixed when the Runner is made).

    Attributes:
        loaded: the model and tokenizer.
        pool: the prompt cache's entries.
        config: the Runner's settings (`max_context`: the window; a generation that reaches
            it shifts).
        draft: the draft model for speculative decoding, or None.
        rotations: per layer, how to re-rotate keys when the context shifts (None: cannot).
        plan: how prompt tokens are fed (chunk size, CPU lanes).
        ended: told what the pool holds as each request ends, right after its entry is
            released (the Runner logs its memory line; `mlxkv.runner.hooks` observers are
            told of the end next).
    """

    loaded: LoadedModel
    pool: CachePool
    config: RunnerConfig
    draft: DraftModel | None
    rotations: list[Rotation | None]
    plan: PrefillPlan
    ended: Callable[[Holdings], None]
