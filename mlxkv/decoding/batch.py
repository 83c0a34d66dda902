"""Batched decoding: the sequences of several requests advance one token each per forward pass.

Owns `DecodeBatch` (the rows decoding together, one batched step for all of them, joins and
leaves between steps), `batched_tokens`, a request's token iterator on it, shaped like
`plain.decode_tokens` so that everything after it (text, stop strings, cancel) is the same,
and `joined_tokens`, the same from a token picked before the join (a request that decoded
alone until others came).
Does not own the rows' layout or which layer kinds batch (`mlxkv.cache.batched`), or sampling
(each row keeps its own `TokenPicker`: processors, sampler, grammar and logprobs per request).

Why it pays: a decode step reads every weight once whatever the number of rows, so on a
device bound by memory bandwidth N rows cost little more than one.

How rows stay in step: each request pulls its own tokens. A step appends one token to every
row's queue; a request whose queue runs empty runs the next step, queued (`async_eval`) before
its token is read back, as `decode_tokens` pipelines. A row that has just joined, while other
work waits on the engine thread, first pauses once (its iterator yields `PAUSE`): a step another
row runs meanwhile gives it its first token too. Rows joining one after another (prompts
prefilled together) would otherwise each run a step of their own with part of the batch, and
end as many steps apart (measured: 15 of 128 steps short of 8 rows, about 5% of the time).
Rows of slower readers simply queue more (at most their `max_tokens`). A row that has all its
tokens leaves at once; a request that stops early (EOS, a stop string, cancel) leaves when its
iterator is closed. Leaving hands the row's layers back to its entry with exactly the tokens
fed, less those decoded ahead of a reader that never took them: the same record a plain decode
leaves (recurrent state, which cannot trim, goes back to the step its reader last read:
`_go_back`). A row crossing a block boundary of the disk tier in a step gets its snapshot of
the layers that cannot trim there, as a plain pass does (`ModelCache.forward`).

Batched kernels round differently from a single row's (matmul shapes, the padded softmax):
logits agree with a request decoded alone to within float rounding, not bit for bit.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mlxkv.cache.batched import BatchedKV, can_batch, rewound_row
from mlxkv.cache.layer_ops import arrays_of
from mlxkv.cache.model_cache import ModelCache
from mlxkv.decoding.pause import PAUSE, Pause
from mlxkv.decoding.picker import TokenPicker

logger = logging.getLogger(__name__)

# MLX keeps freed buffers for reuse; give them back every so many steps (as `decode_tokens`).
_CLEAR_CACHE_EVERY_STEPS = 256


class _Picked:
    """The tokens one step picked, one per row in the step's row order (or the token a row
    joined with), read back to the host at most once: the first row to read its token reads
    every row's (one sync per step; a read per row would stop the thread at each)."""

    __slots__ = ("tokens", "_ids")

    def __init__(self, tokens: mx.array):
        self.tokens = tokens  # (rows,), lazy
        self._ids: list[int] | None = None

    def id(self, row: int) -> int:
        if self._ids is None:
            self._ids = self.tokens.tolist()
        return self._ids[row]


@dataclass(eq=False, kw_only=True)
class _Row:
    """One request's sequence in the batch. Its tokens are (step's `_Picked`, index) pairs;
    those not read yet carry the batch's recurrent state after their step (`state_marks`,
    None without recurrent layers): where the row goes back to if its reader stops there."""

    cache: ModelCache  # the entry: as it was at the join until the row leaves
    pick: TokenPicker
    left: int  # tokens still to produce
    next_input: tuple[_Picked, int]  # the last token picked, fed by the next step
    snapshot_every_tokens: int | None  # the entry's disk-snapshot interval, if it needs them
    position_shift: int = 0  # its positions' lead on its cache offset (`DecodeBatch.join`)
    fed: list[tuple[_Picked, int]] = field(default_factory=list)  # fed since the join
    out: deque[tuple[_Picked, int, list | None]] = field(default_factory=deque)  # not yet read
    snapshots: dict[int, list] = field(default_factory=dict)  # the disk tier's, since the join
    failure: BaseException | None = None
    fresh: bool = True  # joined, in no step yet, never paused for one


