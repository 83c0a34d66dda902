"""Any Runner method from any thread: first calls on worker threads, clean process exit,
no same-thread deadlocks, read-only calls that never wait, and cancel() that is never lost."""

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv import RunnerBusyError
from tests.runner.test_faults import _assert_consistent

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. What next?"}]


def _within(seconds, fn):
    """Runs fn on a helper thread; fails the test (instead of hanging it) if it blocks."""
    result, errors = [], []
    thread = threading.Thread(
        target=lambda: _capture(fn, result, errors), daemon=True, name="within"
    )
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    if errors:
        raise errors[0]
    return result[0]


def _capture(fn, result, errors):
    try:
        result.append(fn())
    except BaseException as error:  # re-raised on the test's thread
        errors.append(error)


@pytest.fixture(scope="module")
def float16_llama(model_root):
    """The tiny llama stored as float16, so loading casts it to float32 (a lazy cast)."""
    import shutil

    from tests.factories import tiny_model_dir

    source = tiny_model_dir("llama", model_root)
    target = Path(model_root) / "llama-f16"
    if not target.exists():
        shutil.copytree(source, target)
        weights = mx.load(str(source / "model.safetensors"))
        half = {k: v.astype(mx.float16) for k, v in weights.items()}
        mx.save_safetensors(str(target / "model.safetensors"), half, metadata={"format": "mlx"})
    return target


def test_first_use_on_worker_threads_then_main_thread_and_a_clean_exit(float16_llama):
    """Loaded on the main thread, first used from a thread pool with compiled samplers (top_p),
    then from the main thread; the process must also exit with 0 (MLX's per-thread streams
    used to abort it at exit with 'terminate called without an active exception')."""
    script = textwrap.dedent(
        f"""
        from concurrent.futures import ThreadPoolExecutor
        from mlxkv import Runner
        runner = Runner.load({str(float16_llama)!r})
        kwargs = dict(max_tokens=4, temperature=0.7, top_p=0.9, seed=1)
        pool = ThreadPoolExecutor(2)
        a = pool.submit(lambda: runner.generate("hello world", **kwargs).tokens).result()
        b = pool.submit(lambda: runner.cache_info().num_tokens).result()
        c = runner.generate("hello world", **kwargs).tokens
        print("ok", a == c, b > 0)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ok", "True", "True"], result.stderr[-2000:]
    assert "terminate called" not in result.stderr


def test_second_generation_on_the_thread_holding_a_stream_raises(make_runner):
    runner = make_runner("llama")

    def scenario():  # all on one thread, which holds the suspended stream
        suspended = runner.stream(CHAT, max_tokens=8)
        next(suspended)
        with pytest.raises(RunnerBusyError, match="still iterating another stream"):
            runner.generate(CHAT, max_tokens=2)
        with pytest.raises(RunnerBusyError):
            runner.reset()
        suspended.close()
        return runner.generate(CHAT, max_tokens=4)

    out = _within(30, scenario)
    _assert_consistent(runner)
    assert out.tokens == make_runner("llama").generate(CHAT, max_tokens=4).tokens


def test_read_only_calls_inside_a_stream_and_a_progress_callback(make_runner):
    runner = make_runner("llama", prefill_step_size=8)
    seen = []

    def progress(done, total):
        seen.append(runner.cache_info().num_tokens)

    chunks = []
    for chunk in runner.stream(CHAT, max_tokens=4, progress=progress):
        chunks.append(chunk)
        assert runner.cache_info().num_tokens == len(runner.cache_tokens)
        assert runner.encode("hi") and runner.tokenizer is not None
    assert seen == sorted(seen) and seen[-1] > 0
    assert chunks[-1].completion is not None


def test_cache_info_does_not_wait_for_a_generation_on_another_thread(make_runner):
    runner = make_runner("llama", prefill_step_size=8)
    started, release = threading.Event(), threading.Event()

    def progress(done, total):
        started.set()
        release.wait(30)

    worker = threading.Thread(target=lambda: runner.generate(CHAT, max_tokens=2, progress=progress))
    worker.start()
    try:
        assert started.wait(30)
        info = _within(5, runner.cache_info)
        assert info.num_tokens >= 8
    finally:
        release.set()
        worker.join(60)
    _assert_consistent(runner)


def test_cancel_during_prefill_stops_between_chunks_and_keeps_them(make_runner):
    runner = make_runner("llama", prefill_step_size=8)
    prompt = runner.encode(CHAT)
    assert len(prompt) > 24

    def progress(done, total):
        if done >= 16:
            caller = threading.Thread(target=runner.cancel)  # from another thread
            caller.start()
            caller.join()

    out = runner.generate(prompt, max_tokens=20, progress=progress)
    assert out.finish_reason == "cancelled"
    assert out.generation_tokens == 0 and out.tokens == []
    assert runner.cache_tokens == prompt[:16]  # the two chunks fed stay cached
    again = runner.generate(prompt, max_tokens=4)
    assert again.cached_tokens == 16
    assert again.tokens == make_runner("llama").generate(prompt, max_tokens=4).tokens


def test_cancel_right_after_a_request_starts_is_not_lost(make_runner):
    runner = make_runner("llama")
    runner.generate(CHAT, max_tokens=3)
    before = runner.cache_tokens
    started = runner.stream(CHAT + [{"role": "user", "content": "More?"}], max_tokens=20)
    runner.cancel()
    chunks = list(started)
    assert chunks[-1].finish_reason == "cancelled"
    assert chunks[-1].completion.generation_tokens == 0
    assert runner.cache_tokens == before  # cancelled before its turn: nothing touched
    later = runner.generate(CHAT, max_tokens=3)  # started after cancel(): unaffected
    assert later.finish_reason != "cancelled"


def test_a_seeded_request_leaves_later_unseeded_sampling_unpredictable(make_runner):
    """Two Runners (as two server processes would) each answer the same seeded request, then
    the same unseeded one: the seeded answers agree, the unseeded ones must not (the seed used
    to stay behind in the process's random key, making every later answer predictable)."""
    sampled = dict(max_tokens=24, temperature=1.0)
    seeded, unseeded = [], []
    for _ in range(2):
        runner = make_runner("llama")
        seeded.append(runner.generate(CHAT, seed=7, **sampled).tokens)
        unseeded.append(runner.generate(CHAT, **sampled).tokens)
    assert seeded[0] == seeded[1]
    assert unseeded[0] != unseeded[1]
