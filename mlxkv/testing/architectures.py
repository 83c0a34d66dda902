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
_BASE: dict[str, Any] = {
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

SWEEP_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_BASE, "model_type": "llama"},
    "gemma3n": {
        "model_type": "gemma3n",
        "text_config": {
            **_BASE,
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
            **_BASE,
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

NOT_COVERED: dict[str, str] = {}
