"""A pytest plugin for `benchmarks.gpu_check`: caps every Hypothesis test at a few examples,
and runs the tests that matter most on a GPU first.

    python -m pytest -p benchmarks.gpu_check_plugin ...   (GPU_CHECK_EXAMPLES=5 by default)

The property tests set their own `max_examples` (60 and 120 state machines, 25 batches), which a
settings profile cannot lower; the cap is applied to each collected test's settings instead, so
the suite fits a device call's time budget. Hypothesis stays as strict as before otherwise.

A device call stops the suite at its budget (on the H200, 158 tests of 530 in 300 s, the first
of each shape compiling; the folders now hold ~1,900): the tests marked `gpu`, the batching
tests, the property tests and the cache's run before the decoding and Runner tests, so the
ones a GPU backend changes most are the ones that run.
"""

from __future__ import annotations

import os

from hypothesis import settings

# Where a test runs, by the first of these its id holds; the rest come after, in their order.
_FIRST = ("/test_batching", "tests/property/", "tests/cache/", "tests/decoding/")


def _capped(current: settings | None) -> settings:
    cap = int(os.environ.get("GPU_CHECK_EXAMPLES", "5"))
    current = current or settings.default
    return settings(current, max_examples=min(cap, current.max_examples))


def _rank(item) -> int:
    if item.get_closest_marker("gpu") is not None:
        return 0
    found = [rank for rank, part in enumerate(_FIRST, 1) if part in item.nodeid]
    return found[0] if found else len(_FIRST) + 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)  # stable: each group keeps the suite's order
    for item in items:
        test_case = getattr(item, "cls", None)
        if test_case is not None and isinstance(vars(test_case).get("settings"), settings):
            test_case.settings = _capped(test_case.settings)  # a state machine's TestCase
        function = getattr(item, "obj", None)
        function = getattr(function, "__func__", function)  # a method: its function
        if hasattr(function, "_hypothesis_internal_use_settings"):
            function._hypothesis_internal_use_settings = _capped(
                function._hypothesis_internal_use_settings
            )
