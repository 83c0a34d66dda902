"""Tiny configs of every architecture the installed mlx-lm ships, for the conformance sweep
(tests/conformance/) and for `factory.build_model`.

Owns `SWEEP_CONFIGS` (mlx-lm model module name -> the config of a tiny model of it, with its
distinctive layers present: windows shorter than the sweep's prompts, linear or recurrent
layers beside attention, experts, MLA, sinks, shared K/V) and `NOT_COVERED` (module -> why
the sweep has no tiny model of it yet). Every model module of mlx-lm is in exactly one of
them; tests/conformance/test_sweep.py fails naming any module in neither.
"""

from __future__ import annotations

from typing import Any

# Shared by most configs: 2 layers, hidden 64, 4 query heads of 16 over 2 KV heads.
BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
_WINDOW = 8  # sliding windows and attention chunks: far shorter than the sweep's prompts

# Modules whose model builds from `BASE_CONFIG` alone (their other settings have defaults).
_PLAIN = [
    "bailing_moe_v3",
    "cohere",
    "deepseek",
    "deepseek_v3",
    "deepseek_v32",
    "falcon_h1",
    "gemma",
    "gemma2",
    "glm",
    "glm4_moe_lite",
    "gpt_oss",
    "hunyuan_v1_dense",
    "internlm2",
    "internlm3",
    "iquestloopcoder",
    "laguna",
    "mimo",
    "mixtral",
    "muse_glimmer",
    "nanbeige",
    "nanochat",
    "olmo2",
    "phi",
    "phi3",
    "phimoe",
    "plamo2",
    "plamo3",
    "qwen2",
    "seed_oss",
    "smollm3",
    "starcoder2",
    "telechat3",
    "youtu_llm",
]

SWEEP_CONFIGS: dict[str, dict[str, Any]] = {
    **{name: {**BASE_CONFIG, "model_type": name} for name in _PLAIN},
    "gemma3n": {
        "model_type": "gemma3n",
        "text_config": {
            **BASE_CONFIG,
            "model_type": "gemma3n_text",
            "num_hidden_layers": 4,
            "num_kv_shared_layers": 2,  # layers 2-3 read the K/V of layers 0-1
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "sliding_window": _WINDOW,
            "vocab_size_per_layer_input": 64,
            "hidden_size_per_layer_input": 8,
            "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": 30.0,
            "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
            "altup_num_inputs": 2,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": True,
            "altup_active_idx": 0,
            "laurel_rank": 8,
        },
    },
    "afm7": {
        "model_type": "afm7",
        "hidden_dim": 64,
        "num_layers": 2,
        "num_kv_reuse_layers": 1,  # the last layer reads the K/V of the last cached one
        "num_heads": 4,
        "num_kv_heads": 2,
    },
    "llama4": {
        "model_type": "llama4",
        "text_config": {
            **BASE_CONFIG,
            "model_type": "llama4_text",
            "num_hidden_layers": 4,  # layers 0-2 chunked, layer 3 global
            "attention_bias": False,
            "attention_chunk_size": _WINDOW,
            "interleave_moe_layer_step": 2,
            "intermediate_size_mlp": 128,
            "num_experts_per_tok": 1,
            "num_local_experts": 2,
            "rope_scaling": None,
            "use_qk_norm": True,
        },
    },
}

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
    "muse_glimmer": {"SlidingWindowCache"},
    "plamo3": {"SlidingWindowCache"},
    "plamo2": {"KVCache", "ArraysCache"},
    "falcon_h1": {"KVCache", "ArraysCache"},
}

# How far back a token can still move the last logits, for models whose every layer is a
# window (2 layers of 8 tokens see 2 x 7 back): the sweep's power check probes there.
REACH_TOKENS: dict[str, int] = {"spark2_5": 12}