class DecodeBatch:
    """The rows decoding together on one model; all calls on one thread (the engine's).

    Args:
        model: the mlx-lm model every row runs on.
        max_rows: most rows at once; `has_room` says whether another may join.
        others_waiting: True while other work waits on the engine thread (a row that just
            joined lets it run first, see the module docstring); None: never waits.
    """

    def __init__(
        self, model: nn.Module, max_rows: int, others_waiting: Callable[[], bool] | None = None
    ):
        self._model = model
        self.max_rows = max_rows
        self._others_waiting = others_waiting
        self._kv = BatchedKV()
        self._rows: list[_Row] = []
        self._shifts: mx.array | None = None  # the rows' position shifts; None: all 0
        # whether some layer keeps recurrent state (marks kept each step), read at a join and
        # a part rather than by walking the layers every step
        self._has_state = False
        self._steps = 0

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        """Bytes the batch holds besides the entries' own (kept as they were): its layers,
        and the recurrent state of the steps its readers have not read yet (kept to go back
        to, `_go_back`: a slow reader's row keeps one step's state per token behind). Read
        from any thread (`Runner.cache_info`): the rows and their queues are copied first, each
        copy one C call (no thread switch inside it, so no 'mutated during iteration')."""
        marks = [m for row in tuple(self._rows) for _, _, m in tuple(row.out) if m is not None]
        return self._kv.nbytes + (self._kv.marks_nbytes(marks) if marks else 0)

    def accepts(self, cache: ModelCache) -> bool:
        """True when a sequence on `cache` can join now (room, and a cache kind that batches)."""
        return len(self._rows) < self.max_rows and can_batch(cache)

    def join(
        self,
        cache: ModelCache,
        first: mx.array,
        pick: TokenPicker,
        left: int,
        position_shift: int = 0,
    ) -> _Row:
        """Adds a row for `cache`, whose next input is `first` (picked, not fed), to produce
        `left` more tokens with `pick`.

        Args:
            position_shift: how far the row's positions run ahead of its cache offset (a
                vision model's prompt with images: M-RoPE positions are not token indices).
                While some row's is not 0, each step passes them all to the model as
                `position_shifts` (B,), which only a vision model takes
                (`mlxkv.models.vision.VisionLanguageModel`); a text model's rows never have one.
        """
        first_input = (_Picked(first.reshape(1)), 0)
        every = cache.snapshot_every_tokens if cache.needs_checkpoints else None
        row = _Row(
            cache=cache,
            pick=pick,
            left=left,
            next_input=first_input,
            snapshot_every_tokens=every,
            position_shift=position_shift,
        )
        self._kv.join(cache)
        self._has_state = self._kv.has_state
        self._rows.append(row)
        self._shifts_changed()
        return row

    def waits(self, row: _Row) -> bool:
        """True, once, when `row` just joined and has no token while other work waits on the
        engine thread: its reader pauses, and a step run meanwhile serves it too."""
        if not row.fresh or self._others_waiting is None:
            return False
        row.fresh = False
        return self._others_waiting()

    def next_token(self, row: _Row) -> int | None:
        """The row's next token id (the step after it queued first, so that it runs while this
        one is read back), or None when it has all."""
        if row.failure is not None:
            raise row.failure
        if not row.out:
            if row not in self._rows:
                return None
            self._step()
            if row.failure is not None:  # its own pick failed: the stand-in is not its token
                raise row.failure
        picked, index, _ = row.out.popleft()
        if not row.out and row in self._rows:
            self._step()  # queued before this token is read back
        return picked.id(index)

    def leave(self, row: _Row) -> None:
        """Takes the row out of the batch (if still in), handing its layers to its entry, less
        the tokens decoded ahead that its reader never took: the entry ends where a plain
        decode stopped by the same reader would (the last token read, fed or not)."""
        if row in self._rows:
            self._part(row)
        unread_fed = len(row.out) - 1  # the newest was picked, never fed
        if unread_fed > 0 and row.failure is None:
            _go_back(row, unread_fed)
        row.out.clear()

    def detach(self, row: _Row) -> list[int]:
        """Takes the row out of the batch with all it was fed, and returns the tokens picked
        for it and not read yet, oldest first (all fed but the newest), for its request to go
        on from alone."""
        if row.failure is not None:
            raise row.failure
        if row in self._rows:
            self._part(row)
        tokens = [picked.id(index) for picked, index, _ in row.out]
        row.out.clear()
        return tokens

    def _step(self) -> None:
        rows = self._rows
        try:
            shifted = {} if self._shifts is None else {"position_shifts": self._shifts}
            logits = self._model(_inputs(rows), cache=self._kv.layers, **shifted)[:, -1, :]
            picked = _Picked(_pick(rows, logits))
            snapshots = self._snapshots(rows)
            mx.async_eval(picked.tokens, [arrays_of(s) for snap in snapshots for s in snap if s])
        except BaseException as error:  # the model, or the picking as a whole
            self._fail(error)
            raise
        marks = self._kv.state_marks() if self._has_state else None
        for i, row in enumerate(rows):
            row.fresh = False
            row.fed.append(row.next_input)
            row.next_input = (picked, i)
            row.out.append((picked, i, marks))
            row.left -= 1
        for row in [row for row in rows if row.left <= 0 or row.failure is not None]:
            self._part(row)
        self._steps += 1
        if self._steps % _CLEAR_CACHE_EVERY_STEPS == 0:
            mx.clear_cache()

    def _snapshots(self, rows: list[_Row]) -> list[list]:
        """The disk tier's snapshots of the rows whose step (about to be recorded) ends on a
        block boundary, as `ModelCache.forward` takes a plain pass's; kept by each row until
        its entry adopts its layers (`_part`), dropped with them if the batch fails."""
        taken = []
        for i, row in enumerate(rows):
            every, length = row.snapshot_every_tokens, row.cache.num_tokens + len(row.fed) + 1
            if every and length % every == 0:
                row.snapshots[length] = self._kv.snapshot(i, row.cache.layers)
                taken.append(row.snapshots[length])
        return taken

    def _part(self, row: _Row) -> None:
        """Hands the row's layers back to its entry, with the tokens fed since the join and
        the disk snapshots taken meanwhile (besides the entry's own, not yet written)."""
        layers = self._kv.part(self._rows.index(row), row.cache.layers)
        self._has_state = self._kv.has_state
        self._rows.remove(row)
        self._shifts_changed()
        fed = [picked.id(index) for picked, index in row.fed]
        row.fed.clear()
        disk = {**row.cache.take_disk_snapshots(), **row.snapshots}
        row.cache.adopt(layers, row.cache.tokens + fed, row.cache.checkpoints, disk)
        row.snapshots = {}

    def _fail(self, error: BaseException) -> None:
        """A step failed (the model, or the picking as a whole; one row's own processors
        failing end that row alone: `_own_pick`): every row leaves with its entry as it was
        at its join (their K/V in the batch may be half updated); each request hears the
        error at its next token."""
        logger.error("a batched decode step failed; its %d requests end", len(self._rows))
        for row in self._rows:
            row.failure = error
        self._rows.clear()
        self._kv = BatchedKV()
        self._has_state = False
        self._shifts = None

    def _shifts_changed(self) -> None:
        """The rows' position shifts, in row order, after a join or a leave; None while all
        are 0 (every text model's batch: its steps call the model as mlx-lm's models take)."""
        shifts = [row.position_shift for row in self._rows]
        self._shifts = mx.array(shifts) if any(shifts) else None


