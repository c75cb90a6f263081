"""Fused MoE routing: router logits -> (topk_weights float32 [T, k], topk_ids int64 [T, k]) in one kernel.

kinds (same expert selection and weights as transformers' routers):
- "softmax": softmax -> top-k (-> renormalize): Qwen2/3-MoE, OLMoE (renormalize = norm_topk_prob),
  Mixtral (renormalize=True).
- "topk_softmax": top-k of the logits -> softmax over the k chosen (the Mixtral formulation).
- "sigmoid": DeepSeek-V3: sigmoid scores; choice = scores + correction_bias; groups ranked by the sum of
  their top-2 choices, the best topk_group kept; top-k of the kept choices; weights = scores (no bias),
  renormalized (+1e-20) when asked, times routed_scaling_factor.
CUDA runs the Triton kernel (no host sync, graph-capturable); the CPU (and shapes the kernel does not
take: k or n_group not a power of two, E/n_group not a power of two) runs the PyTorch path.
Ties between equal scores go to the lower expert id in both paths; torch.topk does not promise that.
"""

from __future__ import annotations

import torch

KINDS = ("softmax", "topk_softmax", "sigmoid")


def _check(
    router_logits: torch.Tensor, top_k: int, kind: str, n_group: int | None, topk_group: int | None
) -> tuple[int, int]:
    if kind not in KINDS:
        raise ValueError(f"fused_topk kind={kind!r} is invalid; valid choices: {list(KINDS)}")
    if router_logits.dim() != 2:
        raise ValueError(f"fused_topk router_logits must be [T, E], got {tuple(router_logits.shape)}")
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
    """PyTorch path; same math as the kernel (fp32 throughout)."""
    groups, kept = _check(router_logits, top_k, kind, n_group, topk_group)
    x = router_logits.float()
    if kind == "topk_softmax":
        vals, ids = torch.topk(x, top_k, dim=-1)
        return torch.softmax(vals, dim=-1) * routed_scaling_factor, ids
    if kind == "softmax":
        scores = torch.softmax(x, dim=-1)
        choice = scores
    else:
        scores = torch.sigmoid(x)
        choice = scores + correction_bias.float() if correction_bias is not None else scores
        if groups > 1:
            t, e = choice.shape
            group_score = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, torch.topk(group_score, kept, dim=-1)[1], True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // groups, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if kind == "sigmoid" else 0.0))
    return w * routed_scaling_factor, ids


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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
    """Routing in one launch on CUDA; see the module docstring for the kinds."""
    groups, kept = _check(router_logits, top_k, kind, n_group, topk_group)
    e = router_logits.shape[1]
    kernel_ok = _pow2(top_k) and _pow2(groups) and (groups == 1 or _pow2(e // groups)) and e <= 4096
    if router_logits.is_cuda and kernel_ok:
        from moefx.backends.kernels.routing import fused_topk_triton

        with torch.cuda.device(router_logits.device):
            return fused_topk_triton(
                router_logits, top_k, kind, renormalize, correction_bias, groups, kept, routed_scaling_factor
            )
    return fused_topk_torch(
        router_logits, top_k, kind, renormalize, correction_bias, n_group, topk_group, routed_scaling_factor
    )
