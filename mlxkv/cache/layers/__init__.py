"""The per-layer K/V classes, each speaking mlx-lm's model-facing cache protocol: `base` (the
protocol and what every class shares), `kv` (global attention), `window` (sliding window, a
ring buffer once full), `chunked` (chunked attention, Llama 4) and `quantized` (`mx.quantize`d
storage). Operations on any layer, mlxkv's or mlx-lm's, are `mlxkv.cache.layer_ops`.
"""
