"""Fused MoE routing: router logits -> (topk_weights float32 [T, k], topk_ids int64 [T, k]) in one kernel.

Custom op (what the `fuse_moe_routing` pass emits; fake impl, CPU path, CUDA Triton kernel, autograd):
  moefx::fused_topk(Tensor router_logits, int top_k, str kind="softmax", bool renormalize=True,
                    Tensor? correction_bias=None, int n_group=1, int topk_group=1,
                    float routed_scaling_factor=1.0) -> (Tensor weights, Tensor ids)
router_logits [T, E] (fp32, bf16 or fp16; read and computed in fp32), weights fp32 and ids int64, [T, k],
sorted by rank. The dtype cast a model applies to its routing weights stays outside the op.

kinds (same expert selection and weights as transformers' routers):
- "softmax": softmax -> top-k (-> renormalize): Qwen2/3-MoE, OLMoE (renormalize = norm_topk_prob),
  Mixtral (renormalize=True).
- "topk_softmax": top-k of the logits -> softmax over the k chosen (the other Mixtral formulation).
- "sigmoid": DeepSeek-V3 / GLM4-MoE: sigmoid scores; choice = scores + correction_bias; groups ranked by the
  sum of their top-2 choices, the best topk_group kept; top-k of the kept choices; weights = scores (no bias),
  renormalized (+1e-20) when asked, times routed_scaling_factor.

Selection (both paths): "softmax" and "topk_softmax" rank the logits themselves (softmax is monotone, so the
k chosen are eager's whenever eager's k-th and (k+1)-th values differ, whatever exp implementation eager
used); "sigmoid" ranks sigmoid + bias as this op computes it. Equal values go to the lower expert id (and
the lower group id); torch.topk promises no order among equals. NaN ranks highest, as in torch.topk.
CUDA runs the Triton kernel (no host sync, fixed-size outputs: graph-capturable) when `kernel_supports`
says it takes the shape; the CPU, and shapes it does not take, run the PyTorch path.
"""

from __future__ import annotations

import torch

from moefx.kernels.availability import triton_missing
from moefx.kernels.memo import ShapeMemo, on_device
from moefx.kernels.routing_limits import kernel_supports

KINDS = ("softmax", "topk_softmax", "sigmoid")
# transformers' DeepSeek-V3 / GLM4-MoE renormalization denominator (+ this); the Triton kernel adds the same literal
SIGMOID_RENORM_EPS = 1e-20


def _check(
    router_logits: torch.Tensor, top_k: int, kind: str, n_group: int | None, topk_group: int | None
) -> tuple[int, int]:
    if kind not in KINDS:
        raise ValueError(f"fused_topk kind={kind!r} is invalid; valid choices: {list(KINDS)}")
    if router_logits.dim() != 2:
        raise ValueError(f"fused_topk router_logits must be [T, E], got {tuple(router_logits.shape)}")
    if router_logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fused_topk router_logits dtype {router_logits.dtype}; valid: float32, bfloat16, float16")
    e = router_logits.shape[1]
    if not 1 <= top_k <= e:
        raise ValueError(f"fused_topk top_k={top_k} must be in 1..{e} (E)")
    groups = n_group or 1
    kept = topk_group or groups
    if kind != "sigmoid" and groups != 1:
        raise ValueError(f"fused_topk n_group={n_group} is only valid with kind='sigmoid'")
    if e % groups or not 1 <= kept <= groups or top_k > kept * (e // groups):
        raise ValueError(
            f"fused_topk n_group={n_group}, topk_group={topk_group} do not fit E={e}, top_k={top_k}: need "
            f"E % n_group == 0, 1 <= topk_group <= n_group, top_k <= topk_group * E / n_group"
        )
    return groups, kept


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, equal values in ascending index order (stable sort)."""
    return torch.sort(values, dim=-1, descending=True, stable=True)[1][..., :k].contiguous()


def fused_topk_torch(
    router_logits: torch.Tensor,
    top_k: int,
    kind: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch path; same math and tie rule as the kernel (fp32 throughout)."""
    groups, kept = _check(router_logits, top_k, kind, n_group, topk_group)
    x = router_logits.float()
    if kind in ("topk_softmax", "softmax"):  # softmax keeps the order of the logits: rank those
        ids = _top(x, top_k)
    else:
        scores = torch.sigmoid(x)
        choice = scores + correction_bias.float() if correction_bias is not None else scores
        if groups > 1:
            t, e = choice.shape
            group_score = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, _top(group_score, kept), True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // groups, dim=1), float("-inf"))
        ids = _top(choice, top_k)
    return _weights_for(router_logits, ids, kind, renormalize, routed_scaling_factor).contiguous(), ids


def _weights_for(
    router_logits: torch.Tensor, ids: torch.Tensor, kind: str, renormalize: bool, routed_scaling_factor: float
) -> torch.Tensor:
    """The op's weights at the chosen ids, as a differentiable function of the logits (the PyTorch path and the
    op's backward)."""
    x = router_logits.float()
    if kind == "topk_softmax":
        return torch.softmax(x.gather(1, ids), dim=-1) * routed_scaling_factor
    w = (torch.softmax(x, dim=-1) if kind == "softmax" else torch.sigmoid(x)).gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + (SIGMOID_RENORM_EPS if kind == "sigmoid" else 0.0))
    return w * routed_scaling_factor


