"""The backward of `moefx::moe_experts`: gradients for hidden states, routing weights and the expert weights.

Per (token m, slot j) pair with expert e = topk_ids[m, j], routing weight w and dout = grad_out[m]:
  gu = W13[e] x = [g; u],  a = act(g) * u,  y = W2[e] a,  out[m] += w * y
  dA = W2[e]^T dout (unweighted),  d w = dA . a,  da = w * dA,  dW2[e] += (w * dout) a^T
  dgu = [da * u * act'(g); da * act(g)],  dx[m] += W13[e]^T dgu,  dW13[e] += dgu x^T
With a gate limit L, g and u are clamped first (g <= L, |u| <= L) and their gradients are zero where a clamp
is active (torch.clamp's rule: the bounds themselves pass the gradient).
The forward op saves only its inputs, so gu is recomputed here: five GEMMs (one recompute, dA, dW2, dx, dW13)
against four for autograd through transformers' grouped_mm forward, which keeps its intermediates instead.
Two paths, one result (`backward_path` picks):
- "grouped_mm": pairs sorted by expert (each expert's rows closed by one zero row, so no group is empty), every
  GEMM one `torch._grouped_mm` call (CUTLASS grouped GEMMs on Hopper), the activation backward and the
  routing-weight dot in fp32 between them; no host sync. CUDA, bf16
  activations, H and I multiples of 8 (16-byte rows), capability >= 8.0; FP8 block weights are dequantized to bf16
  for the call (transient memory of one bf16 copy of the layer's experts).
- "reference": a loop over the experts hit (host sync), computed in fp32 (fp64 for fp64 inputs: gradcheck).
  The CPU path, and the slower CUDA path for fp16/fp32 or shapes grouped_mm does not take.
FP8 block weights are frozen (the op returns no gradient for them); their activation gradients use the dequantized
weights, not the forward's w8a8 rounding of the activations (straight-through).
Gradients the caller does not need (`needs_input_grad`) are not computed: the op returns empty tensors for them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moefx.backends.registry import MoeCall, dequant_block
from moefx.backends.torch_grouped import cuda_grouped_mm_problem
from moefx.kernels.activation import Activation, get_activation


def grouped_mm_problem(hidden: torch.Tensor, w2: torch.Tensor) -> str | None:
    """Why the grouped_mm backward cannot run these inputs, or None."""
    if not hidden.is_cuda:
        return "grouped_mm backward runs on CUDA (the CPU runs the reference)"
    return cuda_grouped_mm_problem(hidden, w2)


def backward_path(hidden: torch.Tensor, w2: torch.Tensor) -> str:
    return "reference" if grouped_mm_problem(hidden, w2) else "grouped_mm"


def _weights(w: torch.Tensor, scale: torch.Tensor | None, block_shape: Sequence[int] | None) -> torch.Tensor:
    return w if scale is None else dequant_block(w, scale, tuple(block_shape))


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


def _gate_grads(
    g: torch.Tensor, u: torch.Tensor, d_a: torch.Tensor, act: Activation, limit: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a = act(g') * u', d gu = [d g; d u]) for d_a = d loss / d a, g' and u' the clamped g and u."""
    if limit is None:
        act_g = act.fn(g)
        return act_g * u, torch.cat([d_a * u * act.grad(g), d_a * act_g], dim=-1)
    gc, uc = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    act_g = act.fn(gc)
    dg = torch.where(g <= limit, d_a * uc * act.grad(gc), 0.0)
    du = torch.where(u.abs() <= limit, d_a * act_g, 0.0)
    return act_g * uc, torch.cat([dg, du], dim=-1)


