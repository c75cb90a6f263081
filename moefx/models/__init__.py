"""Built-in model definitions: a tiny Qwen3-MoE for demos/tests and published MoE geometries."""

from moefx.models.tiny import build_model, qwen3_moe_config, tiny_qwen3_moe_config

__all__ = ["build_model", "qwen3_moe_config", "tiny_qwen3_moe_config"]
