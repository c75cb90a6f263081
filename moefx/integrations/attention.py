"""transformers integration: `"moefx"` in transformers' AttentionInterface, and the `optimize` transform using it.

`attn_implementation="moefx"` is transformers' SDPA attention (its mask function too) except for one-query-position
calls on CUDA — every decode step — which run `moefx::decode_attention`: the query heads of each KV head attend
together (no `repeat_kv` copy of the cache), masked blocks (the unwritten tail of a static cache) are skipped, and
no layout copies are made for the SDPA kernel. Anything the kernel does not take (see `call_reason`) runs SDPA.
"""

from __future__ import annotations

from typing import Any

import torch

from moefx.ops import decode_attention as decode_op
from moefx.transforms import register_model_transform

NAME = "moefx"
REPLACES = "sdpa"


def call_reason(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float, kwargs: dict[str, Any]) -> str | None:
    """Why this attention call runs SDPA instead of the decode kernel (None: it runs the kernel)."""
    if not query.is_cuda:
        return f"device {query.device.type}"
    if query.shape[2] != 1:
        return "more than one query position"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return "autograd (the kernel has no backward)"
    if dropout and getattr(module, "training", False):
        return "attention dropout"
    used = sorted(k for k in ("softcap", "s_aux", "sinks", "position_bias") if kwargs.get(k) is not None)
    if used:
        return f"arguments {used}"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1
                                       or attention_mask.shape[2] != 1 or attention_mask.shape[3] < key.shape[2]):
        return f"attention mask of shape {tuple(attention_mask.shape)}"
    return decode_op.unsupported_reason(query, key, value, None)


def moefx_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns [B, q_len, Hq, D] like its SDPA path."""
    if call_reason(module, query, key, value, attention_mask, dropout, kwargs) is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, 0, 0, : key.shape[2]].expand(query.shape[0], key.shape[2])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.moefx.decode_attention(query, key, value, mask, scale)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `attn_implementation="moefx"` valid in transformers, with SDPA's mask function (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, moefx_attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[REPLACES])


@register_model_transform("attention", order=30)
def use_moefx_attention(model: torch.nn.Module, plan: Any, cfg: Any) -> list[str]:
    """On CUDA, replace transformers' SDPA attention by moefx's (decode steps on moefx::decode_attention)."""
    device = getattr(getattr(plan, "execution", None), "device_type", None)
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if device != "cuda":
        return [f"attention left as it is: the decode kernel is for CUDA, device is {device}"]
    if impl != REPLACES or not hasattr(model, "set_attn_implementation"):
        return [f"attention left as it is: implementation {impl!r} (moefx takes over {REPLACES!r})"]
    register()
    model.set_attn_implementation(NAME)
    return [f"attn_implementation = {NAME}: one-query-position calls on moefx::decode_attention (GQA without "
            f"repeat_kv, masked blocks skipped), the rest on transformers' {REPLACES}"]
