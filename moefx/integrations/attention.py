"""transformers integration: `"moefx"` in transformers' AttentionInterface, and the `optimize` transform using it.

`attn_implementation="moefx"` is transformers' SDPA attention except for one-query-position calls on CUDA — every
decode step — which run `moefx::decode_attention`: the query heads of each KV head attend together (no `repeat_kv`
copy of the cache), masked blocks (the unwritten tail of a static cache) are skipped, and no layout copies are made
for the SDPA kernel. Anything the kernel does not take (see `call_reason`) runs SDPA.

Its mask function is SDPA's, except that a plain causal mask over a fresh prompt is left out (`causal_prompt_mask`),
so SDPA runs with `is_causal=True`. transformers leaves it out itself in eager mode, but under torch.compile only
where its version check allows (`masking_utils._ignore_causal_mask_sdpa`): with transformers 5.17 and torch 2.11
(the H200) the compiled prefill's SDPA computed the whole masked square, 40 of 98 ms of kernels in a 4096-token
prefill at 48 layers (docs/FINDINGS.md).
"""

from __future__ import annotations

from typing import Any

import torch

from moefx.ops import decode_attention as decode_op

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


def is_fresh_causal(kwargs: dict[str, Any]) -> bool:
    """Whether the mask transformers asks for is plain causal over queries and keys that both start at position 0
    (no padding mask, no other pattern, as many keys as queries), which SDPA's `is_causal=True` computes exactly."""
    from transformers.masking_utils import causal_mask_function

    if kwargs.get("mask_function", causal_mask_function) is not causal_mask_function:
        return False
    if kwargs.get("attention_mask") is not None or kwargs.get("local_size") is not None:
        return False
    if not kwargs.get("allow_is_causal_skip", True):
        return False
    for name in ("q_offset", "kv_offset"):
        offset = kwargs.get(name, 0)
        if not isinstance(offset, int) or offset != 0:
            return False
    q_length = kwargs.get("q_length")
    if q_length is None and isinstance(kwargs.get("cache_position"), torch.Tensor):
        q_length = kwargs["cache_position"].shape[0]  # transformers versions that pass cache_position
    kv_length = kwargs.get("kv_length")
    return q_length is not None and kv_length is not None and q_length == kv_length and q_length > 1


def causal_prompt_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """SDPA's mask function, returning None (SDPA then runs `is_causal=True`) where `is_fresh_causal`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if not args and is_fresh_causal(kwargs):
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[REPLACES](*args, **kwargs)


def register() -> None:
    """Make `attn_implementation="moefx"` valid in transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, moefx_attention_forward)
    AttentionMaskInterface.register(NAME, causal_prompt_mask)


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
