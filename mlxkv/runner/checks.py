"""Type and range checks for settings a user passes, with messages that say what to fix.

Owns: `check_int`, `check_real`. A float where an int belongs (`max_context=2.5`) or a bool
where a number belongs is refused, not silently truncated.
"""

from __future__ import annotations

import math
import numbers


def check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    """Raises ValueError unless `value` is an int (not a bool) in [low, high]."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        upper = f" and <= {high}" if high is not None else ""
        raise ValueError(f"{name} must be >= {low}{upper}, got {value}")


def check_real(name: str, value: object, *, low: float, high: float | None = None) -> None:
    """Raises ValueError unless `value` is a finite number (not a bool) in [low, high]."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low} and finite"
        raise ValueError(f"{name} must be {span}, got {value}")
