"""Built-in model definitions: tiny Qwen3-MoE / DeepSeek-V3 for demos/tests and published MoE geometries."""

from moefx.models.tiny import build_model, qwen3_moe_config, tiny_deepseek_v3_config, tiny_qwen3_moe_config

__all__ = ["build_model", "qwen3_moe_config", "tiny_deepseek_v3_config", "tiny_qwen3_moe_config"]
