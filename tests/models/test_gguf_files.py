"""Hostile, broken and concurrent GGUF files: one clear error naming the file, never a crash,
never a `.partial` left behind, never a deleted directory we did not write."""

import os
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlxkv import ModelLoadError, UnsupportedFormatError
from mlxkv.models.gguf.convert import _content_hash, convert_gguf, converted_dir, is_conversion
from mlxkv.models.loading import load_model
from tests.factories import tiny_model_dir
from tests.models.test_gguf import llama_cpp_metadata, llama_cpp_tensors, write_gguf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good_gguf(model_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "tiny.gguf"
    return write_gguf(tiny_model_dir("llama", model_root), path)


def _crafted_header(path: Path) -> Path:
    """Right magic and version, one metadata key whose string length is 2**62."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**62) + b"x")
    return path


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if ".partial" in p.name)


def test_crafted_header_is_an_error_not_a_segfault(tmp_path):
    """MLX's reader crashed the process on this file (generate, info and convert)."""
    crafted = _crafted_header(tmp_path / "crafted.gguf")
    for command in (["info", str(crafted)], ["convert", str(crafted), str(tmp_path / "out")]):
        result = subprocess.run(
            [sys.executable, "-m", "mlxkv.cli", *command],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "MLXKV_CACHE_DIR": str(tmp_path / "cache")},
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("mlxkv: error: crafted.gguf is not a valid GGUF file")
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "the file is empty"),
        (os.urandom(4096), "not b'GGUF'"),
        ("truncated", "past the end of the file"),
    ],
    ids=["empty", "random", "truncated"],  # deterministic: the random bytes differ per run
)
def test_empty_random_and_truncated_files(good_gguf, tmp_path, monkeypatch, content, message):
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    data = good_gguf.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if content == "truncated" else content)
    with pytest.raises(UnsupportedFormatError, match=f"bad.gguf .*{message}"):
        load_model(bad)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("key", ["llama.block_count", "llama.attention.head_count"])
def test_zero_or_missing_llama_metadata_is_named(model_root, tmp_path, key):
    path = write_gguf(
        tiny_model_dir("llama", model_root), tmp_path / "z.gguf", **{key: mx.array(0, mx.uint32)}
    )
    with pytest.raises(UnsupportedFormatError, match=f"z.gguf: GGUF metadata {key} is 0"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_sentencepiece_tokenizer_is_refused_before_any_weight_is_converted(
    model_root, tmp_path, monkeypatch
):
    import mlxkv.models.gguf.convert as gguf

    path = write_gguf(
        tiny_model_dir("llama", model_root),
        tmp_path / "sp.gguf",
        **{"tokenizer.ggml.model": "llama"},
    )
    monkeypatch.setattr(gguf, "_weights", lambda *a: pytest.fail("converted weights first"))
    with pytest.raises(UnsupportedFormatError, match="tokenizer model 'llama' is not supported"):
        converted_dir(path, cache_root=tmp_path / "cache")
    assert _leftovers(tmp_path) == [] and not list((tmp_path / "cache").rglob("*.safetensors"))


def test_corrupt_conversion_is_converted_again(good_gguf, tmp_path, caplog, monkeypatch):
    first = converted_dir(good_gguf, cache_root=tmp_path)
    weights = first / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated cache entry
    assert not is_conversion(first)
    with caplog.at_level("WARNING", logger="mlxkv"):
        again = converted_dir(good_gguf, cache_root=tmp_path)
    assert again == first and is_conversion(again)
    assert any("incomplete or corrupt" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    assert load_model(good_gguf).config["model_type"] == "llama"


@pytest.mark.parametrize("damaged", ["model.safetensors", "config.json", "tokenizer.json"])
def test_conversion_changed_in_place_is_converted_again(
    good_gguf, tmp_path, caplog, monkeypatch, damaged
):
    """Bytes of a cached conversion changed at the same size (the sizes match, so it was
    reused): loading failed on every later run, for good. The cache is ours: convert again."""
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    first = converted_dir(good_gguf)
    target = first / damaged
    data = bytearray(target.read_bytes())
    start = 8 if damaged == "model.safetensors" else 0  # JSON: the safetensors header's
    data[start : start + 4] = b"XXXX"
    target.write_bytes(bytes(data))
    assert is_conversion(first)
    with caplog.at_level("WARNING", logger="mlxkv"):
        loaded = load_model(good_gguf)
    assert loaded.config["model_type"] == "llama" and loaded.path == first
    assert any("converting again" in r.getMessage() for r in caplog.records)
    assert _leftovers(tmp_path) == [] and [p.name for p in first.parent.iterdir()] == [first.name]


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("[malloc] Unable to allocate 1073741824 bytes"),
        OSError(24, "Too many open files"),
        RuntimeError("[load_safetensors] Failed to open file /cache/gguf/x/model.safetensors"),
    ],
    ids=["out_of_memory", "open_files", "open_files_in_mlx"],
)
def test_a_machine_that_fails_the_load_keeps_the_conversion(
    good_gguf, tmp_path, caplog, monkeypatch, failure
):
    """Out of memory or of open files says nothing about the conversion: it was dropped and
    converted again (minutes for a large GGUF), then dropped too, so every run under memory
    pressure converted twice and kept nothing. The load fails, the conversion stays."""
    import mlx_lm.utils

    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    first = load_model(good_gguf).path
    assert is_conversion(first)

    def failing(*args, **kwargs):
        raise failure

    monkeypatch.setattr(mlx_lm.utils, "load", failing)
    with caplog.at_level("WARNING", logger="mlxkv"), pytest.raises(ModelLoadError):
        load_model(good_gguf)
    assert is_conversion(first)
    assert not any("converting again" in r.getMessage() for r in caplog.records)


