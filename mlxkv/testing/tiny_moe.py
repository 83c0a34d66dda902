"""Tiny configs of mlx-lm's mixture-of-experts architectures for the conformance sweep: 4
experts of 32, 2 per token, beside the architecture's attention (DeepSeek's latent attention,
MLA, in the DeepSeek family and its kin).

Owns `MOE_CONFIGS` (mlx-lm module name -> config); `mlxkv.testing.architectures` gathers them.
"""

from __future__ import annotations

from typing import Any

from mlxkv.testing.tiny_attention import (
    BASE_CONFIG,
    DEEPSEEK_MOE,
    EXPERTS,
    GRANITE_MUP,
    MLA,
    QWEN_MOE,
    WINDOW_TOKENS,
)

# DeepSeek V3's router (sigmoid scores, a bias-free top-k) without its dense first layers
_NOAUX_EXPERTS = {
    **{k: v for k, v in DEEPSEEK_MOE.items() if k != "first_k_dense_replace"},
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}
_SLIDING_THEN_FULL = {
    "sliding_window": WINDOW_TOKENS,
    "layer_types": ["sliding_attention", "full_attention"],
}

_LONGCAT = {  # MLA, and experts beside "zero experts" that pass the input through
    **MLA,
    "model_type": "longcat_flash",
    "attention_method": "MLA",
    "zero_expert_type": "identity",
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "moe_topk": 2,
    "expert_ffn_hidden_size": 32,
    "n_routed_experts": 4,
    "zero_expert_num": 2,
    "num_layers": 2,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "routed_scaling_factor": 1.0,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
    "attention_bias": False,
}

MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "Klear": {
        **BASE_CONFIG,
        **QWEN_MOE,
        "model_type": "Klear",
        "attention_bias": False,
        "n_shared_experts": 1,
    },
    "bailing_moe": {
        **BASE_CONFIG,
        **EXPERTS,
        "model_type": "bailing_moe",
        "num_shared_experts": 1,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
    },
    "dots1": {
        **BASE_CONFIG,
        "model_type": "dots1",
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
    },
    "ernie4_5_moe": {
        **BASE_CONFIG,
        "model_type": "ernie4_5_moe",
        "use_bias": False,
        "moe_num_experts": 4,
        "moe_k": 2,
        "moe_intermediate_size": 32,
        "moe_capacity": [4, 4, 4],
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
    },
    "granitemoe": {
        **BASE_CONFIG,
        **GRANITE_MUP,
        "model_type": "granitemoe",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "olmoe": {**BASE_CONFIG, **EXPERTS, "model_type": "olmoe"},
    "qwen2_moe": {**BASE_CONFIG, **QWEN_MOE, "model_type": "qwen2_moe"},
    "mellum": {
        **BASE_CONFIG,
        **EXPERTS,
        **_SLIDING_THEN_FULL,
        "model_type": "mellum",
        "norm_topk_prob": True,
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0}
            for kind in ("sliding_attention", "full_attention")
        },
    },
    "exaone_moe": {
        **BASE_CONFIG,
        **EXPERTS,
        **_SLIDING_THEN_FULL,
        "model_type": "exaone_moe",
        "num_shared_experts": 1,
        "is_moe_layer": [False, True],
    },
    "afmoe": {
        **BASE_CONFIG,
        **EXPERTS,
        **_SLIDING_THEN_FULL,
        "model_type": "afmoe",
        "num_dense_layers": 1,
    },
    "dbrx": {
        "model_type": "dbrx",
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "qwen3_vl_moe": {
        "model_type": "qwen3_vl_moe",
        "text_config": {**BASE_CONFIG, **QWEN_MOE, "model_type": "qwen3_moe"},
    },
    "step3p5": {
        **BASE_CONFIG,
        **_SLIDING_THEN_FULL,
        "model_type": "step3p5",
        "num_attention_groups": 2,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": 32,
        "share_expert_dim": 32,
        "moe_layers_enum": "1",
    },
    "glm_moe_dsa": {
        **BASE_CONFIG,
        **MLA,
        "model_type": "glm_moe_dsa",
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 16,  # the sparse indexer picks 16 of the earlier tokens
        **_NOAUX_EXPERTS,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "mimo_v2_flash": {
        **BASE_CONFIG,
        "model_type": "mimo_v2_flash",
        "hybrid_layer_pattern": [1, 0],  # layer 0 sliding with sinks, layer 1 global
        "moe_layer_freq": [0, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "sliding_window_size": WINDOW_TOKENS,
        **_NOAUX_EXPERTS,
        "layernorm_epsilon": 1e-5,
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "v_head_dim": 16,
        "swa_head_dim": 16,
        "swa_v_head_dim": 16,
        "partial_rotary_factor": 0.5,
    },
    "longcat_flash": _LONGCAT,
    "longcat_flash_ngram": {  # plus n-gram embeddings over the last tokens (kept as state)
        **_LONGCAT,
        "model_type": "longcat_flash_ngram",
        "ngram_vocab_size_ratio": 2,
    },
    "minimax_m3_vl": {
        "model_type": "minimax_m3_vl",
        "text_config": {
            **BASE_CONFIG,
            "model_type": "minimax_m3",
            "intermediate_size": 32,
            "dense_intermediate_size": 128,
            "shared_intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_layer_freq": [0, 1],
            "sparse_attention_freq": [1, 0],  # layer 0 block-sparse with an indexer
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_block_size": 4,
            "index_topk_blocks": 2,
        },
    },
    "deepseek": {
        **BASE_CONFIG,
        **DEEPSEEK_MOE,
        "model_type": "deepseek",
    },
    "deepseek_v2": {
        **BASE_CONFIG,
        **DEEPSEEK_MOE,
        **MLA,
        "model_type": "deepseek_v2",
        "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096},
    },
    "deepseek_v3": {**BASE_CONFIG, **DEEPSEEK_MOE, **MLA, "model_type": "deepseek_v3"},
    "deepseek_v32": {
        **BASE_CONFIG,
        **DEEPSEEK_MOE,
        **MLA,
        "model_type": "deepseek_v32",
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 16,  # the sparse indexer picks 16 of the earlier tokens
    },
    "glm4_moe_lite": {
        **BASE_CONFIG,
        **DEEPSEEK_MOE,
        **MLA,
        "model_type": "glm4_moe_lite",
    },
    "glm4_moe": {
        **BASE_CONFIG,
        **DEEPSEEK_MOE,
        "model_type": "glm4_moe",
        "use_qk_norm": True,
        "attention_bias": False,
        "partial_rotary_factor": 0.5,
        "rope_scaling": None,
    },
    "solar_open": {  # glm4_moe's model under solar_open's own settings
        **BASE_CONFIG,
        **DEEPSEEK_MOE,
        "model_type": "solar_open",
        "partial_rotary_factor": 0.5,
    },
    "qwen3_moe": {**BASE_CONFIG, **QWEN_MOE, "model_type": "qwen3_moe"},
    "minimax": {
        **BASE_CONFIG,
        "model_type": "minimax",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 32,
        "rotary_dim": 8,
    },
    "laguna": {
        **BASE_CONFIG,
        **EXPERTS,
        "model_type": "laguna",
        "shared_expert_intermediate_size": 32,
    },
    "hunyuan": {
        **BASE_CONFIG,
        "model_type": "hunyuan",
        "attention_bias": False,
        "moe_topk": 2,
        "num_experts": 4,
        "num_shared_expert": 1,
        "moe_intermediate_size": 32,
        "use_mixed_mlp_moe": True,
        "use_qk_norm": True,
        "use_cla": True,  # layer 1 attends with layer 0's keys and values
        "cla_share_factor": 2,
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    },
    "kimi_vl": {
        "model_type": "kimi_vl",
        "text_config": {**BASE_CONFIG, **DEEPSEEK_MOE, **MLA, "model_type": "deepseek_v3"},
    },
    "kimi_k25": {
        "model_type": "kimi_k25",
        "text_config": {**BASE_CONFIG, **DEEPSEEK_MOE, **MLA, "model_type": "deepseek_v3"},
    },
    "deepseek_v41": {  # its own LayerCache: a window, compressed groups, index keys
        "model_type": "deepseek_v41",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "o_groups": 2,
        "o_lora_rank": 16,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW_TOKENS,
        "compress_ratios": [1, 4],  # layer 1 pools every 4 tokens into one latent
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 16,  # of the compressed groups: 64 tokens, fewer than a chat holds
        "candidate_topk_blocks": 8,
        "candidate_block_size": 4,
        "hc_mult": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
    },
}
