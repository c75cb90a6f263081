"""Built-in providers, one file per family. Importing this package registers them."""

from moefx.planner.providers import deepseek, glm4_moe, mixtral, olmoe, qwen2_moe, qwen3_moe  # noqa: F401
