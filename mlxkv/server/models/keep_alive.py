"""Ollama's `keep_alive`, read as Ollama reads it (`api.Duration.UnmarshalJSON`): a number is
seconds, a string is a Go duration (`time.ParseDuration`: "5m", "1h30m", "0", "-1s"), and any
negative value keeps the model loaded for good. A zero duration, in any spelling ("0s",
"0m0s", "0.0h"), is Ollama's way to unload the model. A value Ollama would refuse is refused
here too, with Go's message: a client sees the same 400 from either server.

Owns `keep_alive_ns`. Ported from Go's `time.ParseDuration` (same grammar, same overflow
limits, same error wording), so that no spelling answers differently from Ollama.
"""

from __future__ import annotations

import math
from typing import Any

FOREVER = (1 << 63) - 1  # Go's math.MaxInt64, what Ollama stores for a negative keep_alive
_UNITS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign
    "\u03bcs": 1_000,  # Greek mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
# What Go's reflect names the JSON types Ollama does not take (its "Unsupported type" error).
_GO_TYPES = {bool: "bool", list: "[]interface {}", dict: "map[string]interface {}"}


def keep_alive_ns(value: Any) -> int | None:
    """The keep_alive in nanoseconds (`FOREVER` for a negative one), None when not sent.

    Raises:
        ValueError: with Ollama's message, for a value Ollama answers with a 400.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"Unsupported type: '{_GO_TYPES.get(type(value), type(value).__name__)}'")
    if isinstance(value, str):
        duration = go_duration(value)
        return FOREVER if duration < 0 else duration
    if isinstance(value, float) and not math.isfinite(value):
        # Python's JSON reads 1e400, Infinity and NaN (Go's refuses them: a 400 there too).
        raise ValueError(f"keep_alive must be a finite number of seconds, got {value}")
    if value < 0:
        return FOREVER
    ns = value * 1_000_000_000  # a float may overflow to inf: only zero or not matters
    return FOREVER if ns >= FOREVER else int(ns)


def go_duration(text: str) -> int:
    """Go's `time.ParseDuration`: nanoseconds, or ValueError with Go's message. Linear in
    the text's length (a client may send megabytes)."""
    negative = text[:1] == "-"
    pos = 1 if text[:1] in ("-", "+") else 0
    if text[pos:] == "0":
        return 0
    if pos == len(text):
        raise _invalid(text)
    total = 0
    while pos < len(text):
        value, pos = _term(text, pos)
        total += value
        if total > 1 << 63:
            raise _invalid(text)
    if not negative and total > FOREVER:
        raise _invalid(text)
    return -total if negative else total


def _term(text: str, pos: int) -> tuple[int, int]:
    """One `[0-9]*(.[0-9]*)?unit` of `text` at `pos`: its nanoseconds and where it ends."""
    if not (text[pos] == "." or _is_digit(text[pos])):
        raise _invalid(text)
    whole, end = _leading_int(text, pos)
    if whole is None:
        raise _invalid(text)
    digits, pos = end - pos, end
    fraction, scale, fraction_digits = 0, 1.0, 0
    if text[pos : pos + 1] == ".":
        fraction, scale, end = _leading_fraction(text, pos + 1)
        fraction_digits, pos = end - pos - 1, end
    if digits == 0 and fraction_digits == 0:  # no digits at all (".s")
        raise _invalid(text)
    end = pos
    while end < len(text) and not (text[end] == "." or _is_digit(text[end])):
        end += 1
    if end == pos:
        raise ValueError(f"time: missing unit in duration {_quote(text)}")
    name = text[pos:end]
    unit = _UNITS.get(name)
    if unit is None:
        raise ValueError(f"time: unknown unit {_quote(name)} in duration {_quote(text)}")
    if whole > (1 << 63) // unit:
        raise _invalid(text)
    value = whole * unit
    if fraction > 0:
        value += int(float(fraction) * (float(unit) / scale))
        if value > 1 << 63:
            raise _invalid(text)
    return value, end


def _invalid(text: str) -> ValueError:
    return ValueError(f"time: invalid duration {_quote(text)}")


def _is_digit(char: str) -> bool:
    return "0" <= char <= "9"  # ASCII only, as Go's


def _leading_int(text: str, pos: int) -> tuple[int | None, int]:
    """Go's `leadingInt` at `pos`: the digits' value (None past 2^63) and where they end."""
    value = 0
    while pos < len(text) and _is_digit(text[pos]):
        if value > (1 << 63) // 10:
            return None, pos
        value = value * 10 + int(text[pos])
        if value > 1 << 63:
            return None, pos
        pos += 1
    return value, pos


def _leading_fraction(text: str, pos: int) -> tuple[int, float, int]:
    """Go's `leadingFraction` at `pos`: the digits' value and scale (digits past overflow
    dropped), and where they end."""
    value, scale, overflow = 0, 1.0, False
    while pos < len(text) and _is_digit(text[pos]):
        digit, pos = int(text[pos]), pos + 1
        if overflow or value > ((1 << 63) - 1) // 10 or value * 10 + digit > 1 << 63:
            overflow = True
            continue
        value, scale = value * 10 + digit, scale * 10
    return value, scale, pos


def _quote(text: str) -> str:
    """Go's `time.quote`: in double quotes, other than printable ASCII as `\\x` bytes."""
    out = []
    for char in text:
        if ord(char) >= 0x80 or char < " ":
            out += [f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogatepass")]
        else:
            out.append("\\" + char if char in '"\\' else char)
    return '"' + "".join(out) + '"'