# Modules the sweep has no tiny model of yet, and why (each a gap to close, not a refusal:
# mlxkv's make_cache converts their cache classes like the others').
NOT_COVERED: dict[str, str] = {
    "Klear": "no tiny config written yet",
    "afmoe": "no tiny config written yet",
    "apertus": "no tiny config written yet",
    "baichuan_m1": "no tiny config written yet",
    "bailing_hybrid": "no tiny config written yet",
    "bailing_moe": "no tiny config written yet",
    "bailing_moe_linear": "no tiny config written yet",
    "bitnet": "its kernels are Metal-only (`No Metal back-end` on CPU)",
    "cohere2": "the shared tiny config lacks its layer pattern (IndexError in make_cache)",
    "dbrx": "no tiny config written yet",
    "deepseek_v2": "no tiny config written yet",
    "deepseek_v41": "no tiny config written yet",
    "dots1": "no tiny config written yet",
    "ernie4_5": "no tiny config written yet",
    "ernie4_5_moe": "no tiny config written yet",
    "exaone": "no tiny config written yet",
    "exaone4": "no tiny config written yet",
    "exaone_moe": "no tiny config written yet",
    "gear": "no tiny config written yet",
    "gemma3": "no tiny config written yet",
    "gemma4": "its default config is too large for the sweep (killed for memory)",
    "gemma4_text": "no tiny config written yet",
    "glm4": "no tiny config written yet",
    "glm4_moe": "no tiny config written yet",
    "glm_moe_dsa": "no tiny config written yet",
    "gpt2": "no tiny config written yet",
    "gpt_bigcode": "no tiny config written yet",
    "gpt_neox": "no tiny config written yet",
    "gptj": "no forward within 20 s on CPU at the shared tiny config",
    "granite": "no tiny config written yet",
    "granitemoe": "no tiny config written yet",
    "granitemoehybrid": "no tiny config written yet",
    "helium": "no tiny config written yet",
    "hunyuan": "no tiny config written yet",
    "jamba": "no tiny config written yet",
    "kimi_k25": "no tiny config written yet",
    "kimi_k3": "no tiny config written yet",
    "kimi_linear": "no tiny config written yet",
    "kimi_vl": "no tiny config written yet",
    "lfm2-vl": "no tiny config written yet",
    "lfm2_moe": "no tiny config written yet",
    "lille-130m": "no tiny config written yet",
    "llama4_text": "no tiny config written yet",
    "longcat_flash": "no tiny config written yet",
    "longcat_flash_ngram": "no tiny config written yet",
    "mamba2": "no tiny config written yet",
    "mellum": "no tiny config written yet",
    "mimo_v2_flash": "no tiny config written yet",
    "minicpm": "no tiny config written yet",
    "minicpm3": "no tiny config written yet",
    "minimax": "no tiny config written yet",
    "minimax_m3_vl": "no tiny config written yet",
    "ministral3": "the shared tiny config lacks its rope parameters",
    "mistral3": "no tiny config written yet",
    "mistral4": "no tiny config written yet",
    "muse_spark": "no tiny config written yet",
    "nemotron": "no tiny config written yet",
    "nemotron-nas": "no tiny config written yet",
    "nemotron_h": "no tiny config written yet",
    "olmo": "importing it needs the ai2-olmo package",
    "olmo3": "no tiny config written yet",
    "olmo_hybrid": "no tiny config written yet",
    "olmoe": "no tiny config written yet",
    "openelm": "no tiny config written yet",
    "phi3small": "no tiny config written yet",
    "phixtral": "no forward within 20 s on CPU at the shared tiny config",
    "pixtral": "no tiny config written yet",
    "plamo": "the shared tiny config's head counts do not fit its KV-head setting",
    "prism_hadamard_qwen35": "no tiny config written yet",
    "qwen": "uses its own config names (hidden size, intermediate size)",
    "qwen2_moe": "no tiny config written yet",
    "qwen2_vl": "no tiny config written yet",
    "qwen3_5": "no tiny config written yet",
    "qwen3_5_moe": "no tiny config written yet",
    "qwen3_moe": "no tiny config written yet",
    "qwen3_next": "no tiny config written yet",
    "qwen3_vl": "no tiny config written yet",
    "qwen3_vl_moe": "no tiny config written yet",
    "recurrent_gemma": "no tiny config written yet",
    "rwkv7": "no tiny config written yet",
    "stablelm": "no tiny config written yet",
    "step3p5": "no tiny config written yet",
    "talkie": "blind with random weights: a token 40 back does not move the last logits",
}
