"""The README's "A request's path" is the path a request takes: every function and method it
names (`mlxkv.`-dotted, in backticks) runs while a streamed chat request is served. A reroute
(another decoder, a step that moved) fails here instead of leaving a newcomer a false map;
`tests/test_doc_references.py` only checks that the names exist."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import threading
import types

from mlxkv import Runner
from mlxkv.runner.hooks import request_ends
from tests.server.conftest import serve
from tests.test_doc_references import ROOT

_CITED = re.compile(r"`(mlxkv(?:\.\w+)+)`")


def _path_section() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("A request's path")
    return readme[start : readme.index("\n## ", start)]


def _named_code(section: str) -> dict[types.CodeType, str]:
    """The code object of each function and method the section names, by its name (classes,
    which name data rather than a step, are left out)."""
    named = {}
    for name in _CITED.findall(section):
        parts = name.split(".")
        target = importlib.import_module(parts[0])
        for depth, part in enumerate(parts[1:], 2):
            try:
                target = importlib.import_module(".".join(parts[:depth]))
            except ImportError:  # an attribute: a function, a class or a method
                target = getattr(target, part)
        if inspect.isfunction(target):
            named[inspect.unwrap(target).__code__] = name
    return named


class _StepsRun:
    """Which of `named` (code -> name) run, on this thread and on every thread started while
    it is entered (`threading.setprofile`), and on a thread started before where `install`
    runs: the Runner's engine thread may be one kept from an earlier Runner."""

    def __init__(self, named: dict[types.CodeType, str]):
        self.named = named
        self.seen: set[str] = set()
        self._done = threading.Event()

    def __call__(self, frame, event, _arg):
        if self._done.is_set():  # a thread kept for later Runners drops it itself
            sys.setprofile(None)
        elif event == "call" and frame.f_code in self.named:
            self.seen.add(self.named[frame.f_code])

    def install(self, *_) -> None:
        sys.setprofile(self)

    def __enter__(self) -> _StepsRun:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *_) -> None:
        self._done.set()
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def test_a_streamed_chat_runs_every_step_the_readme_names(loaded_tiny):
    named = _named_code(_path_section())
    assert len(named) >= 12, f"the section names too few steps to check: {sorted(named.values())}"
    runner = Runner(loaded_tiny("llama"), max_context=1024, warmup=False)
    with _StepsRun(named) as steps, runner, serve(runner) as served:
        with request_ends(steps.install):  # on the engine thread, as each request ends
            runner.generate("Hello", max_tokens=1)
        steps.seen.clear()
        stream = served.openai().chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Where does a request go?"}],
            max_tokens=4,
            temperature=0.0,
            stream=True,
        )
        chunks = list(stream)
        seen = set(steps.seen)
    assert chunks and chunks[-1].choices[0].finish_reason is not None
    missing = sorted(set(named.values()) - seen)
    assert not missing, f"named in the README's request path, never run by a request: {missing}"
