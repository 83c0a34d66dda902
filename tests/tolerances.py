"""How close two computations of the same logits must be, by device and dtype.

Two computations of one forward pass (the model with no cache, a cache fed in other chunks, a
verify pass of k tokens against k one-token steps) build other matmul shapes, and so round
differently. The bound is relative to the reference's magnitude (the factory's logits are
O(5)), from measurements:
  - CPU, float32: at most 2.5e-5 x max |logit| over this suite (max |diff| 1.3e-4 at logits of
    about 6), so 1e-4;
  - GPU (MLX CUDA), float32: about 4e-4 absolute at logits of O(1) on an H100 (issue 26's run,
    other kernels for chunked and unchunked feeds), so 2e-3. That holds with TF32 off, which
    tests/conftest.py asks for (MLX_ENABLE_TF32=0); with MLX's default TF32 an H200 measured
    2.5e-3 relative (2026-11-27), so a run that keeps TF32 gets 1e-2;
  - half precision: bounded by its 2^-10 relative rounding per operation, so 2e-2;
  - K/V quantized to b bits, compared between two chunkings of the same tokens: each
    chunking quantizes other values in other passes, so the bound is the quantization step,
    2^-b relative (8 bits: 3.9e-3; seen 6.9e-4 relative, at 57 + 58 tokens against 115 fed
    at once).
Besides the bound, the most likely token must agree wherever the reference's top two are
further apart than the bound allows to move them.
"""

from __future__ import annotations

import os

import mlx.core as mx

from mlxkv.platform.machine import on_gpu

_RTOL = {
    ("cpu", mx.float32): 1e-4,
    ("gpu", mx.float32): 2e-3,
    ("cpu", mx.float16): 2e-2,
    ("gpu", mx.float16): 2e-2,
    ("cpu", mx.bfloat16): 2e-2,
    ("gpu", mx.bfloat16): 2e-2,
}


_TF32_RTOL = 1e-2


def logits_tolerance(want: mx.array, kv_bits: int | None = None) -> float:
    """The largest absolute difference allowed from the reference logits `want` (`kv_bits`:
    both sides ran on K/V quantized to that many bits)."""
    device = "gpu" if on_gpu() else "cpu"
    scale = max(1.0, mx.abs(want).max().item())
    rtol = _RTOL[(device, want.dtype)]
    if device == "gpu" and want.dtype == mx.float32 and os.environ.get("MLX_ENABLE_TF32") != "0":
        rtol = _TF32_RTOL
    if kv_bits is not None:
        rtol = max(rtol, 2.0**-kv_bits)
    return rtol * scale


def assert_logits_close(
    got: mx.array, want: mx.array, what: str = "", kv_bits: int | None = None
) -> None:
    """`got` equals the reference `want` (..., vocab) within `logits_tolerance`, and picks the
    same most likely token at each position where that choice is not a near tie."""
    bound = logits_tolerance(want, kv_bits)
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
    label = f"{what}: " if what else ""
    assert diff <= bound, f"{label}max |diff| {diff:.3g} > {bound:.3g} ({want.dtype})"
    top2 = mx.sort(want.reshape(-1, want.shape[-1]), axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * bound
    agree = mx.argmax(got.reshape(top2.shape[0], -1), axis=-1) == mx.argmax(
        want.reshape(top2.shape[0], -1), axis=-1
    )
    assert mx.all(agree | ~clear).item(), f"{label}the most likely token differs"


# How far two computations' log-probabilities of the same token may be apart (batched vs alone,
# cached vs fresh: other matmul shapes), for the factory's float32 models: log-softmax moves
# with the logits, so the float32 bounds above (logits of O(1)).
LOGPROB_ABS = _RTOL[("gpu" if on_gpu() else "cpu", mx.float32)]


def logprob_rel(kv_bits: int | None = None) -> float:
    """The relative bound on log-probabilities besides `LOGPROB_ABS`: none for float K/V; with
    K/V quantized to `kv_bits` on both sides, 2^-bits (as `logits_tolerance`): a K/V value
    computed in other matmul shapes (a batch's rows against one, other chunks) rounds
    differently before it is quantized and can land one quantization step away (seen: 2.1e-3
    at a log-probability of -2.09, 8 bits, a batched row against the request alone)."""
    return 0.0 if kv_bits is None else 2.0**-kv_bits
