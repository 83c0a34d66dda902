"""GGUF (llama.cpp's format) to an mlx-lm model directory, converted once and reused.

Owns: the conversion's steps and where it goes: reading and checking the file (`reader`, via
the `gguf` package), its tensors with `mx.load(path, format="gguf")`, mapping llama.cpp tensor
names to mlx-lm's, undoing llama.cpp's row permutation of the q and k projections, writing the
config (`hf_config`) and the tokenizer (`tokenizer`), and caching the result in a user cache
directory keyed by the file's content hash.

Weights are dequantized and stored as float16; `loading` casts them to the fast dtype of the
device (float32 on MLX's CPU backend, where quantized matmuls are ~40x slower).

Supported: architecture `llama`; file types F32, F16, Q4_0, Q4_1, Q8_0 (group size 32).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxkv import config
from mlxkv.errors import ModelLoadError, UnsupportedFormatError
from mlxkv.models.gguf.hf_config import hf_config
from mlxkv.models.gguf.reader import read_metadata
from mlxkv.models.gguf.tokenizer import check_tokenizer, write_tokenizer

# What `_temporary_dir` (mkdtemp's 8 characters) and `_move_into_place` (8 hex digits) name
# beside a conversion, after its name, with the writer's pid.
_LEFTOVER = re.compile(r"\.(?:partial-(\d+)-[a-z0-9_]{8}|old-(\d+)-[0-9a-f]{8})")

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]

_GROUP_SIZE = 32  # every supported GGUF block type packs 32 weights per block

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_MANIFEST = "mlxkv-conversion.json"  # file name -> size in bytes, written last
# Raised when the same file converts to other weights: a conversion of another format is
# converted again. 2: quantized blocks dequantized in float32 (1: in float16).
_FORMAT = 2


def default_cache_root() -> Path:
    """The parent of converted models' `gguf/` directory: `mlxkv.config.cache_root()`.

    Raises:
        ModelLoadError: MLXKV_CACHE_DIR names something that is not a directory.
    """
    try:
        return config.cache_root()
    except ValueError as error:
        raise ModelLoadError(str(error)) from error


def converted_dir(
    gguf_path: str | Path,
    *,
    cache_root: Path | None = None,
    progress: ProgressCallback | None = None,
) -> Path:
    """The mlx-lm directory for a GGUF file, converting it on first use.

    A conversion found in the cache is reused only if its files have the sizes recorded when
    it was written and it was made in this code's conversion format; otherwise (truncated,
    half deleted, made by an older mlxkv) it is converted again.

    Args:
        gguf_path: the .gguf file.
        cache_root: parent of converted models (default `default_cache_root()`).
        progress: called as progress(done, total) in tensors while converting.

    Raises:
        UnsupportedFormatError: not a valid llama-architecture GGUF of a supported tensor type.
        ModelLoadError: no such file, or the cache directory cannot be written.
    """
    path = _checked_source(Path(gguf_path))
    out = (cache_root or default_cache_root()) / "gguf" / _content_hash(path)
    if is_conversion(out) and _manifest_format(out) == _FORMAT:
        logger.info("gguf: reusing conversion of %s at %s", path.name, out)
        return out
    if is_conversion(out):  # replaced in place by `convert_gguf`, as `mlxkv convert` does
        logger.info("gguf: conversion at %s was made by an older mlxkv; converting again", out)
    elif out.exists():
        logger.warning("gguf: conversion at %s is incomplete or corrupt; converting again", out)
        drop_conversion(out)
    _drop_leftovers(out)  # the conversion cache is ours: what a killed conversion left goes
    logger.info("gguf: converting %s to %s", path.name, out)
    return convert_gguf(path, out, progress=progress)


def drop_conversion(directory: Path) -> None:
    """Removes a conversion in the conversion cache (`converted_dir`'s, so ours to remove)."""
    shutil.rmtree(directory, ignore_errors=True)


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, progress: ProgressCallback | None = None
) -> Path:
    """Writes the model in `gguf_path` to `out_dir` in Hugging Face layout (mlx-lm loads it).

    Everything checkable (header, metadata, tokenizer, tensor names) is checked before any
    weight is converted. Files are written to a temporary directory of this process beside
    `out_dir`, which is renamed into place at the end: the directory appears complete or not
    at all, an error leaves nothing behind, and two processes converting at once do not
    collide. `out_dir` may be new, empty, or an earlier conversion holding only its own files;
    anything else is refused, never deleted.

    Raises:
        UnsupportedFormatError: the file is not a valid, supported GGUF.
        ModelLoadError: `gguf_path` is not a file, or `out_dir` is a file, a non-empty
            directory that is not a conversion, a conversion holding other files too, or
            cannot be written.
    """
    path = _checked_source(Path(gguf_path))
    out = Path(out_dir)
    _check_destination(out)
    metadata = read_metadata(path)
    try:
        tensors = mx.load(str(path), format="gguf")
    except (RuntimeError, ValueError) as error:
        raise UnsupportedFormatError(f"{path.name}: MLX could not read it: {error}") from error
    config = hf_config(metadata, tensors, path.name)
    check_tokenizer(metadata, path.name)
    for name in tensors:
        _target_name(name.rsplit(".", 1)[0])
    tmp = _temporary_dir(out)
    try:
        weights = _weights(tensors, config, progress)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_tokenizer(metadata, tmp)
        _write_manifest(tmp, path.name)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_conversion(directory: Path) -> bool:
    """True when `directory` holds a complete conversion: every file the manifest lists, at
    the size it had when written."""
    files = _manifest_files(directory)
    try:
        return bool(files) and all((directory / n).stat().st_size == s for n, s in files.items())
    except OSError:
        return False