_CHECKED = ShapeMemo()


def _use_kernel(router_logits: torch.Tensor, top_k: int, kind: str, n_group: int, topk_group: int) -> bool:
    """The arguments checked (ValueError when bad) and whether the Triton kernel runs them: once per key."""
    key = (router_logits.shape, router_logits.dtype, router_logits.device, top_k, kind, n_group, topk_group)
    found = _CHECKED.get(key)
    if found is None:
        _check(router_logits, top_k, kind, n_group, topk_group)  # raises on every call with a bad key
        found = _CHECKED.put(key, router_logits.is_cuda and not triton_missing()
                            and kernel_supports(router_logits.shape[1], n_group) is None)
    return found


@torch.library.custom_op("moefx::fused_topk", mutates_args=())
def _fused_topk_op(
    router_logits: torch.Tensor,
    top_k: int,
    kind: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_kernel(router_logits, top_k, kind, n_group, topk_group):
        from moefx.kernels.moe_routing import fused_topk_triton

        with on_device(router_logits.device):
            return fused_topk_triton(
                router_logits, top_k, kind, renormalize, correction_bias, n_group, topk_group, routed_scaling_factor,
                weights_dtype,
            )
    weights, ids = fused_topk_torch(
        router_logits, top_k, kind, renormalize, correction_bias, n_group, topk_group, routed_scaling_factor
    )
    return (weights if weights_dtype is None else weights.to(weights_dtype)), ids


@_fused_topk_op.register_fake
def _(
    router_logits: torch.Tensor,
    top_k: int,
    kind: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(router_logits, top_k, kind, n_group, topk_group)
    t = router_logits.shape[0]
    return (router_logits.new_empty(t, top_k, dtype=weights_dtype or torch.float32),
            router_logits.new_empty(t, top_k, dtype=torch.int64))


def _setup_context(ctx, inputs, output) -> None:
    router_logits, _, kind, renormalize, _, _, _, scale, _ = inputs
    ctx.save_for_backward(router_logits, output[1])
    ctx.routing = (kind, renormalize, scale)


def _backward(ctx, grad_weights, grad_ids):
    router_logits, ids = ctx.saved_tensors
    with torch.enable_grad():
        x = router_logits.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(_weights_for(x, ids, *ctx.routing), x, grad_weights.float())
    # The selection (ids, and so the correction bias) is piecewise constant: no gradient through it.
    return grad, None, None, None, None, None, None, None, None


_fused_topk_op.register_autograd(_backward, setup_context=_setup_context)


def fused_topk(
    router_logits: torch.Tensor,
    top_k: int,
    kind: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing in one launch on CUDA (`torch.ops.moefx.fused_topk`); see the module docstring for the kinds."""
    groups, kept = _check(router_logits, top_k, kind, n_group, topk_group)
    return torch.ops.moefx.fused_topk(
        router_logits, top_k, kind, renormalize, correction_bias, groups, kept, float(routed_scaling_factor)
    )
