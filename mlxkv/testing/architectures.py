"""Tiny configs of every architecture the installed mlx-lm ships, for the conformance sweep
(tests/conformance/) and for `factory.build_model`.

Owns `SWEEP_CONFIGS` (mlx-lm model module name -> the config of a tiny model of it, with its
distinctive layers present: windows shorter than the sweep's prompts, linear or recurrent
layers beside attention, experts, MLA, sinks, shared K/V) and `NOT_COVERED` (module -> why
the sweep has no tiny model of it yet). Every model module of mlx-lm is in exactly one of
them; tests/conformance/test_sweep.py fails naming any module in neither.
"""

from __future__ import annotations

from mlxkv.testing.tiny_attention import ATTENTION_CONFIGS
from mlxkv.testing.tiny_moe import MOE_CONFIGS
from mlxkv.testing.tiny_recurrent import RECURRENT_CONFIGS

SWEEP_CONFIGS = {**ATTENTION_CONFIGS, **MOE_CONFIGS, **RECURRENT_CONFIGS}

# The cache classes `make_cache` gives each architecture (those with only `KVCache` layers
# are not listed): proof that the distinctive layers are really there.
EXPECTED_LAYERS: dict[str, set[str]] = {
    "gemma3_text": {"KVCache", "SlidingWindowCache"},
    "spark2_5": {"SlidingWindowCache"},
    "lfm2": {"KVCache", "ArraysCache"},
    "mamba": {"ArraysCache"},
    "gemma3n": {"KVCache", "SlidingWindowCache"},
    "llama4": {"KVCache", "ChunkedKVCache"},
    "gpt_oss": {"KVCache", "SlidingWindowCache"},
    "iquestloopcoder": {"KVCache", "SlidingWindowCache"},
    "muse_glimmer": {"KVCache", "SlidingWindowCache"},
    "plamo2": {"KVCache", "ArraysCache"},
    "falcon_h1": {"KVCache", "ArraysCache"},
    **dict.fromkeys(
        [
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
            "nemotron_h",
            "granitemoehybrid",
            "kimi_linear",
            "jamba",
        ],
        {"KVCache", "ArraysCache"},
    ),
    **dict.fromkeys(
        ["olmo3", "exaone4", "cohere2", "ministral3"], {"KVCache", "SlidingWindowCache"}
    ),
    "lfm2_moe": {"KVCache", "ArraysCache"},
    "bailing_moe_v3": {"KVCache", "ArraysCache"},
    **dict.fromkeys(["exaone_moe", "afmoe", "gemma3", "mellum"], {"KVCache", "SlidingWindowCache"}),
    "lfm2-vl": {"KVCache", "ArraysCache"},
    **dict.fromkeys(["gemma4", "gemma4_text"], {"KVCache", "SlidingWindowCache"}),
    **dict.fromkeys(
        ["bailing_moe_linear", "bailing_hybrid", "olmo_hybrid"], {"KVCache", "ArraysCache"}
    ),
    "step3p5": {"KVCache", "SlidingWindowCache"},
    "mimo_v2_flash": {"KVCache", "SlidingWindowCache"},
    "kimi_k3": {"KVCache", "ArraysCache"},
    "longcat_flash_ngram": {"KVCache", "ArraysCache"},
    "gear": {"KVCache", "SlidingWindowCache"},
    "baichuan_m1": {"ArraysCache", "KVCache", "SlidingWindowCache"},
    "deepseek_v41": {"LayerCache"},
    "rwkv7": {"ArraysCache"},
    "mamba2": {"ArraysCache"},
    "recurrent_gemma": {"SlidingWindowCache", "ArraysCache"},
}

# How far back a token can still move the last logits, for models whose every layer is a
# window (2 layers of 8 tokens see 2 x 7 back): the sweep's power check probes there.
# deepseek_v41's compressed groups do not carry a token further than its two windows at this
# tiny config: its power is checked within them.
REACH_TOKENS: dict[str, int] = {"spark2_5": 12, "deepseek_v41": 12}

# Modules the sweep cannot cover, and what fails (each a gap to close; none is refused by
# mlxkv itself).
NOT_COVERED: dict[str, str] = {
    "bitnet": "its kernels are Metal-only (`No Metal back-end` on CPU)",
    "muse_spark": (
        "its forward calls mlx-lm's Metal kernels (`mlx_lm.kernels`): `No Metal back-end` on CPU"
    ),
    "olmo": "importing it needs the ai2-olmo package",
    "phi3small": (
        "its forward crashes the process (segmentation fault in MLX on CPU) in the block-sparse "
        "attention layer 0 always has, at block sizes 32 and 64"
    ),
    "plamo3": (
        "mlx-lm's model is inconsistent once a prompt passes its window: it masks "
        "`window_size + 1` positions but caches `window_size` (RotatingKVCache), so the same "
        "tokens prefilled in one piece or in two differ (0.12 in the logits at window 8) with "
        "mlx-lm's own caches too; no cache can equal a cold run. (Swept before only with its "
        "2,048-token default window, longer than the sweep's chats.)"
    ),
    "prism_hadamard_qwen35": (
        "its layers exist only pre-quantized (packed uint32 weights with Hadamard-rotated "
        "scales): built from a config they fail `Unsupported Hadamard pack: schema 2`"
    ),
}
