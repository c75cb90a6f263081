"""Quantized replacements for `nn.Linear` and 3-D experts modules, used by `moefx.quantize`.

Their forwards are plain PyTorch over moefx custom ops: a dynamic activation quant (`moefx::quant`),
then a quantized GEMM (`moefx::fp8_block_gemm` / `moefx::int8_gemm`). Keeping the quant a separate op
is what lets `fuse_act_quant` / `fuse_norm_quant` fold it into the SiLU-mul or RMSNorm producing it.
Parameter names follow the DeepSeek-V3 / Qwen3-FP8 checkpoint layout: `weight` (float8_e4m3fn [N, K])
and `weight_scale_inv` (fp32 [ceil(N/bn), ceil(K/bk)], dequantized weight = weight * scale). `from_linear` /
`from_experts` quantize straight into the new module's parameters, a bounded slice at a time, so making one
costs its quantized bytes and no more.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import moefx.ops.block_gemm  # noqa: F401  (registers moefx::fp8_block_gemm / int8_gemm)
from moefx.ops.quant import QuantScheme, quant_weight_fp8_block, quant_weight_int8_channel

moefx_ops = torch.ops.moefx


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Fp8BlockLinear(nn.Module):
    """w8a8 FP8: weights per (bn x bk) block, activations per token and group of bk (fp32 scales)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block_shape: tuple[int, int],
                 act_scheme: QuantScheme, device: torch.device | str | None = None) -> None:
        super().__init__()
        bn, bk = block_shape
        self.in_features, self.out_features, self.block_shape = in_features, out_features, (bn, bk)
        self.act_scheme = act_scheme
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.weight_scale_inv = _frozen(
            torch.ones(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32, device=device)
        )
        self.bias = _frozen(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_shape: tuple[int, int], act_scheme: QuantScheme) -> Fp8BlockLinear:
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, block_shape, act_scheme, w.device)
        quant_weight_fp8_block(w, *block_shape, out=(mod.weight.data, mod.weight_scale_inv.data))
        if linear.bias is not None:
            mod.bias.data = linear.bias.detach()  # shared: the original module is released
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = moefx_ops.quant(x, *self.act_scheme.args())
        bn, bk = self.block_shape
        return moefx_ops.fp8_block_gemm(q, s, self.weight, self.weight_scale_inv, bn, bk, self.bias, x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, block={self.block_shape}, act={self.act_scheme.kind}"


class Int8Linear(nn.Module):
    """w8a8 INT8: per-output-channel weight scales, per-token activation scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_scheme = QuantScheme("int8_token", 0)
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.weight_scale = _frozen(torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = _frozen(torch.zeros(out_features, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.device)
        quant_weight_int8_channel(linear.weight.detach(), out=(mod.weight.data, mod.weight_scale.data))
        if linear.bias is not None:
            mod.bias.data = linear.bias.detach()  # shared: the original module is released
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = moefx_ops.quant(x, *self.act_scheme.args())
        return moefx_ops.int8_gemm(q, s, self.weight, self.weight_scale, self.bias, x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int8 per-channel"


def experts_unsupported_reason(module: nn.Module) -> str | None:
    """Why `module` cannot be replaced by a quantized experts module, or None."""
    from transformers.activations import SiLUActivation

    gu, down = module.gate_up_proj, module.down_proj
    if getattr(module, "is_transposed", False):
        return "transposed expert weights"
    if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
        return "expert biases"
    if not isinstance(getattr(module, "act_fn", None), (nn.SiLU, SiLUActivation)):
        return f"activation {type(getattr(module, 'act_fn', None)).__name__} is not SiLU"
    e, two_i, h = gu.shape
    if two_i % 2 or down.shape != (e, h, two_i // 2):
        return f"shapes gate_up_proj {tuple(gu.shape)} / down_proj {tuple(down.shape)} are not [E, 2I, H] / [E, H, I]"
    return None


class Fp8BlockExperts(nn.Module):
    """FP8 block-quantized experts; forward is `moefx.backends.moe_experts` (backend chosen per call by M)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, block_shape: tuple[int, int],
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        bn, bk = block_shape
        self.num_experts, self.block_shape = num_experts, (bn, bk)
        e, h, i = num_experts, hidden, intermediate
        fp8 = torch.float8_e4m3fn
        self.gate_up_proj = _frozen(torch.empty(e, 2 * i, h, dtype=fp8, device=device))
        f32 = torch.float32
        self.gate_up_proj_scale_inv = _frozen(torch.ones(e, -(-2 * i // bn), -(-h // bk), dtype=f32, device=device))
        self.down_proj = _frozen(torch.empty(e, h, i, dtype=fp8, device=device))
        self.down_proj_scale_inv = _frozen(torch.ones(e, -(-h // bn), -(-i // bk), dtype=f32, device=device))

    @classmethod
    def from_experts(cls, module: nn.Module, block_shape: tuple[int, int]) -> Fp8BlockExperts:
        gu, down = module.gate_up_proj.detach(), module.down_proj.detach()
        e, two_i, h = gu.shape
        mod = cls(e, h, two_i // 2, block_shape, gu.device)
        quant_weight_fp8_block(gu, *block_shape, out=(mod.gate_up_proj.data, mod.gate_up_proj_scale_inv.data))
        quant_weight_fp8_block(down, *block_shape, out=(mod.down_proj.data, mod.down_proj_scale_inv.data))
        return mod

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        from moefx.backends import moe_experts

        return moe_experts(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
            w13_scale=self.gate_up_proj_scale_inv, w2_scale=self.down_proj_scale_inv, block_shape=self.block_shape,
        )

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, block={self.block_shape}"


class Int8Experts(nn.Module):
    """INT8 experts (per-channel weights, per-token activations) as a loop over the experts hit, each
    projection through `moefx::quant` + `moefx::int8_gemm`; no MoE backend takes INT8 weights yet."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        e, h, i = num_experts, hidden, intermediate
        self.num_experts = e
        self.act_scheme = QuantScheme("int8_token", 0)
        self.gate_up_proj = _frozen(torch.zeros(e, 2 * i, h, dtype=torch.int8, device=device))
        self.gate_up_proj_scale = _frozen(torch.ones(e, 2 * i, dtype=torch.float32, device=device))
        self.down_proj = _frozen(torch.zeros(e, h, i, dtype=torch.int8, device=device))
        self.down_proj_scale = _frozen(torch.ones(e, h, dtype=torch.float32, device=device))

    @classmethod
    def from_experts(cls, module: nn.Module) -> Int8Experts:
        gu, down = module.gate_up_proj.detach(), module.down_proj.detach()
        e, two_i, h = gu.shape
        mod = cls(e, h, two_i // 2, gu.device)
        quant_weight_int8_channel(gu, out=(mod.gate_up_proj.data, mod.gate_up_proj_scale.data))
        quant_weight_int8_channel(down, out=(mod.down_proj.data, mod.down_proj_scale.data))
        return mod

    def _linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        q, s = moefx_ops.quant(x, *self.act_scheme.args())
        return moefx_ops.int8_gemm(q, s, w, scale, None, x.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        for e in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == e)
            gate, up = self._linear(hidden_states[token], self.gate_up_proj[e], self.gate_up_proj_scale[e]).chunk(2, -1)
            y = self._linear(F.silu(gate) * up, self.down_proj[e], self.down_proj_scale[e])
            out.index_add_(0, token, y.float() * top_k_weights[token, slot, None].float())
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, int8 per-channel"
