"""Byte sizes that follow from a model's facts: the width of a dtype name, and the KV cache per token.

One formula for the KV cache serves every reader: the decode engine's slots (`moefx/engine/memory.py`), the
planner's capture cap (`moefx/planner/serving.py`) and offload's KV reserve (`moefx/offload/`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moefx.facts.model import ModelSignature

# Element size of the dtype names a ModelSignature holds (`normalize_dtype`'s spelling).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


def kv_bytes_per_token(num_layers: int | None, num_kv_heads: int | None, head_dim: int | None,
                       dtype_bytes: int | None) -> int | None:
    """Bytes the K and V caches of every layer hold for one token: layers x 2 (K and V) x KV heads x head_dim x
    element size; None when one of the four is unknown (None or 0)."""
    if not (num_layers and num_kv_heads and head_dim and dtype_bytes):
        return None
    return num_layers * 2 * num_kv_heads * head_dim * dtype_bytes


def config_kv_shape(config: Any) -> tuple[int | None, int | None, int | None]:
    """(layers, KV heads, head_dim) of a transformers config (its text config where it nests one), as transformers'
    static cache allocates them: KV heads default to the attention heads, head_dim to hidden_size / heads."""
    conf = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(conf, "num_attention_heads", None)
    kv_heads = getattr(conf, "num_key_value_heads", None) or heads
    head_dim = getattr(conf, "head_dim", None)
    if head_dim is None and heads and getattr(conf, "hidden_size", None):
        head_dim = conf.hidden_size // heads
    return getattr(conf, "num_hidden_layers", None), kv_heads, head_dim


def signature_kv_bytes_per_token(ms: ModelSignature) -> int | None:
    """`kv_bytes_per_token` from a ModelSignature's facts, at the width of its dtype; None when one is unknown."""
    return kv_bytes_per_token(ms.num_layers, ms.num_kv_heads, ms.head_dim, DTYPE_BYTES.get(ms.dtype or ""))
