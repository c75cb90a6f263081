"""Published MoE geometries as transformers config dicts (the numbers from each model's config.json).

No weights, no download: these feed `moefx plan NAME`, signature tests, and any code that needs real
shapes (`catalog_config("qwen3-30b-a3b")`, or `catalog_hf_config(name)` for a transformers config object).
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}

_CATALOG: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-235b-a22b": {
        **_QWEN3_30B_A3B,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "max_window_layers": 94,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    },
    "deepseek-v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "vocab_size": 102400,
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 60,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 160,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 8,
        "topk_group": 3,
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 16.0,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-05,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "vocab_size": 50304,
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
    },
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "sliding_window": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    },
    "qwen2-57b-a14b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "vocab_size": 151936,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "moe_intermediate_size": 2560,
        "shared_expert_intermediate_size": 20480,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "sliding_window": 131072,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    },
}

# Hugging Face repository ids accepted as aliases.
_ALIASES = {
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen/qwen3-235b-a22b": "qwen3-235b-a22b",
    "deepseek-ai/deepseek-v3": "deepseek-v3",
    "deepseek-ai/deepseek-v2": "deepseek-v2",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "allenai/olmoe-1b-7b-0924": "olmoe-1b-7b",
    "qwen/qwen1.5-moe-a2.7b": "qwen1.5-moe-a2.7b",
    "qwen/qwen2-57b-a14b": "qwen2-57b-a14b",
}
TINY = "tiny-qwen3-moe"


def catalog_names() -> list[str]:
    return [*_CATALOG, TINY]


def catalog_config(name: str) -> dict[str, Any]:
    """A fresh copy of the config dict for a built-in name or its HF id (case-insensitive)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key == TINY:
        from moefx.models.tiny import tiny_qwen3_moe_config

        data = tiny_qwen3_moe_config().to_dict()
        data.update(architectures=["Qwen3MoeForCausalLM"], dtype="float32")
        return data
    if key not in _CATALOG:
        raise ValueError(f"unknown built-in model {name!r}; valid names: {catalog_names()}")
    return copy.deepcopy(_CATALOG[key])


def catalog_hf_config(name: str, **overrides: Any) -> Any:
    """The same geometry as a transformers config object (`AutoConfig.for_model`)."""
    from transformers import AutoConfig

    data = {**catalog_config(name), **overrides}
    model_type = data.pop("model_type")
    if "torch_dtype" in data:  # config.json's pre-transformers-5 spelling; the config object takes `dtype`
        data.setdefault("dtype", data.pop("torch_dtype"))
    return AutoConfig.for_model(model_type, **data)
