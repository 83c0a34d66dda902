"""Sampled token ids -> the text chunks a caller streams.

Owns `emit_chunks`: detokenizing, EOS, stop strings (text after a stop string is never
shown), per-request cancel, and the final chunk with the `Completion` (its reply's ids
remembered by `request_run` before it is handed on). Does not own how the tokens were produced
(`mlxkv.decoding.plain.decode_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mlxkv.decoding.pause import PAUSE, Pause
from mlxkv.decoding.picker import TokenPicker
from mlxkv.runner.request import Request
from mlxkv.runner.results import CompletionStats, GenerationChunk
from mlxkv.runner.text.stop_strings import StopStrings


def emit_chunks(
    tokenizer: Any,
    decoded: Iterator[int | None],
    stats: CompletionStats,
    request: Request,
    pick: TokenPicker,
) -> Iterator[GenerationChunk | Pause]:
    """Yields one chunk per sampled token that is not EOS, then the final chunk, and `PAUSE`
    where `decoded` pauses (batched decoding letting other work run); EOS, a stop
    string, and the request's cancel flag end it (the generator `decoded` is then left, which
    stops the model)."""
    stops = StopStrings(request.params.stop)
    continues = request.reply_start is not None or request.continues_text
    detokenizer = _detokenizer(tokenizer, continues=continues)
    finish, cut_by_stop_string, end = "length", False, None
    for token in decoded:
        if token is PAUSE:  # batched decoding lets other work run first
            yield PAUSE
            continue
        stats.sampled()
        logprob = pick.pop_logprob()
        if token in tokenizer.eos_token_ids:
            finish, end = "stop", (token, logprob)
            break
        detokenizer.add_token(token)
        text, stopped = stops.push(detokenizer.last_segment)
        yield stats.chunk(token, text, logprob)
        if stopped:
            finish, cut_by_stop_string = "stop", True
            break
        if request.cancelled.is_set():
            finish = "cancelled"
            break
    if hasattr(decoded, "close"):  # stop the model now, not when the caller moves on
        decoded.close()
    tail = ""
    if not cut_by_stop_string:
        detokenizer.finalize()  # text held back (e.g. trailing spaces) may complete a stop
        tail, stopped = stops.finish(detokenizer.last_segment)
        if stopped and finish == "length":
            finish = "stop"
        stats.text.append(tail)
    yield stats.final_chunk(tail, finish, stops.matched, end)


def _detokenizer(tokenizer: Any, *, continues: bool) -> Any:
    """mlx-lm's streaming detokenizer, which drops the space a reply's first token holds (a
    reply begins a message); for a reply that continues text (Anthropic's prefill, where the
    request knows its start: `Request.reply_start`; a raw prompt's: `continues_text`) it is
    primed with a letter first, so the space stays: "France is" + " Paris", not "isParis"."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    if continues:
        detokenizer.add_token(tokenizer.encode("a", add_special_tokens=False)[-1])
        detokenizer.finalize()
        _ = detokenizer.last_segment  # the letter's: read, not the reply's
    return detokenizer
