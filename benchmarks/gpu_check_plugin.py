"""A pytest plugin for `benchmarks.gpu_check`: caps every Hypothesis test at a few examples.

    python -m pytest -p benchmarks.gpu_check_plugin ...   (GPU_CHECK_EXAMPLES=5 by default)

The property tests set their own `max_examples` (60 and 120 state machines, 25 batches), which a
settings profile cannot lower; the cap is applied to each collected test's settings instead, so
the suite fits a device call's time budget. Hypothesis stays as strict as before otherwise.
"""

from __future__ import annotations

import os

from hypothesis import settings


def _capped(current: settings | None) -> settings:
    cap = int(os.environ.get("GPU_CHECK_EXAMPLES", "5"))
    current = current or settings.default
    return settings(current, max_examples=min(cap, current.max_examples))


def pytest_collection_modifyitems(config, items):
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