def _go_back(row: _Row, unread_fed: int) -> None:
    """The row's entry without the `unread_fed` tokens fed ahead of its reader: K/V layers
    trim; recurrent state cannot, so it takes the batch's state after the step that picked
    the oldest unread token (kept with it in `out`: each step's arrays stay alive only while
    some row has not read that step's token, in practice a step or two). A window that has
    already overwritten what the shorter length needs (lag over one token once full) cannot
    go back: the entry then keeps those tokens too, exact (tokens == what the layers hold),
    and the next turn goes back from a checkpoint. Restoring the window as well would mean
    copying every lagging row's window each step, where this loses a reply's tail only."""
    cache, target = row.cache, row.cache.num_tokens - unread_fed
    if cache.can_trim_to(target):
        cache.trim_to(target)
        return
    _, index, marks = row.out[0]
    layers = None if marks is None else rewound_row(cache.layers, marks, index, unread_fed)
    if layers is None:
        logger.debug("a row left %d tokens ahead of its reader; its entry keeps them", unread_fed)
        return
    disk = {n: s for n, s in cache.take_disk_snapshots().items() if n <= target}
    cache.adopt(layers, cache.tokens[:target], cache.checkpoints, disk)


def _inputs(rows: list[_Row]) -> mx.array:
    """The step's input (rows, 1): each row's last picked token. Rows that all come from the
    last step, in its order (a batch no row joined or left since), feed its tokens as they
    are, without a slice per row."""
    last = rows[0].next_input[0]
    if last.tokens.size == len(rows) and all(
        row.next_input == (last, i) for i, row in enumerate(rows)
    ):
        return last.tokens.reshape(len(rows), 1)
    inputs = [picked.tokens[index : index + 1] for picked, index in (r.next_input for r in rows)]
    return mx.concatenate(inputs).reshape(len(rows), 1)


