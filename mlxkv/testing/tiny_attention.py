"""Tiny configs of mlx-lm's attention architectures for the conformance sweep: global, sliding
window and chunked attention, shared K/V, experts (MoE) and DeepSeek's latent attention (MLA).

Owns `BASE_CONFIG` (the shared 2-layer, hidden-64 settings), `WINDOW_TOKENS`, the shared
expert and latent settings (`EXPERTS`, `QWEN_MOE`, `DEEPSEEK_MOE`, `MLA`) and
`ATTENTION_CONFIGS` (mlx-lm module name -> config). Each config keeps its distinctive layers
and makes them small: windows and chunks of `WINDOW_TOKENS`, 4 experts of 32, latents of 16.
`mlxkv.testing.architectures` gathers these with the recurrent ones.
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
WINDOW_TOKENS = 8  # sliding windows and attention chunks: far shorter than the sweep's prompts

# Modules whose model builds from `BASE_CONFIG` alone (their other settings have defaults).
_PLAIN = [
    "qwen2_vl",
    "qwen3_vl",
    "talkie",
    "cohere",
    "gemma",
    "gemma2",
    "glm",
    "hunyuan_v1_dense",
    "internlm2",
    "internlm3",
    "mimo",
    "mixtral",
    "nanbeige",
    "nanochat",
    "olmo2",
    "phi",
    "phi3",
    "phimoe",
    "qwen2",
    "seed_oss",
    "smollm3",
    "starcoder2",
    "telechat3",
]

QWEN_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
}
GRANITE_MUP = {  # Granite's muP multipliers (its dense and MoE models alike)
    "embedding_multiplier": 12.0,
    "attention_multiplier": 0.0625,
    "logits_scaling": 1.0,
    "residual_multiplier": 0.5,
    "attention_bias": False,
    "mlp_bias": False,
}
DEEPSEEK_MOE = {  # routed experts behind a grouped top-k router, one shared expert
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,  # layer 0 dense, layer 1 experts
}
_GEMMA4_TEXT = {
    **BASE_CONFIG,
    "model_type": "gemma4_text",
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 2,  # layers 2-3 read the K/V of layers 0-1
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": WINDOW_TOKENS,
    "global_head_dim": 16,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 512,
    "use_double_wide_mlp": False,
    "enable_moe_block": True,  # Gemma 4 26B-A4B's experts beside the dense MLP
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}
_MISTRAL_ROPE = {  # Mistral 3/4's position-dependent attention scale (Llama 4's)
    "rope_type": "default",
    "rope_theta": 10000.0,
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 16,
}
_MINISTRAL3 = {
    **BASE_CONFIG,
    "model_type": "ministral3",
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": WINDOW_TOKENS,
    "rope_parameters": _MISTRAL_ROPE,
}
_MISTRAL4 = {
    **BASE_CONFIG,
    **DEEPSEEK_MOE,
    "model_type": "mistral4",
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "rope_parameters": _MISTRAL_ROPE,
}

MLA = {  # DeepSeek's multi-head latent attention, small
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}
EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

ATTENTION_CONFIGS: dict[str, dict[str, Any]] = {
    **{name: {**BASE_CONFIG, "model_type": name} for name in _PLAIN},
    "gemma3n": {
        "model_type": "gemma3n",
        "text_config": {
            **BASE_CONFIG,
            "model_type": "gemma3n_text",
            "num_hidden_layers": 4,
            "num_kv_shared_layers": 2,  # layers 2-3 read the K/V of layers 0-1
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "sliding_window": WINDOW_TOKENS,
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
            "attention_chunk_size": WINDOW_TOKENS,
            "interleave_moe_layer_step": 2,
            "intermediate_size_mlp": 128,
            "num_experts_per_tok": 1,
            "num_local_experts": 2,
            "rope_scaling": None,
            "use_qk_norm": True,
        },
    },
    "olmo3": {
        **BASE_CONFIG,
        "model_type": "olmo3",
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": WINDOW_TOKENS,
    },
    "exaone4": {
        **BASE_CONFIG,
        "model_type": "exaone4",
        "sliding_window": WINDOW_TOKENS,
        "sliding_window_pattern": "LG",
        "layer_types": ["sliding_attention", "full_attention"],  # for transformers
        "rope_scaling": None,
    },
    "cohere2": {
        **BASE_CONFIG,
        "model_type": "cohere2",
        "sliding_window": WINDOW_TOKENS,
        "sliding_window_pattern": 2,  # layer 0 sliding, layer 1 global
    },
    "gpt_oss": {
        **BASE_CONFIG,
        "model_type": "gpt_oss",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW_TOKENS,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "ministral3": _MINISTRAL3,
    "mistral3": {"model_type": "mistral3", "text_config": _MINISTRAL3},
    "mistral4": _MISTRAL4,
    "youtu_llm": {**BASE_CONFIG, **MLA, "model_type": "youtu_llm"},
    "iquestloopcoder": {
        **BASE_CONFIG,
        "model_type": "iquestloopcoder",
        "loop_window_size": WINDOW_TOKENS,
    },
    "muse_glimmer": {
        **BASE_CONFIG,
        "model_type": "muse_glimmer",
        "sliding_window": WINDOW_TOKENS,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "apertus": {
        **BASE_CONFIG,
        "model_type": "apertus",
        "mlp_bias": False,
        "attention_bias": False,
        "post_norm": False,
        "qk_norm": True,
    },
    "ernie4_5": {**BASE_CONFIG, "model_type": "ernie4_5", "use_bias": False},
    "exaone": {
        **BASE_CONFIG,
        "model_type": "exaone",
        "num_layers": 2,
        "layer_norm_epsilon": 1e-5,
    },
    "glm4": {
        **BASE_CONFIG,
        "model_type": "glm4",
        "attention_bias": False,
        "partial_rotary_factor": 0.5,
    },
    "granite": {**BASE_CONFIG, "model_type": "granite", **GRANITE_MUP},
    "helium": {**BASE_CONFIG, "model_type": "helium", "attention_bias": False, "mlp_bias": False},
    "minicpm": {
        **BASE_CONFIG,
        "model_type": "minicpm",
        "dim_model_base": 64,
        "scale_depth": 1.4,
        "scale_emb": 12,
    },
    "minicpm3": {
        **BASE_CONFIG,
        **MLA,
        "model_type": "minicpm3",
        "rope_scaling": {"original_max_position_embeddings": 4096},  # LongRoPE, factors 1
        "dim_model_base": 64,
        "scale_depth": 1.4,
        "scale_emb": 12,
    },
    "nemotron": {
        **BASE_CONFIG,
        "model_type": "nemotron",
        "hidden_act": "relu2",
        "norm_eps": 1e-5,
        "partial_rotary_factor": 0.5,
    },
    "stablelm": {
        **BASE_CONFIG,
        "model_type": "stablelm",
        "use_qkv_bias": False,
        "partial_rotary_factor": 0.25,
        "layer_norm_eps": 1e-5,
    },
    "gpt_neox": {
        **BASE_CONFIG,
        "model_type": "gpt_neox",
        "layer_norm_eps": 1e-5,
        "rotary_emb_base": 10000,
        "rotary_pct": 0.25,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 1024,
        "layer_norm_epsilon": 1e-5,
    },
    "gpt_bigcode": {
        "model_type": "gpt_bigcode",
        "n_embd": 64,
        "n_inner": 128,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 1024,
        "layer_norm_epsilon": 1e-5,
    },
    "lille-130m": {
        "model_type": "lille-130m",
        "block_size": 1024,
        "layer_norm_eps": 1e-5,
        "n_embd": 64,
        "n_head": 4,
        "n_kv_heads": 2,
        "n_layer": 2,
        "rope_theta": 10000.0,
    },
    "openelm": {
        "model_type": "openelm",
        "head_dim": 16,
        "num_transformer_layers": 2,
        "model_dim": 64,
        "ffn_dim_divisor": 8,
        "num_query_heads": [4, 4],
        "num_kv_heads": [2, 2],
        "ffn_multipliers": [2.0, 2.0],
    },
    "baichuan_m1": {
        **BASE_CONFIG,
        "model_type": "baichuan_m1",
        "sliding_window": WINDOW_TOKENS,
        "sliding_window_layers": [0],
        "conv_window": 2,
    },
    "gemma3": {
        "model_type": "gemma3",
        "text_config": {
            **BASE_CONFIG,
            "model_type": "gemma3_text",
            "num_hidden_layers": 2,
            "sliding_window": WINDOW_TOKENS,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 16,
            "rope_local_base_freq": 10000.0,
        },
    },
    "llama4_text": {
        **BASE_CONFIG,
        "model_type": "llama4_text",
        "num_hidden_layers": 4,
        "attention_chunk_size": WINDOW_TOKENS,
        "intermediate_size_mlp": 128,
        "no_rope_layers": [1, 1, 1, 0],
        "use_qk_norm": True,
        "interleave_moe_layer_step": 2,
        "num_experts_per_tok": 1,
        "num_local_experts": 2,
    },
    "pixtral": {
        "model_type": "pixtral",
        "text_config": {**BASE_CONFIG, "model_type": "llama"},
    },
    "plamo": {**BASE_CONFIG, "model_type": "plamo", "n_shared_head": 2},
    "qwen": {
        **BASE_CONFIG,
        "model_type": "qwen",
        "kv_channels": 16,
        "layer_norm_epsilon": 1e-5,
        "no_bias": True,
    },
    "gptj": {
        "model_type": "gptj",
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "rotary_dim": 8,
        "n_positions": 1024,
    },
    "phixtral": {
        "model_type": "phixtral",
        "num_vocab": 512,  # its own name for the vocabulary size (the factory's 512)
        "model_dim": 64,
        "num_heads": 4,
        "num_layers": 2,
        "rotary_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "nemotron-nas": {
        **BASE_CONFIG,
        "model_type": "nemotron-nas",
        "num_hidden_layers": 3,
        "block_configs": [  # attention, none (no cache), a linear layer in its place
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 2.0}},
        ],
    },
    "gemma4_text": _GEMMA4_TEXT,
    "gemma4": {"model_type": "gemma4", "text_config": _GEMMA4_TEXT},
}