def backward_reference(
    grad_out: torch.Tensor, call: MoeCall, needs: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d topk_weights, d w13, d w2) of `call` by a loop over the experts hit; `needs` says which."""
    hidden, topk_ids, topk_weights, w13, w2 = call.hidden, call.topk_ids, call.topk_weights, call.w13, call.w2
    w13_scale, w2_scale, block_shape = call.w13_scale, call.w2_scale, call.block_shape
    need_x, need_w, need_w13, need_w2 = needs
    act = get_activation(call.activation)
    c = torch.promote_types(hidden.dtype, torch.float32)
    m, k = topk_ids.shape
    dx = torch.zeros(m, hidden.shape[1], dtype=c, device=hidden.device)
    dtw = torch.zeros(m, k, dtype=c, device=hidden.device)
    dw13 = torch.zeros(w13.shape, dtype=c, device=hidden.device) if need_w13 else None
    dw2 = torch.zeros(w2.shape, dtype=c, device=hidden.device) if need_w2 else None
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        w13_e = _weights(w13[e], None if w13_scale is None else w13_scale[e], block_shape).to(c)
        w2_e = _weights(w2[e], None if w2_scale is None else w2_scale[e], block_shape).to(c)
        x = hidden[token].to(c)
        g, u = (x @ w13_e.T).chunk(2, dim=-1)
        go = grad_out[token].to(c)
        w = topk_weights[token, slot].to(c)[:, None]
        d_a = go @ w2_e  # dout^T W2[e]: the unweighted gradient of a
        a, dgu = _gate_grads(g, u, d_a * w, act, call.gate_limit)
        if need_w:
            dtw[token, slot] = (d_a * a).sum(dim=-1)
        if need_w2:
            dw2[e] = (go * w).T @ a
        if need_x:
            dx.index_add_(0, token, dgu @ w13_e)
        if need_w13:
            dw13[e] = dgu.T @ x
    return (
        dx.to(hidden.dtype) if need_x else _empty(hidden),
        dtw.to(topk_weights.dtype) if need_w else _empty(topk_weights),
        dw13.to(w13.dtype) if need_w13 else _empty(w13),
        dw2.to(w2.dtype) if need_w2 else _empty(w2),
    )


def backward_grouped_mm(
    grad_out: torch.Tensor, call: MoeCall, needs: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same gradients as `backward_reference`, each GEMM one `torch._grouped_mm` over the pairs sorted by expert.

    Every expert's group of rows ends with one row of zeros, so no group is empty: a weight-gradient GEMM (groups
    along K) is then never asked for a K = 0 group, whose output a grouped GEMM kernel may leave unwritten (CUTLASS
    issue 2674); the zero rows add nothing to any gradient.
    """
    hidden, topk_ids, topk_weights, w13, w2 = call.hidden, call.topk_ids, call.topk_weights, call.w13, call.w2
    w13_scale, w2_scale, block_shape = call.w13_scale, call.w2_scale, call.block_shape
    need_x, need_w, need_w13, need_w2 = needs
    act = get_activation(call.activation)
    dt, dev = hidden.dtype, hidden.device
    w13_in, w2_in = w13, w2
    w13 = _weights(w13, w13_scale, block_shape).to(dt)
    w2 = _weights(w2, w2_scale, block_shape).to(dt)
    m, k = topk_ids.shape
    num_pairs, num_experts = m * k, w13.shape[0]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    row = torch.arange(num_pairs, device=dev) + sorted_e  # sorted pair -> its row (expert e's zero rows precede)
    bounds = torch.arange(1, num_experts + 1, device=dev)
    offs = (torch.searchsorted(sorted_e, bounds - 1, right=True) + bounds).to(torch.int32)
    pair = torch.full((num_pairs + num_experts,), num_pairs, dtype=torch.long, device=dev).index_copy_(0, row, order)
    row_of_pair = torch.empty_like(order).index_copy_(0, order, row)  # original pair -> its row
    tok = torch.where(pair < num_pairs, pair // k, m)  # zero rows read the appended zero token
    x = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])[tok]
    go = torch.cat([grad_out.to(dt), hidden.new_zeros(1, hidden.shape[1])])[tok]
    w = torch.cat([topk_weights.reshape(-1).float(), topk_weights.new_zeros(1, dtype=torch.float32)])[pair][:, None]
    g, u = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs).float().chunk(2, dim=-1)
    d_a = torch._grouped_mm(go, w2, offs=offs).float()  # dout W2[e]: the unweighted gradient of a
    a, dgu = _gate_grads(g, u, d_a * w, act, call.gate_limit)
    dgu = dgu.to(dt)
    dtw = _empty(topk_weights)
    if need_w:
        dtw = (d_a * a).sum(dim=-1)[row_of_pair].view(m, k).to(topk_weights.dtype)
    dw2 = _empty(w2_in)
    if need_w2:  # [H, rows] (a transposed row-major tensor) x [rows, I], grouped along the rows
        dw2 = torch._grouped_mm((go.float() * w).to(dt).T, a.to(dt), offs=offs).to(w2_in.dtype)
    dx = _empty(hidden)
    if need_x:
        dx_rows = torch._grouped_mm(dgu, w13, offs=offs)
        dx = dx_rows[row_of_pair].view(m, k, -1).sum(dim=1, dtype=torch.float32).to(dt)
    dw13 = _empty(w13_in)
    if need_w13:
        dw13 = torch._grouped_mm(dgu.T, x, offs=offs).to(w13_in.dtype)
    return dx, dtw, dw13, dw2


@torch.library.custom_op("moefx::moe_experts_backward", mutates_args=())
def _moe_experts_backward_op(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block_shape: list[int] | None,
    activation: str,
    needs: list[bool],
    gate_limit: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # no pairs: zeros from the reference (grouped_mm would sort an empty tensor)
    grouped = hidden.shape[0] and backward_path(hidden, w2) == "grouped_mm"
    fn = backward_grouped_mm if grouped else backward_reference
    bs = tuple(block_shape) if block_shape is not None else None
    return fn(grad_out, MoeCall(hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, bs, activation,
                                gate_limit), needs)


@_moe_experts_backward_op.register_fake
def _(grad_out: torch.Tensor, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
      w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
      block_shape: list[int] | None, activation: str, needs: list[bool], gate_limit: float | None = None,
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    like = (hidden, topk_weights, w13, w2)
    return tuple(torch.empty_like(t) if need else _empty(t) for t, need in zip(like, needs))  # type: ignore[return-value]


def setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, block_shape, _, _, activation, gate_limit = inputs
    ctx.save_for_backward(hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale)
    ctx.block_shape, ctx.activation, ctx.gate_limit = block_shape, activation, gate_limit


def backward(ctx: object, grad_out: torch.Tensor) -> tuple:
    """The op's autograd formula: one `moefx::moe_experts_backward` node (one per MoE layer in a compiled graph)."""
    hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale = ctx.saved_tensors
    need = ctx.needs_input_grad
    if w13_scale is not None and (need[3] or need[4]):
        raise RuntimeError(
            "moefx::moe_experts: FP8 block-quantized expert weights are frozen (no gradient); "
            "set requires_grad=False on them (activation and routing-weight gradients are computed)"
        )
    needs = [bool(need[0]), bool(need[2]), bool(need[3]), bool(need[4])]
    dx, dtw, dw13, dw2 = torch.ops.moefx.moe_experts_backward(
        grad_out.contiguous(), hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, ctx.block_shape,
        ctx.activation, needs, ctx.gate_limit,
    )
    grads = [g if n else None for g, n in zip((dx, dtw, dw13, dw2), needs)]
    return grads[0], None, grads[1], grads[2], grads[3], None, None, None, None, None, None, None