def _pick(rows: list[_Row], logits: mx.array) -> mx.array:
    """The rows' next tokens, shape (rows,), from their logits (one row of `logits` each): the
    `bare_argmax` rows' in one op for all of them (the same tokens as row by row)."""
    bare = [i for i, row in enumerate(rows) if row.pick.bare_argmax]
    if len(bare) == len(rows):
        return mx.argmax(logits, axis=-1)
    picked: dict[int, mx.array] = {}
    if bare:
        tokens = mx.argmax(logits[mx.array(bare)], axis=-1)
        picked = {i: tokens[j : j + 1] for j, i in enumerate(bare)}
    own = [
        picked[i] if i in picked else _own_pick(row, logits[i : i + 1])
        for i, row in enumerate(rows)
    ]
    return mx.concatenate(own)


def _own_pick(row: _Row, logits: mx.array) -> mx.array:
    """A row's token from its own picker. Its processors failing (a grammar the engine gives
    up on mid-reply: a client's schema) end that row alone: it takes the greedy token as a
    stand-in, never read, and leaves the batch after this step with what it was fed, while
    the other rows go on (a failure here ended every client's reply in the batch)."""
    try:
        return row.pick(logits)
    except Exception as error:
        logger.warning("a batched request's picking failed; it ends alone: %s", error)
        row.failure = error
        return mx.argmax(logits, axis=-1)


def batched_tokens(
    batch: DecodeBatch,
    cache: ModelCache,
    logits: mx.array,
    pick: TokenPicker,
    max_tokens: int,
    position_shift: int = 0,
) -> Iterator[int | Pause]:
    """Yields up to `max_tokens` sampled token ids from the prompt's last logits, decoding in
    `batch` with the other requests there (see the module docstring), and `PAUSE`
    (other work runs first). The first token comes out before the row joins, as soon as it
    exists. Closing the iterator leaves the batch; `cache` then holds exactly the tokens fed,
    in order. `position_shift`: the row's (`DecodeBatch.join`)."""
    if max_tokens <= 0:
        return
    token = pick(logits)
    mx.async_eval(token)
    yield token.item()
    yield from joined_tokens(
        batch, cache, token, pick, max_tokens - 1, position_shift=position_shift
    )


def joined_tokens(
    batch: DecodeBatch,
    cache: ModelCache,
    last: mx.array,
    pick: TokenPicker,
    left: int,
    leave_when: Callable[[], bool] | None = None,
    position_shift: int = 0,
) -> Generator[int | Pause, None, list[int]]:
    """Yields the `left` tokens after `last` (picked by `pick`, not yet in `cache`), decoding
    in `batch`, and `PAUSE` where it waits (`DecodeBatch.waits`): how a request decoding alone so
    far goes on with others. `leave_when` is asked after each token; True takes the row out
    at once and returns the tokens picked for it and not yet yielded (the newest not fed),
    from which it goes on alone. `position_shift`: the row's (`DecodeBatch.join`)."""
    if left <= 0:
        return []
    row = batch.join(cache, last, pick, left, position_shift)
    try:
        while True:
            if batch.waits(row):
                yield PAUSE
                continue
            if (token := batch.next_token(row)) is None:
                break
            yield token
            if leave_when is not None and leave_when():
                return batch.detach(row)
    finally:
        batch.leave(row)
    return []
