"""The report of `benchmarks.gpu_check`: the machine it ran on, the suite's outcome, and the one
summary table (Markdown, PASS/FAIL per goal of issue 41) with its JSON.

A goal's row says PASS or FAIL; a figure with no goal says "-"; a figure that was not measured
(its part failed or ran out of time) says "n/a", which is no PASS.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

PREFILL_GOAL, DECODE_GOAL, STREAMS_GOAL, TTFT_GOAL = 1.2, 1.1, 1.0, 0.6

_PROBE = """
import importlib.metadata as m, json, os, platform
import mlxkv
import mlx.core as mx
from mlxkv.platform import blas
cuda = getattr(mx, "cuda", None)
print(json.dumps({"device": "cpu" if mx.default_device() == mx.cpu else "gpu",
    "mlx": mx.__version__, "mlx_lm": m.version("mlx-lm"),
    "cuda": bool(cuda and cuda.is_available()), "blas": blas.blas_in_use,
    "python": platform.python_version(), "cpus": os.cpu_count()}))
"""


def machine() -> dict:
    """MLX's default device and versions (probed in a child process), and the GPU's name."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
        )
        found = json.loads(probe.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as error:
        return {"error": str(getattr(error, "stderr", "") or error)[-500:]}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        found["gpu"] = smi.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        found["gpu"] = None
    return found


def unmet_requirements(pyproject: Path) -> list[str]:
    """mlxkv's own dependencies (pyproject.toml) that the installed packages do not satisfy.

    The GPU machine installs carried wheels without resolving them, so a wheel of the wrong
    version fails tests for reasons of its own (2026-11-27: llguidance 1.6.1 against >=1.9
    failed every grammar test); this names it in the table instead."""
    unmet = []
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            found = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{requirement.name} missing (needs {requirement.specifier})")
            continue
        if not requirement.specifier.contains(found, prereleases=True):
            unmet.append(f"{requirement.name} {found} (needs {requirement.specifier})")
    return unmet


def tests_outcome(out: Path) -> dict:
    """Counts from pytest's junit file (from its log's per-test lines, -v, where pytest was
    killed before writing one), and how many tests were collected."""
    found = _junit_outcome(out / "pytest.xml") or _outcome_from_log(out / "pytest.log")
    log = out / "pytest.log"
    collected = re.search(r"collected (\d+) item", log.read_text()) if log.exists() else None
    found["collected"] = int(collected.group(1)) if collected else None
    return found


def _junit_outcome(path: Path) -> dict | None:
    try:
        root = ElementTree.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failed = []
        for case in suite.iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                name = f"{case.get('classname')}::{case.get('name')}"
                failed.append(f"{name}: {(bad.get('message') or '').partition(chr(10))[0][:160]}")
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        seconds = float(suite.get("time", 0))
        return {"source": "junit", "seconds": seconds, "passed": passed, **counts,
                "failed_tests": failed[:20]}  # fmt: skip
    except (OSError, ElementTree.ParseError, AttributeError):
        return None


def _outcome_from_log(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.exists() else ""
    found = {"source": "log", "tests": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0}
    for line in text.splitlines():  # each test's line under -v
        for word, key in (
            ("PASSED", "passed"),
            ("FAILED", "failures"),
            ("ERROR", "errors"),
            ("SKIPPED", "skipped"),
        ):
            if re.search(rf"::\S+ {word}\b", line):
                found[key] += 1
    found["tests"] = sum(found[k] for k in ("passed", "failures", "errors", "skipped"))
    return found


def _ratio_row(part, measure, ours, theirs, ratio, goal=None, at_least=True) -> list[str]:
    if ratio is None:
        return [part, measure, "n/a", "n/a", "n/a", _goal(goal, at_least), "n/a"]
    verdict = "-"
    if goal is not None:
        verdict = "PASS" if (ratio >= goal if at_least else ratio <= goal) else "FAIL"
    return [part, measure, ours, theirs, f"{ratio:.2f}x", _goal(goal, at_least), verdict]


def _goal(goal, at_least) -> str:
    return "-" if goal is None else f"{'>=' if at_least else '<='} {goal}x"


def _throughput_rows(results: dict, plan: dict) -> list[list[str]]:
    rows = []
    for dtype in plan["dtypes"]:
        found = results.get(dtype, {})
        for n in plan["prefill_sizes"]:
            r = found.get("prefill", {}).get(str(n))
            rows.append(
                _ratio_row(f"prefill {dtype}", f"{n} tokens, tok/s", *_pair(r), PREFILL_GOAL)
            )
            rows += _breakdown_rows(f"prefill {dtype}", n, r)
        rows += _new_length_rows(f"prefill {dtype}", found.get("new_length"))
        r = found.get("decode") or None
        measure = f"{r['tokens'] if r else plan['decode_tokens']} tokens, tok/s"
        rows.append(_ratio_row(f"decode {dtype}", measure, *_pair(r), DECODE_GOAL))
        if r and "decode_loop_tps" in r:
            loop = r["decode_loop_tps"]["median"]
            theirs = r["mlx_lm_tps"]["median"]
            rows.append(_ratio_row(f"decode {dtype}", "loop alone (no Runner), tok/s",
                                   f"{loop:,.1f}", f"{theirs:,.1f}", loop / theirs))  # fmt: skip
    return rows


def _new_length_rows(part: str, r: dict | None) -> list[list[str]]:
    """A turn's first token when its count of new tokens was never seen before, against the
    same count every turn (benchmarks/throughput.py `new_length_cost`): what per-shape kernel
    builds cost an agent's turn."""
    if not r:
        return []
    new, seen = r["new_s"]["median"] * 1000, r["seen_s"]["median"] * 1000
    measure = f"turn on {r['prefix_tokens']:,} cached: new / seen length, first token ms"
    return [_ratio_row(part, measure, f"{new:,.1f}", f"{seen:,.1f} (mlxkv, seen)", new / seen)]


def _breakdown_rows(part: str, n: int, r: dict | None) -> list[list[str]]:
    """Where a prefill gap lies (benchmarks/throughput.py `breakdown`): mlxkv's cache alone,
    then alone with each of mlx-lm's ways (clearing after every chunk, a stream of its own),
    against mlx-lm's median and mlx-lm on the default stream."""
    if not r or "cache_only_tps" not in r:
        return []
    theirs = r["mlx_lm_tps"]["median"]
    alone = r["cache_only_tps"]["median"]
    rows = [_ratio_row(part, f"{n}: cache alone (no Runner)", f"{alone:,.0f}", f"{theirs:,.0f}",
                       alone / theirs)]  # fmt: skip
    variants = r.get("breakdown") or {}
    if variants:
        clear, own = variants["cache_only_clear_tps"], variants["cache_only_stream_tps"]
        default = variants["mlx_lm_default_stream_tps"]
        rows.append(_ratio_row(part, f"{n}: alone, clear per chunk / own stream (best)",
                               f"{clear:,.0f} / {own:,.0f}", f"{default:,.0f} default stream",
                               max(clear, own) / default))  # fmt: skip
    return rows


def _pair(r: dict | None) -> tuple:
    if not r:
        return None, None, None
    return f"{r['mlxkv_tps']['median']:,.1f}", f"{r['mlx_lm_tps']['median']:,.1f}", r["ratio"]


def _stream_rows(results: dict, plan: dict) -> list[list[str]]:
    rows = []
    for n in ("1", "4", "8"):
        r = results.get("summary", {}).get(n)
        ours, theirs = (f"{r['mlxkv_tps']:,.1f}", f"{r['mlx_lm_tps']:,.1f}") if r else ("", "")
        goal = None if n == "1" else STREAMS_GOAL
        measure = f"{n} x {plan['stream_tokens']} tokens, tok/s"
        rows.append(
            _ratio_row(
                f"{n} stream{'' if n == '1' else 's'}",
                measure,
                ours,
                theirs,
                r and r["ratio"],
                goal,
            )
        )
    return rows


def _agent_rows(results: dict, plan: dict) -> list[list[str]]:
    rows = []
    for agent in plan["agents"]:
        turns = results.get(agent, {})
        ours, theirs = turns.get("mlxkv serve", []), turns.get("mlx_lm.server", [])
        pairs = list(zip(ours, theirs, strict=False))
        first = pairs[0] if pairs else None
        rows.append(
            _ratio_row(
                f"agent {agent}",
                "turn 1 TTFT, s (cold)",
                *_ttfts(pairs[:1]),
                first and first[0][0] / first[1][0],
            )
        )
        later = pairs[1:]
        ratio = statistics.median(a[0] / b[0] for a, b in later) if later else None
        measure = f"turns 2-{len(pairs)} TTFT, s (sum; ratio: median of turns)"
        rows.append(_ratio_row(f"agent {agent}", measure, *_ttfts(later), ratio, TTFT_GOAL, False))
        if pairs:
            rows.append(
                [
                    f"agent {agent}",
                    "cached/prompt tokens, all turns",
                    _cached(ours),
                    _cached(theirs),
                    "-",
                    "-",
                    "-",
                ]
            )
    return rows


def _ttfts(pairs: list) -> tuple[str, str]:
    return f"{sum(a[0] for a, _ in pairs):.3f}", f"{sum(b[0] for _, b in pairs):.3f}"


def _cached(turns: list) -> str:
    cached = sum(t[2] or 0 for t in turns)
    prompt = sum(t[1] or 0 for t in turns)
    return f"{cached:,}/{prompt:,}"


def _tests_row(found: dict | None) -> list[str]:
    if not found or not found.get("tests"):
        return ["suite", "GPU-relevant tests", "n/a", "-", "-", "green", "n/a"]
    bad = found["failures"] + found["errors"]
    text = (
        f"{found['passed']} passed, {found['failures']} failed, {found['errors']} errors, "
        f"{found['skipped']} skipped"
    )
    verdict = "PASS" if bad == 0 and not found.get("stopped") else "FAIL"
    measure = f"{found['tests']} of {found.get('collected')} tests run"
    if found.get("stopped"):
        measure += ", stopped at the budget"
    return ["suite", measure, text, "-", "-", "green", verdict]


def summarize(report: dict, out: Path, elapsed_s: float) -> str:
    """Writes summary.md and summary.json to `out`; returns the Markdown."""
    plan, results, parts = report["plan"], report["results"], report["parts"]
    tests = results.get("tests")
    if tests is not None:
        tests["stopped"] = not parts.get("tests", {}).get("status", "").startswith(("ok", "failed"))
    rows = [
        [
            name,
            "run",
            part["status"],
            f"{part['seconds']} s",
            "-",
            "-",
            "-" if part["status"] == "ok" else "FAIL",
        ]
        for name, part in parts.items()
    ]
    unmet = report.get("unmet_requirements", [])
    rows.append(
        ["environment", "mlxkv's dependencies", "; ".join(unmet) or "all met", "-", "-", "met"]
        + ["FAIL" if unmet else "PASS"]
    )
    if "tests" in parts:
        rows.append(_tests_row(tests))
    if "throughput" in parts:
        rows += _throughput_rows(results.get("throughput", {}), plan)
    if "batching" in parts:
        rows += _stream_rows(results.get("batching", {}), plan)
    if "agent" in parts:
        rows += _agent_rows(results.get("agent", {}), plan)
    header = ["part", "measure", "mlxkv", "mlx-lm / mlx_lm.server", "ratio", "goal", "result"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    m = report["machine"]
    title = (
        f"# mlxkv check on {plan['device']}{' (quick)' if plan.get('quick') else ''}: "
        f"model {plan['model']}, {elapsed_s:.0f} s\n\n"
        f"mlx {m.get('mlx')}, mlx-lm {m.get('mlx_lm')}, device {m.get('device')}, "
        f"GPU {m.get('gpu')}, BLAS {m.get('blas')}, {m.get('cpus')} CPUs\n"
    )
    markdown = title + "\n" + "\n".join(lines) + "\n"
    if tests and tests.get("failed_tests"):
        markdown += "\nFailed tests:\n" + "".join(f"- {t}\n" for t in tests["failed_tests"])
    (out / "summary.md").write_text(markdown)
    summary = {**report, "rows": rows, "elapsed_s": round(elapsed_s, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return markdown
