"""One served model: how it is loaded, what its listings show, and its own state while the
server runs (its worker while loaded, its requests in flight, its expiry).

Owns `ModelLoader` (how a served model is loaded, and the bytes it is expected to take),
`ModelFacts` (what a loaded model's listings show, kept after it unloads) and `ResidentModel`
(one served model's state, and what its first load measures: its footprint, its facts, the
replies its loads generated). Kept apart from the memory budget so that the listings and the
request paths read a model without the loading policy. Does not own when a model loads or
unloads (`resident.py`, whose `Residency` alone changes a model's private state), nor which
name a request means (`served.py`).

Invariant: a model loaded again (its fingerprint unchanged) knows the replies its last load
generated (`text.replies`): one sent back renders as their ids, with or without a disk tier.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlx.utils import tree_flatten

from mlxkv.models.capabilities import (
    Capabilities,
    TemplateFacts,
    model_capabilities,
    read_template_facts,
)
from mlxkv.models.fingerprint import model_fingerprint
from mlxkv.runner.runner import Runner
from mlxkv.runner.text.replies import ReplyTokens, replies_for
from mlxkv.server.worker import GenerationWorker


@dataclass(frozen=True)
class ModelLoader:
    """A served model loaded on its first request.

    Attributes:
        load: makes the Runner (called on a worker thread; may take minutes).
        estimated_bytes: what it is expected to take (weights and cache budget) before its
            first load measures it; 0: unknown.
        path: its local directory, whose tokenizer files tell the listings what it can do
            before it loads (None: nothing known until then).
        weights_bytes: its weights' expected bytes, the size `/api/tags` lists before its
            first load (after it, the weights' measured bytes); 0: unknown.
    """

    load: Callable[[], Runner]
    estimated_bytes: int = 0
    path: Path | None = None
    weights_bytes: int = 0


@dataclass(frozen=True)
class ModelFacts:
    """What a loaded model's listings show, kept after it unloads (`/api/tags`, `/v1/models`)."""

    capabilities: Capabilities
    digest: str
    config: dict
    weights_bytes: int


class ResidentModel:
    """One served model. Attributes read by the listings: `worker` (None while not loaded),
    `footprint_bytes`, `expires_at` (Unix seconds; None: never), `facts` (None before its
    first load) and `num_loads`."""

    def __init__(self, name: str, source: Runner | ModelLoader):
        self.name = name
        self.loader = source if isinstance(source, ModelLoader) else None
        self.worker: GenerationWorker | None = None
        self.footprint_bytes = self.loader.estimated_bytes if self.loader else 0
        self.facts: ModelFacts | None = None
        self.expires_at: float | None = None
        self.in_flight = 0
        self.num_loads = 0
        self.last_used_s = 0.0  # time.monotonic() of the last request's start or end
        self._given = None if self.loader else source
        self._lock = asyncio.Lock()  # held while it loads or unloads
        self._load_task: asyncio.Task | None = None  # its load under way
        self._waiting = 0  # requests waiting to take it (for its load, or its lock)
        self._expiry = 0  # bumped at each request's end: an older timer does nothing
        self._unload_at_end = False  # an unload asked for while requests were in flight
        self._timer: asyncio.TimerHandle | None = None
        self._replies: ReplyTokens | None = None  # its last load's reply memory

    @property
    def pinned(self) -> bool:
        return self.loader is None

    @functools.cached_property
    def template_facts(self) -> TemplateFacts | None:
        """What its tokenizer files say before its first load (read once, when a listing
        first asks: a tokenizer takes a fraction of a second, weights are never read)."""
        return read_template_facts(self.loader.path if self.loader else None)

    def _attach(self, runner: Runner, worker: GenerationWorker) -> None:
        weights = sum(w.nbytes for _, w in tree_flatten(runner.loaded.model.parameters()))
        digest = model_fingerprint(runner.loaded)
        replies = replies_for(runner.tokenizer)
        if self._replies is not None and self.facts is not None and self.facts.digest == digest:
            # loaded again (keep_alive, the memory budget): the replies its last load
            # generated render as their ids still (with a disk tier, its records say so too)
            replies.restore(self._replies.items())
        self._replies = replies
        self.facts = ModelFacts(
            capabilities=model_capabilities(
                runner.tokenizer,
                generates=not runner.loaded.is_encoder,
                vision=runner.loaded.vision is not None,
            ),
            digest=digest,
            config=dict(runner.loaded.config),
            weights_bytes=weights,
        )
        self.footprint_bytes = weights + (runner.cache_info().budget_bytes or 0)
        self.worker = worker