def _manifest_files(directory: Path) -> dict[str, int] | None:
    """The files (name -> bytes) a conversion's manifest says it wrote; None without a
    readable manifest."""
    try:
        files = json.loads((directory / _MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, dict) or not all(isinstance(s, int) for s in files.values()):
        return None
    return files


def _manifest_format(directory: Path) -> int | None:
    """The conversion format a complete conversion's manifest records."""
    try:
        return json.loads((directory / _MANIFEST).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def _checked_source(path: Path) -> Path:
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise ModelLoadError(f"no GGUF file at {path}")
    return path


def _check_destination(out: Path) -> None:
    """Refuses an `out` that replacing would delete something this code did not write: a
    file, a directory that is not a conversion, or a conversion holding other entries too."""
    if out.exists() and not out.is_dir():
        raise ModelLoadError(f"{out} is a file; give a new or empty directory to convert into")
    present = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if not present:
        return
    files = _manifest_files(out)
    if files is None:
        raise ModelLoadError(
            f"{out} is not empty and is not an mlxkv conversion; nothing was written. Give a "
            "new or empty directory"
        )
    strangers = sorted(present - set(files) - {_MANIFEST})
    if strangers:
        raise ModelLoadError(
            f"{out} is an earlier mlxkv conversion but also holds {', '.join(strangers[:5])}"
            f"{' and more' if len(strangers) > 5 else ''}, which converting again would "
            "delete; nothing was written. Move them out, or give a new or empty directory"
        )


def _temporary_dir(out: Path) -> Path:
    """A new directory beside `out` named with this process's id, so that `_drop_leftovers`
    can tell one a killed conversion left (`kill -9`, power loss) from a running one's."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    except OSError as error:
        raise ModelLoadError(
            f"cannot write a conversion in {out.parent} ({error.strerror or error}); choose a "
            "writable directory (for the conversion cache: set MLXKV_CACHE_DIR)"
        ) from error


def _write_manifest(directory: Path, source: str) -> None:
    files = {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}
    manifest = {"format": _FORMAT, "source": source, "files": files}
    (directory / _MANIFEST).write_text(json.dumps(manifest, indent=2))


def _move_into_place(tmp: Path, out: Path) -> None:
    """Renames `tmp` to `out`; an earlier conversion there is replaced. If another process
    put a complete conversion there first, that one is kept and `tmp` is dropped. An
    exception between the two renames (a signal: Ctrl-C, SIGTERM) puts the earlier
    conversion back, so `out` is never left missing."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    old = old if out.is_dir() else None
    try:
        if old is not None:
            os.rename(out, old)
        os.rename(tmp, out)
    except OSError:
        moved_aside = old is None or old.exists()  # else the first rename failed
        if not (moved_aside and is_conversion(out)):
            raise
        logger.info("gguf: another process finished the conversion at %s first", out)
    finally:
        if old is not None and old.exists():
            if out.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(old, out)


def _drop_leftovers(out: Path) -> None:
    """Removes the temporary and replaced directories beside `out`, in the conversion cache
    only (a folder of the user's, `mlxkv convert`'s output, is never swept), that a conversion
    of this module left when its process was killed. Only names exactly as it makes them
    (`_temporary_dir`, `_move_into_place`: the writer's pid, then a random suffix) and of a
    process that is gone: a running conversion's are never touched."""
    for leftover in out.parent.glob(f".{out.name}.*"):
        made = _LEFTOVER.fullmatch(leftover.name.removeprefix(f".{out.name}"))
        if made and not _process_running(int(made[1] or made[2])):
            logger.info("gguf: removing %s, left by a conversion that was stopped", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _process_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()[:24]


def _weights(
    tensors: dict[str, mx.array], config: dict[str, Any], progress: ProgressCallback | None
) -> dict[str, mx.array]:
    bases = sorted({name.rsplit(".", 1)[0] for name in tensors})
    weights = {}
    for done, base in enumerate(bases, start=1):
        target, kind = _target_name(base)
        weight = _dequantized(tensors, base)
        if kind == "attn_q":
            weight = _unpermute_rows(weight, config["num_attention_heads"])
        elif kind == "attn_k":
            weight = _unpermute_rows(weight, config["num_key_value_heads"])
        weights[f"{target}.weight"] = weight.astype(mx.float16)
        mx.eval(weights[f"{target}.weight"])
        if progress:
            progress(done, len(bases))
    return weights


def _target_name(base: str) -> tuple[str, str]:
    if base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[base], base
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}", parts[2]
    raise UnsupportedFormatError(f"GGUF tensor {base!r} has no mlx-lm llama counterpart")


def _dequantized(tensors: dict[str, mx.array], base: str) -> mx.array:
    weight = tensors[f"{base}.weight"]
    scales = tensors.get(f"{base}.scales")
    if scales is None:
        return weight
    bits = weight.shape[-1] // scales.shape[-1]
    # MLX reads the blocks' scales and biases as float16 and would compute in float16: with
    # Q8_0's bias of -128 x scale that adds up to 1/16 of a quantization step. In float32 the
    # result is llama.cpp's own dequantization exactly.
    return mx.dequantize(
        weight,
        scales.astype(mx.float32),
        tensors[f"{base}.biases"].astype(mx.float32),
        group_size=_GROUP_SIZE,
        bits=bits,
    )


def _unpermute_rows(weight: mx.array, num_heads: int) -> mx.array:
    """Undoes llama.cpp's convert-time permutation of q/k rows (interleaved RoPE pairs back
    to Hugging Face's half-split layout). Shape (num_heads * head_dim, in) is unchanged."""
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )
