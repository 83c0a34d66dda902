"""A bounded check of mlxkv where MLX runs on a GPU (rehearsed on the CPU): the suite and the
figures against mlx-lm, in one device call, ending in one Markdown table with PASS/FAIL.

    python -m benchmarks.gpu_check --device gpu|cpu [--quick] [--total-s 420] [--out DIR]
                                   [--parts models tests throughput batching agent]

Parts, in this order, each in a process of its own with a time budget: its share of
`--total-s` (the shares of the parts chosen with --parts, scaled to add up to 1) plus what the
parts before it left unused. One that fails or runs out of time is recorded, stopped (its
process group: SIGINT, then SIGKILL) and the check goes on:
  models      a ~1B factory llama (16 x 2048) in bf16 and 4-bit, the 64k-window agent llama
              (built offline with mlxkv.testing.factory and mlx-lm's convert; kept in --work)
  tests       the suite's GPU-relevant part: tests/cache, decoding, runner,
              property, every test_batching*.py and every file using the `gpu` marker; per-test
              durations, a per-test timeout, Hypothesis capped at a few examples per test
  throughput  prefill tok/s at each size and decode tok/s, bf16 then 4-bit, mlxkv vs mlx-lm
              (benchmarks/throughput.py)
  batching    1, 4 and 8 concurrent streams over HTTP, mlxkv serve vs mlx_lm.server, in turns
              (benchmarks/batching.py)
  agent       the recorded Claude Code / Codex sessions: per-turn TTFT and cached/prompt
              tokens, mlxkv serve vs mlx_lm.server (benchmarks/agent_replay.py)
Goals (issue 41): prefill >= 1.2x mlx-lm, decode >= 1.1x, 4 and 8 streams >= 1.0x
mlx_lm.server, agent turn TTFT (median over the turns after the first) <= 0.6x, suite green.

Writes five files to --out (default $OUT, else /tmp/mlxkv-gpu-check/out): summary.md,
summary.json, pytest.xml, pytest.log, parts.log (every part's output, then the servers' logs'
tails).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check_report import machine, summarize, tests_outcome, unmet_requirements

PARTS = ("models", "tests", "throughput", "batching", "agent")
SHARES = {"models": 0.15, "tests": 0.22, "throughput": 0.28, "batching": 0.15, "agent": 0.20}
GRACE_S = 20  # after SIGINT: pytest writes its junit file, parts stop their servers
_GPU_MARK = re.compile(r"mark\.gpu\b")
_RUNNING: set[int] = set()  # process groups of the parts running now

PLANS = {
    # device, quick -> what is measured
    # shares from the H200 run of 2026-11-27: models took 26 s (given 12%: what a part leaves
    # goes to the next), throughput ~150 s cold, batching ~70 s, agent ~46 s; the tests need a
    # call of their own (~300 s; the plugin runs those that matter most on a GPU first)
    ("gpu", False): {"model": "1b", "prefill_sizes": [2048, 8192, 32768], "decode_tokens": 128,
                     "reps": 3, "stream_tokens": 128, "rounds": 2, "agents": ["claude", "codex"],
                     "agent_turns": 99, "agent_model": "100m", "examples": 5,
                     "shares": {"models": 0.12, "tests": 0.5, "throughput": 0.45,
                                "batching": 0.22, "agent": 0.25}},
    ("gpu", True): {"model": "1b", "prefill_sizes": [2048, 8192], "decode_tokens": 64,
                    "reps": 1, "stream_tokens": 64, "rounds": 1, "agents": ["codex"],
                    "agent_turns": 99, "agent_model": "100m", "examples": 3},
    ("cpu", False): {"model": "small", "prefill_sizes": [2048, 8192], "decode_tokens": 64,
                     "reps": 2, "stream_tokens": 64, "rounds": 2, "agents": ["claude", "codex"],
                     "agent_turns": 99, "agent_model": "tiny", "examples": 5},
    ("cpu", True): {"model": "small", "prefill_sizes": [256, 1024], "decode_tokens": 16,
                    "reps": 1, "stream_tokens": 16, "rounds": 1, "agents": ["codex"],
                    "agent_turns": 3, "agent_model": "tiny", "examples": 3,
                    # a 13k-token cold prompt takes ~30 s per server on 2 cores
                    "shares": {"models": 0.05, "tests": 0.15, "throughput": 0.15,
                               "batching": 0.1, "agent": 0.35}},
}  # fmt: skip


def run_bounded(command: list[str], budget_s: float, log: Path, env: dict | None = None) -> str:
    """Runs `command` in a process group of its own, its output appended to `log`; past
    `budget_s` the group gets SIGINT, then SIGKILL after `GRACE_S`. Returns its status."""
    with log.open("a") as out:
        out.write(f"\n=== {' '.join(command)}  (budget {budget_s:.0f} s)\n")
        out.flush()
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        _RUNNING.add(process.pid)
        try:
            code = process.wait(timeout=max(budget_s, 1))
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait()
            status = f"out of time ({budget_s:.0f} s)"
        _signal_group(process.pid, signal.SIGKILL)  # whatever it left running (servers)
        _RUNNING.discard(process.pid)
    return status


def _stop_parts(signum: int, _frame: object) -> None:
    """On SIGTERM or SIGINT (an outer `timeout`, ^C): a part's group runs in a session of its
    own, which the device machine leaves running after the command, so it is killed first."""
    for pgid in list(_RUNNING):
        _signal_group(pgid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def test_paths(root: Path) -> list[str]:
    """The suite's folders that matter on a GPU, then the batching tests and the files using
    the `gpu` marker that lie outside them."""
    tests = root / "tests"
    folders = [f for f in ("cache", "decoding", "runner", "property") if (tests / f).is_dir()]
    files = {p for p in tests.rglob("test_batching*.py")}
    files |= {p for p in tests.rglob("test_*.py") if _GPU_MARK.search(p.read_text())}
    outside = sorted(p for p in files if p.relative_to(tests).parts[0] not in folders)
    return [f"tests/{f}" for f in folders] + [str(p.relative_to(root)) for p in outside]


def run_tests(plan: dict, budget_s: float, out: Path, log: Path) -> str:
    per_test_s = int(max(30, min(90, budget_s / 2)))  # a hang's bound, not a speed test
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "benchmarks.gpu_check_plugin",
        *test_paths(Path.cwd()),
        "-v",
        "-rfE",
        f"--timeout={per_test_s}",
        "--durations=30",
        "--durations-min=0.5",
        f"--junitxml={out / 'pytest.xml'}",
        "-p",
        "no:cacheprovider",
    ]
    env = {**os.environ, "GPU_CHECK_EXAMPLES": str(plan["examples"]), "HF_HUB_OFFLINE": "1"}
    with log.open("w") as pytest_log:
        pytest_log.write(f"per-test timeout {per_test_s} s, budget {budget_s:.0f} s\n")
    return run_bounded(command, budget_s, log, env)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_parts)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + args.total_s
    plan = {**PLANS[(args.device, args.quick)], "device": args.device, "work": str(args.work)}
    plan.update(dtypes=["bf16", "q4"], quick=args.quick)
    report = {"machine": machine(), "plan": plan, "parts": {}, "results": {}}
    report["unmet_requirements"] = unmet_requirements(Path("pyproject.toml"))
    parts_log = args.out / "parts.log"
    parts_log.write_text("")
    shutil.rmtree(args.work / "logs", ignore_errors=True)  # the servers' logs of this run only
    wrong = _wrong_device(args.device, report["machine"])
    for part in PARTS:
        if part not in args.parts:
            continue
        left_s = deadline - time.monotonic()
        budget_s = left_s - args.total_s * _share_after(part, args.parts, plan)
        begun = time.monotonic()
        if wrong or budget_s < 5:
            status = wrong or "skipped: the total budget is spent"
        elif part == "tests":
            status = run_tests(plan, budget_s, args.out, args.out / "pytest.log")
            report["results"]["tests"] = tests_outcome(args.out)
        else:
            status = _run_part(part, plan, budget_s, args.work, parts_log)
            report["results"][part] = _read_json(args.work / f"{part}.json")
        report["parts"][part] = {"status": status, "seconds": round(time.monotonic() - begun, 1)}
        print(f"{part}: {status} in {report['parts'][part]['seconds']} s", flush=True)
        summarize(report, args.out, time.monotonic() - started)
    _append_server_logs(args.work / "logs", parts_log)
    table = summarize(report, args.out, time.monotonic() - started)
    print("\n" + table)
    return 2 if wrong else 0


def _share_after(part: str, chosen: list[str], plan: dict) -> float:
    """The share of the total that the chosen parts after `part` are kept."""
    shares = {p: plan.get("shares", SHARES)[p] for p in PARTS if p in chosen}
    later = [p for p in PARTS if p in shares and PARTS.index(p) > PARTS.index(part)]
    return sum(shares[p] for p in later) / sum(shares.values())


def _run_part(part: str, plan: dict, budget_s: float, work: Path, log: Path) -> str:
    plan_path, result_path = work / "plan.json", work / f"{part}.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    result_path.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "benchmarks.gpu_check_parts",
        part,
        str(plan_path),
        str(result_path),
    ]
    return run_bounded(command, budget_s, log)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wrong_device(device: str, found: dict) -> str | None:
    """Why the parts cannot run as asked (MLX's default device is not the one named)."""
    if "error" in found:
        return f"skipped: MLX did not start ({found['error']})"
    if (found.get("device") == "cpu") != (device == "cpu"):
        return f"skipped: --device {device}, but MLX's default device is {found.get('device')}"
    return None


def _append_server_logs(logs: Path, parts_log: Path, tail_chars: int = 3000) -> None:
    with parts_log.open("a") as out:
        for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
            out.write(f"\n=== tail of {log.name}\n{log.read_text(errors='replace')[-tail_chars:]}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        choices=("gpu", "cpu"),
        required=True,
        help="where MLX is expected to run (a mismatch is refused)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    parser.add_argument(
        "--total-s",
        type=float,
        default=360.0,
        help="the whole check's time budget, in seconds (parts get shares)",
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    out = os.environ.get("OUT", "/tmp/mlxkv-gpu-check/out")
    parser.add_argument("--out", type=Path, default=Path(out), help="where the 5 files go")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/mlxkv-gpu-check"),
        help="models and part results; kept, so a rerun skips the builds",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
