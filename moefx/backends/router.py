"""The MoE router in one launch at decode: residual add + RMSNorm + router GEMV + routing, `moefx::add_rms_norm_route`.

    moefx::add_rms_norm_route(Tensor x, Tensor residual, Tensor? norm_weight, float norm_eps, Tensor weight,
                              int top_k, str kind, bool renormalize, Tensor? correction_bias, int n_group,
                              int topk_group, float routed_scaling_factor, ScalarType? weights_dtype,
                              str backend) -> Tensor[]

returns [logits, h, rms_norm(h), topk_weights, topk_ids]: `moefx::add_rms_norm_dense_linear(x, residual, norm_weight,
norm_eps, [weight], [None], backend)` (backends/dense.py) followed by `moefx::fused_topk` of its logits with the
routing arguments (backends/routing.py), which is what fuse_router_topk replaces. Where the dense call runs the
gemv kernel on CUDA, one launch does both: the kernel's ROUTE epilogue (kernels/dense_gemm.py) routes the logits
in the program that writes the last tile of them, so the top-k is no kernel of its own in a decode step. The logits
it routes are the ones it stores, read back, so the ids and weights are fused_topk's of the same logits. Elsewhere the
two ops run one after the other. Inference only.
"""

from __future__ import annotations

import torch

from moefx.backends import dense
from moefx.backends import routing as _routing  # (and registers moefx::fused_topk)
from moefx.backends.dense_policy import GEMV


@torch.library.custom_op("moefx::add_rms_norm_route", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _add_rms_norm_route_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    weight: torch.Tensor,
    top_k: int,
    kind: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    weights_dtype: torch.dtype | None,
    backend: str,
) -> list[torch.Tensor]:
    route = (top_k, kind, renormalize, correction_bias, n_group, topk_group, routed_scaling_factor, weights_dtype)
    name = dense._chosen("add_rms_norm_route", x, [weight], [], None, None, backend)
    if name == GEMV and x.is_cuda and x.dim() == 2 and x.shape[0]:  # (_kernel selects x's device)
        return dense._kernel(x, [weight], [None], None, [], None, None, norm_weight, norm_eps, residual, route)
    logits, h, normed = torch.ops.moefx.add_rms_norm_dense_linear(x, residual, norm_weight, norm_eps, [weight],
                                                                  [None], backend, [], None)
    return [logits, h, normed, *torch.ops.moefx.fused_topk(logits, *route)]


@_add_rms_norm_route_op.register_fake
def _(x, residual, norm_weight, norm_eps, weight, top_k, kind, renormalize, correction_bias, n_group, topk_group,
      routed_scaling_factor, weights_dtype, backend):
    dense.check_add_norm_args(x, residual, norm_weight, norm_eps, [weight], [None], backend)
    if x.dim() != 2:
        raise ValueError(f"add_rms_norm_route x must be [T, H] rows, got {list(x.shape)}")
    t = x.shape[0]
    _routing._check(x.new_empty((t, weight.shape[0])), top_k, kind, n_group, topk_group)
    return [x.new_empty((t, weight.shape[0])), torch.empty_like(x), torch.empty_like(x),
            x.new_empty((t, top_k), dtype=weights_dtype or torch.float32), x.new_empty((t, top_k), dtype=torch.int64)]
