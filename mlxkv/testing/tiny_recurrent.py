"""Tiny configs of mlx-lm's recurrent and hybrid architectures for the conformance sweep:
state-space (Mamba, Mamba-2), linear attention (GatedDeltaNet, Kimi Delta, RWKV-7), RG-LRU and
short convolutions, mostly beside attention layers.

Owns `RECURRENT_CONFIGS` (mlx-lm module name -> config). Their decays are made trained-like
when the factory writes the weights (`factory._trained_like`): mlx-lm's random ones forget
within a few tokens.
"""

from __future__ import annotations

from typing import Any

from mlxkv.testing.tiny_attention import BASE_CONFIG, EXPERTS, MLA, QWEN_MOE, WINDOW_TOKENS

# LFM2's short convolutions beside attention (the factory's lfm2; LFM2-VL's language model).
LFM2_CONFIG = {
    **BASE_CONFIG,
    "model_type": "lfm2",
    "num_hidden_layers": 3,
    "norm_eps": 1e-5,
    "conv_bias": False,
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_ff_dim": 128,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "full_attn_idxs": [1],
    "layer_types": ["conv", "full_attention", "conv"],
}

_GATED_DELTA = {  # Qwen3-Next / Qwen3.5: GatedDeltaNet layers, every 2nd layer full attention
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "partial_rotary_factor": 0.25,
}
# `build_model("qwen3_next", ..., config_overrides=QWEN3_NEXT_LARGE_STATE)`: delta-rule heads
# big enough that one snapshot of their state costs more than a disk block of the attention
# layers' K/V, as in the real model (~72 MB against ~6 MB; the disk tier's snapshot rule,
# `mlxkv.runner.disk.snapshots`, then takes every k-th boundary).
QWEN3_NEXT_LARGE_STATE = {
    "linear_num_value_heads": 16,
    "linear_num_key_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
}
_MAMBA2 = {"conv_kernel": 4, "n_groups": 1, "use_bias": False, "use_conv_bias": True}

_KDA_THEN_MLA = {  # Kimi Linear's layers: 0 Kimi Delta Attention, 1 latent attention (MLA)
    "kda_layers": [1],
    "num_heads": 4,
    "head_dim": 16,
    "short_conv_kernel_size": 4,
}
RECURRENT_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_next": {**BASE_CONFIG, **_GATED_DELTA, **QWEN_MOE, "model_type": "qwen3_next"},
    "qwen3_5": {
        "model_type": "qwen3_5",
        "text_config": {**BASE_CONFIG, **_GATED_DELTA, "model_type": "qwen3_5_text"},
    },
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "text_config": {
            **BASE_CONFIG,
            **_GATED_DELTA,
            **QWEN_MOE,
            "model_type": "qwen3_5_moe_text",
        },
    },
    "nemotron_h": {
        **BASE_CONFIG,
        **_MAMBA2,
        "model_type": "nemotron_h",
        "hybrid_override_pattern": ["M", "*", "-", "E"],
        "attention_bias": False,
        "mlp_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 8,
        "layer_norm_epsilon": 1e-5,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    },
    "granitemoehybrid": {
        **BASE_CONFIG,
        "model_type": "granitemoehybrid",
        "layer_types": ["mamba", "attention"],
        "attention_bias": False,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0625,
        "logits_scaling": 1.0,
        "residual_multiplier": 0.5,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 8,  # times mamba_d_head: intermediate_size
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "tie_word_embeddings": False,
    },
    "kimi_linear": {
        **BASE_CONFIG,
        "model_type": "kimi_linear",
        "linear_attn_config": _KDA_THEN_MLA,
        "model_max_length": 4096,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    },
    "rwkv7": {
        **BASE_CONFIG,
        "model_type": "rwkv7",
        "norm_eps": 1e-5,
        "a_low_rank_dim": 8,
        "v_low_rank_dim": 8,
        "gate_low_rank_dim": 8,
        "decay_low_rank_dim": 8,
    },
    "recurrent_gemma": {
        **BASE_CONFIG,
        "model_type": "recurrent_gemma",
        "num_hidden_layers": 3,
        "block_types": ["recurrent", "attention", "recurrent"],
        "attention_bias": False,
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
        "num_key_value_heads": 1,
        "attention_window_size": WINDOW_TOKENS,
    },
    "jamba": {
        **BASE_CONFIG,
        "model_type": "jamba",
        "num_hidden_layers": 4,
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_d_conv": 4,
        "mamba_d_state": 8,
        "mamba_expand": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    "mamba2": {
        **BASE_CONFIG,
        **_MAMBA2,
        "model_type": "mamba2",
        "num_heads": 8,
        "head_dim": 16,
        "state_size": 8,
        "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, 1000.0],
        "time_step_rank": "auto",
    },
    "lfm2-vl": {
        "model_type": "lfm2-vl",
        "text_config": {
            **LFM2_CONFIG,
            "num_hidden_layers": 2,
            "layer_types": ["conv", "full_attention"],
        },
    },
    "bailing_moe_linear": {
        **BASE_CONFIG,
        "model_type": "bailing_moe_linear",
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "layer_group_size": 2,  # layer 0 linear attention, layer 1 global
        "group_norm_size": 1,
        "topk_group": 1,
    },
    "bailing_hybrid": {
        **BASE_CONFIG,
        "model_type": "bailing_hybrid",
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "layer_group_size": 2,  # layer 0 linear attention, layer 1 MLA
        "group_norm_size": 1,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
    },
    "olmo_hybrid": {
        **BASE_CONFIG,
        **_GATED_DELTA,
        "model_type": "olmo_hybrid",
        "linear_allow_neg_eigval": True,
        "attention_bias": False,
        "layer_types": ["linear_attention", "full_attention"],
    },
    "gear": {
        **BASE_CONFIG,
        "model_type": "gear",
        # Its convolution layers ("conv_mixer") cannot be swept: transformers' config check,
        # run when mlx-lm loads the tokenizer, refuses that layer type.
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": WINDOW_TOKENS,
    },
    "falcon_h1": {
        **BASE_CONFIG,
        "model_type": "falcon_h1",
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_ssm": 128,
        "mamba_d_state": 8,
    },
    "plamo2": {
        **BASE_CONFIG,
        "model_type": "plamo2",
        "hidden_size_per_head": 16,
        "mamba_num_heads": 8,
        "mamba_d_state": 8,
        "mamba_step": 2,  # layer 0 Mamba, layer 1 attention
    },
    "kimi_k3": {
        "model_type": "kimi_k3",
        "text_config": {
            **BASE_CONFIG,
            "model_type": "kimi_linear",
            "linear_attn_config": _KDA_THEN_MLA,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "num_experts": 4,
            "num_experts_per_token": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
        },
    },
    "lfm2_moe": {
        **BASE_CONFIG,
        "model_type": "lfm2_moe",
        "num_hidden_layers": 3,
        "layer_types": ["conv", "full_attention", "conv"],
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "use_expert_bias": True,
        "num_dense_layers": 1,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
    },
    "bailing_moe_v3": {
        **BASE_CONFIG,
        **EXPERTS,
        **MLA,
        "model_type": "bailing_moe_v3",
        "layer_group_size": 2,  # layer 0 Kimi Delta Attention, layer 1 MLA
        "moe_shared_expert_intermediate_size": 32,
        "n_group": 1,
        "topk_group": 1,
    },
}