# Each process waits, with its weights written, until both are there: the two conversions
# overlap for certain, however fast the machine.
_CONVERT_TOGETHER = """
import os, sys, time, pathlib
import mlxkv.models.gguf.convert as gguf
barrier, real = pathlib.Path(sys.argv[2]), gguf._write_manifest
def together(directory, source):
    (barrier / str(os.getpid())).touch()
    end = time.monotonic() + 30
    while len(list(barrier.iterdir())) < 2 and time.monotonic() < end:
        time.sleep(0.02)
    real(directory, source)
gguf._write_manifest = together
print(gguf.converted_dir(sys.argv[1]))
"""


def test_two_processes_converting_the_same_file_both_succeed(good_gguf, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "MLXKV_CACHE_DIR": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONVERT_TOGETHER, str(good_gguf), str(barrier)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-1500:] for _, err in outs]
    assert len(list(barrier.iterdir())) == 2
    assert outs[0][0] == outs[1][0] and is_conversion(Path(outs[0][0].strip()))
    assert _leftovers(tmp_path) == [] and not list((tmp_path / "cache" / "gguf").glob(".*"))


def test_convert_never_deletes_what_it_did_not_write(good_gguf, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "precious.txt").write_text("keep me")
    with pytest.raises(ModelLoadError, match="not empty and is not an mlxkv conversion"):
        convert_gguf(good_gguf, models)
    assert (models / "precious.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="is a file"):
        convert_gguf(good_gguf, tmp_path / "file")
    with pytest.raises(ModelLoadError, match="is a directory, not a GGUF file"):
        convert_gguf(models, tmp_path / "out")
    out = convert_gguf(good_gguf, tmp_path / "out")
    assert convert_gguf(good_gguf, out) == out and is_conversion(out)  # ours: replaced
    assert _leftovers(tmp_path) == []


def _gone_pid() -> int:
    """The id of a process that has ended (and was reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_a_conversion_killed_mid_way_leaves_nothing_after_the_next(good_gguf, tmp_path):
    """`kill -9` (or power loss) during a conversion left its temporary directory (or the
    earlier conversion it was replacing) in the conversion cache forever: the next conversion
    there removes what a process that is gone left, and nothing of a running process, nor any
    other name."""
    gone, cache = _gone_pid(), tmp_path / "cache"
    out = cache / "gguf" / _content_hash(good_gguf)
    out.parent.mkdir(parents=True)
    left = [
        out.parent / f".{out.name}.partial-{gone}-x1y2z3w4",
        out.parent / f".{out.name}.old-{gone}-0a1b2c3d",
    ]
    kept = [
        out.parent / f".{out.name}.partial-{os.getpid()}-abcd1234",  # running
        out.parent / f".{out.name}.partial-{gone}-backup",  # not a name it makes
        out.parent / f".{out.name}.old-{gone}",
    ]
    for directory in left + kept:
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"x" * 64)
    assert converted_dir(good_gguf, cache_root=cache) == out and is_conversion(out)
    assert [d.exists() for d in left + kept] == [False, False, True, True, True]


def test_convert_into_a_users_folder_sweeps_nothing_beside_it(good_gguf, tmp_path):
    """`mlxkv convert X.gguf ~/models/foo` removed the user's `.foo.old-2023` beside it (any
    name of that shape whose number was no running pid): outside the conversion cache
    nothing is swept."""
    gone = _gone_pid()
    theirs = [tmp_path / f".out.old-{gone}-0a1b2c3d", tmp_path / f".out.partial-{gone}-x1y2z3w4"]
    for directory in theirs:
        directory.mkdir()
        (directory / "notes.txt").write_text("keep me")
    convert_gguf(good_gguf, tmp_path / "out")
    assert all((d / "notes.txt").read_text() == "keep me" for d in theirs)


def test_a_signal_between_the_renames_puts_the_earlier_conversion_back(
    good_gguf, tmp_path, monkeypatch
):
    """Ctrl-C or SIGTERM between moving the earlier conversion aside and moving the new one in
    left no conversion at `out`, only a hidden `.out.old-PID`: the earlier one is put back."""
    out = convert_gguf(good_gguf, tmp_path / "out")
    renames, real_rename = [], os.rename

    def interrupted_rename(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr("mlxkv.models.gguf.convert.os.rename", interrupted_rename)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(good_gguf, out)
    assert is_conversion(out) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("stranger", ["file", "folder", "manifest_only"])
def test_convert_keeps_what_a_user_added_to_an_earlier_conversion(good_gguf, tmp_path, stranger):
    """Converting again into an earlier conversion replaced the whole directory, deleting files
    the user had put beside the model (notes, an adapter): it is refused, naming them."""
    out = tmp_path / "out"
    if stranger == "manifest_only":  # a file of that name says nothing of the files beside it
        out.mkdir()
        (out / "mlxkv-conversion.json").write_text("{}")
        added = out / "precious.txt"
    else:
        convert_gguf(good_gguf, out)
        added = out / ("notes.txt" if stranger == "file" else "adapters/adapter.safetensors")
    added.parent.mkdir(exist_ok=True)
    added.write_text("keep me")
    named = added.relative_to(out).parts[0]
    why = "is not an mlxkv conversion" if stranger == "manifest_only" else f"also holds {named},"
    with pytest.raises(ModelLoadError, match=f"{why}.*nothing was written"):
        convert_gguf(good_gguf, out)
    assert added.read_text() == "keep me"
    assert _leftovers(tmp_path) == [] and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("setting", ["file", "unwritable"])
def test_cache_dir_that_cannot_be_used_is_one_clear_error(
    good_gguf, tmp_path, monkeypatch, setting
):
    target = tmp_path / "f"
    target.write_text("x")
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(target if setting == "file" else target / "sub"))
    with pytest.raises(ModelLoadError, match="is not a directory|cannot write a conversion"):
        load_model(good_gguf)


def test_blas_setting_that_is_not_a_library_warns_and_imports(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "import mlxkv; print('imported')"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MLXKV_OPENBLAS": "/etc/hostname"},
    )
    assert result.returncode == 0 and result.stdout.strip() == "imported", result.stderr
    assert "could not load /etc/hostname" in result.stderr


def test_a_gguf_without_most_weights_is_one_line_and_leaves_no_conversion(
    model_root, tmp_path, monkeypatch
):
    """A GGUF whose tensor table lists 3 of a model's tensors (a hostile or broken file passes
    the header checks: each tensor it lists is in bounds) was converted, failed to load, was
    converted again and failed again with mlx-lm's error, one line per missing weight (270
    lines for SmolLM2), and the broken conversion stayed in the cache for every later run."""
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    model_dir = tiny_model_dir("llama", model_root)
    tensors = dict(list(llama_cpp_tensors(model_dir).items())[:3])
    path = tmp_path / "few.gguf"
    mx.save_gguf(str(path), tensors, llama_cpp_metadata(model_dir, architecture="llama"))
    with pytest.raises(ModelLoadError) as refused:
        load_model(path)
    message = str(refused.value)
    assert "\n" not in message and len(message) < 600, message
    assert "Missing" in message and message.startswith("could not load a model from few.gguf:")
    assert [p for p in (tmp_path / "gguf").iterdir() if p.is_dir()] == []
