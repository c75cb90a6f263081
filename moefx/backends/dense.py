"""dense: small-M GEMM/GEMV for dense and attention projections, behind one op, `moefx::dense_linear`.

    moefx::dense_linear(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor? x_scale, Tensor[] weight_scales,
                        SymInt[]? block_shape, ScalarType? out_dtype, str backend) -> Tensor[]

returns [x @ w_i^T + b_i for each weight]: several linears that read the same x (q/k/v, gate/up) in one call.
Float form: x [..., K] and weights [N_i, K] in one dtype (bf16/fp16/fp32), outputs in that dtype, weight_scales
empty. FP8 form (weight_scales given): the `moefx::fp8_block_gemm` contract for each weight: x float8_e4m3fn
[..., K] with per-token-group scales x_scale [..., ceil(K/bk)], weights float8_e4m3fn with `weight_scale_inv`
[ceil(N_i/bn), ceil(K/bk)], block_shape [bn, bk], outputs in out_dtype. The activation quant stays a separate
`moefx::quant` op in front, so fuse_act_quant / fuse_norm_quant still fold it into its producer. FP8 weight-only
form (weight_scales given, x_scale None): x float, the same FP8 weights and scales, outputs in out_dtype or x's
dtype, y = x @ dequant(W)^T in fp32 rounded once (what fp8_weight_only writes at decode M: no activation quant).

Backends, chosen per call by M (rows of x) through the dense policy (dense_policy.py; `backend` is "auto",
"gemv" or "upstream"):
- `upstream`: each linear as the unfused graph computes it (`F.linear`, or `moefx::fp8_block_gemm` for FP8):
  bit for bit the computation the passes replaced; the weight-only form, which no unfused op computes, as the
  reference below does (weights dequantized in fp32). Every call the policy has no row for runs this.
- `gemv`: on CUDA the Triton kernel (kernels/dense_gemm.py: one launch for up to four weights, bandwidth-bound
  at M = 1..16); on CPU the same math in PyTorch (fp32 accumulation, one rounding per output), which is also the
  reference the kernel is tested against.
The choice depends on shapes only, and a call inside CUDA-graph capture uses the capture rows; neither backend
syncs the host or allocates by data. Autograd: the float form differentiates as separate linears.

    moefx::rms_norm_dense_linear(Tensor x, Tensor? norm_weight, float norm_eps, Tensor[] weights, Tensor?[] biases,
                                 str backend, Tensor[] weight_scales, SymInt[]? block_shape) -> Tensor[]

returns [rms_norm(x) @ w_i^T + b_i] (float x: the float form, or with weight_scales and block_shape the FP8
weight-only form), rms_norm as transformers' Qwen3/Llama RMSNorm computes it:
n = (x32 * rsqrt(mean(x32^2, -1) + norm_eps)).to(x.dtype) with x32 = x in fp32, then norm_weight * n in x's dtype
(norm_weight [K] in x's dtype, or None: no weight). What fuse_norm_linear writes for a decoder layer's input norm
and its q/k/v call, so the norm runs in the GEMV kernel's prologue instead of a kernel of its own. The backend is
dense_linear's for the same x and weights: `gemv` on CUDA is the kernel with the norm prologue; elsewhere (gemv on
CPU, upstream) the norm runs as the same torch ops as transformers' and then that backend's linears, so `upstream`
is bit for bit the unfused graph. Inference only: no autograd formula (backward through it raises).

    moefx::add_rms_norm_dense_linear(Tensor x, Tensor residual, Tensor? norm_weight, float norm_eps, Tensor[] weights,
                                     Tensor?[] biases, str backend, Tensor[] weight_scales, SymInt[]? block_shape)
                                     -> Tensor[]

the same with the norm's input a residual add, h = residual + x in x's dtype: returns [rms_norm(h) @ w_i^T + b_i
for each weight] followed by h and rms_norm(h) (residual the shape and dtype of x). What fuse_norm_linear writes for
a decoder layer's post-attention add, norm and router: the sum is the layer's next residual and the normed rows the
experts' input, so the gemv kernel writes both (its RESID prologue) and the add and norm need no kernel of their own.
Elsewhere the add, the norm and the linears run as torch ops, `upstream` bit for bit the unfused graph.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from moefx.backends import calibration
from moefx.backends.capture_mode import decides_as_captured
from moefx.backends.common import FLOAT_DTYPES
from moefx.backends.dense_policy import GEMV, dense_key, env_token, requested
from moefx.backends.policy import UPSTREAM
from moefx.backends.registry import dequant_block
from moefx.config import DENSE_BACKENDS
from moefx.kernels.availability import triton_missing
from moefx.kernels.memo import ShapeMemo, on_device, tensor_meta
from moefx.log import get_logger, warn_once
from moefx.ops.block_gemm import ref_fp8_block_gemm  # (and registers moefx::fp8_block_gemm, the FP8 upstream)
from moefx.ops.quant import FP8_DTYPE as FP8
from moefx.ops.quant import ref_rms_norm  # transformers' RMSNorm, op for op

log = get_logger("moefx.backends")


def check_args(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    x_scale: torch.Tensor | None,
    weight_scales: Sequence[torch.Tensor],
    block_shape: Sequence[int] | None,
    out_dtype: torch.dtype | None,
    backend: str,
    op: str = "dense_linear",
) -> None:
    """ValueError naming what is wrong with a dense_linear call (shapes, dtypes, FP8 arguments, backend); `op` is
    the op the message names."""
    if backend not in DENSE_BACKENDS:
        raise ValueError(f"{op} backend={backend!r} is invalid; valid choices: {list(DENSE_BACKENDS)}")
    if not weights or len(biases) != len(weights):
        raise ValueError(f"{op} needs at least one weight and one bias entry (or None) per weight; got "
                         f"{len(weights)} weights, {len(biases)} biases")
    k = x.shape[-1]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != k:
            raise ValueError(f"{op} weight {i} has shape {tuple(w.shape)}; expected [N, {k}] for x "
                             f"{tuple(x.shape)}")
        b = biases[i]
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"{op} bias {i} has shape {tuple(b.shape)}; expected ({w.shape[0]},)")
    if not weight_scales:
        if x_scale is not None or block_shape is not None:
            raise ValueError(f"{op}: x_scale and block_shape belong to the FP8 form (give weight_scales too)")
        if x.dtype not in FLOAT_DTYPES or any(w.dtype != x.dtype for w in weights):
            raise ValueError(f"{op} float form: x and weights must share one of {list(FLOAT_DTYPES)}; got x "
                             f"{x.dtype}, weights {sorted({str(w.dtype) for w in weights})}")
        if out_dtype is not None and out_dtype != x.dtype:
            raise ValueError(f"{op} float form writes x's dtype {x.dtype}; out_dtype={out_dtype} is invalid")
        return
    if len(weight_scales) != len(weights) or block_shape is None or len(block_shape) != 2:
        raise ValueError(f"{op} FP8 form needs one weight scale per weight and block_shape [bn, bk]")
    if any(w.dtype != FP8 for w in weights):
        raise ValueError(f"{op} FP8 form needs float8_e4m3fn weights; got {sorted({str(w.dtype) for w in weights})}")
    if x_scale is None and x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op} FP8 weight-only form (no x_scale) needs x in one of {list(FLOAT_DTYPES)}; got "
                         f"{x.dtype}")
    if x_scale is not None and x.dtype != FP8:
        raise ValueError(f"{op} FP8 form with x_scale needs a float8_e4m3fn x; got {x.dtype}")
    bn, bk = (int(v) for v in block_shape)
    kb = -(-k // bk)
    if x_scale is not None and tuple(x_scale.shape) != (*x.shape[:-1], kb):
        raise ValueError(f"{op} x_scale shape {tuple(x_scale.shape)} must be {(*x.shape[:-1], kb)}")
    for i, (w, s) in enumerate(zip(weights, weight_scales)):
        if tuple(s.shape) != (-(-w.shape[0] // bn), kb):
            raise ValueError(f"{op} weight scale {i} has shape {tuple(s.shape)}; expected "
                             f"{(-(-w.shape[0] // bn), kb)}")
    if out_dtype not in FLOAT_DTYPES and (x_scale is not None or out_dtype is not None):
        raise ValueError(f"{op} FP8 form out_dtype={out_dtype} is invalid; valid: {list(FLOAT_DTYPES)}"
                         f"{'' if x_scale is not None else ' or None (x dtype)'}")


def upstream(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype) -> list[torch.Tensor]:
    """The linears one by one, as the unfused graph runs them; the FP8 weight-only form, which no unfused op
    computes, as `reference` does (each weight dequantized in fp32)."""
    if not weight_scales:
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    if x_scale is None:
        return reference(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype)
    bn, bk = (int(v) for v in block_shape)
    return [torch.ops.moefx.fp8_block_gemm(x, x_scale, w, s, bn, bk, b, out_dtype)
            for w, s, b in zip(weights, weight_scales, biases)]


def reference(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype) -> list[torch.Tensor]:
    """fp32 products and sums, bias added in fp32, one rounding per output: what the gemv kernel computes
    (up to summation order). The CPU path of `gemv`, and the oracle its tests use. FP8 weight-only (no x_scale):
    x in fp32 times each weight dequantized in fp32 (weight * its block's scale), rounded to out_dtype or x's."""
    if weight_scales and x_scale is None:
        bn, bk = (int(v) for v in block_shape)
        return [ref_fp8_weight_only(x, w, s, bn, bk, b, out_dtype or x.dtype)
                for w, s, b in zip(weights, weight_scales, biases)]
    if weight_scales:
        bn, bk = (int(v) for v in block_shape)
        return [ref_fp8_block_gemm(x, x_scale, w, s, bn, bk, b, out_dtype)
                for w, s, b in zip(weights, weight_scales, biases)]
    x32 = x.float()
    outs = []
    for w, b in zip(weights, biases):
        y = x32 @ w.float().t()
        outs.append((y if b is None else y + b.float()).to(x.dtype))
    return outs


def ref_fp8_weight_only(x, w, w_scale, block_n, block_k, bias, out_dtype) -> torch.Tensor:
    """x @ dequant(w)^T (+ bias) in fp32, one rounding to out_dtype: the FP8 weight-only linear's oracle."""
    out = x.float() @ dequant_block(w, w_scale, (block_n, block_k)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def gemv_unsupported_reason(x: torch.Tensor, weights: Sequence[torch.Tensor], weight_scales: Sequence[torch.Tensor],
                            block_shape: Sequence[int] | None) -> str | None:
    """None when the gemv backend can run this call, else why not (shown once in the log)."""
    if x.device.type not in ("cuda", "cpu"):
        return f"gemv does not run on {x.device.type}"
    if any(w.device != x.device for w in weights):
        return "weights and x are on different devices"
    if any(w.stride(-1) != 1 or w.stride(0) < w.shape[1] for w in weights):
        return "a weight is not contiguous in K (the kernel streams rows)"
    if x.is_cuda:
        missing = triton_missing()
        if missing:
            return missing
        if weight_scales:
            bn, bk = (int(v) for v in block_shape)
            if bk < 16 or bk & (bk - 1) or bn < 1:
                return f"FP8 block_shape {tuple(block_shape)}: the kernel needs bk a power of two >= 16"
            if torch.cuda.get_device_capability(x.device) < (8, 9):
                return "FP8 dot needs compute capability >= 8.9"
    return None


def gemv(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype) -> list[torch.Tensor]:
    if not x.is_cuda:
        return reference(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype)
    return _kernel(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype)


def _kernel(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype, norm_weight=None, norm_eps=None,
            residual=None, route=None) -> list[torch.Tensor]:
    """The Triton kernel over x's rows (with its RMSNorm prologue when norm_eps is given, after the residual add
    when residual is: then the sum and the normed sum follow the outputs; with `route`, its routing weights and ids
    after those, `dense_gemv`'s contract)."""
    from moefx.kernels.dense_gemm import dense_gemv

    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    r2 = residual.reshape(-1, k) if residual is not None else None
    xs2 = x_scale.reshape(-1, x_scale.shape[-1]) if x_scale is not None else None
    bs = tuple(int(v) for v in block_shape) if block_shape is not None else None
    with on_device(x.device):
        outs = dense_gemv(x2, list(weights), list(biases), xs2, list(weight_scales) or None, bs, out_dtype,
                          norm_weight=norm_weight, norm_eps=norm_eps, residual=r2, route=route)
    return [o.reshape(*lead, o.shape[-1]) for o in outs]


RUNNERS = {GEMV: gemv, UPSTREAM: upstream}


_DECISIONS = ShapeMemo()


def select_backend(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    weight_scales: Sequence[torch.Tensor],
    block_shape: Sequence[int] | None,
    out_dtype: torch.dtype | None,
    backend: str = "auto",
    capturing: bool | None = None,
) -> str:
    """The backend one call runs: the policy's choice for its M, or upstream with a one-time warning why.

    `capturing` None reads the capture rows on a capturing stream or under `as_captured()` (capture_mode.py);
    True/False asks what would run. The choice reads only the key below (metadata of x and the weights, the
    arguments, MOEFX_DENSE_BACKEND's raw value, the tables' generation, the thread count of CPU rows), so it is
    made once per key (memo.py)."""
    if capturing is None:
        capturing = decides_as_captured(x)
    key = (tensor_meta(x), tuple(tensor_meta(w) for w in weights), bool(weight_scales),
           tuple(block_shape) if block_shape is not None else None, out_dtype, backend, capturing, env_token(),
           calibration._generation, torch.get_num_threads())
    found = _DECISIONS.get(key)
    if found is None:
        found = _DECISIONS.put(key, _decide(x, weights, weight_scales, block_shape, out_dtype, backend, capturing))
    name, warning = found
    if warning:
        warn_once(warning)  # once per process, as on the call that decided
    return name


def _decide(x, weights, weight_scales, block_shape, out_dtype, backend, capturing) -> tuple[str, str | None]:
    """(backend name, the warning that says why it is upstream or None) for one key."""
    mode = "capture" if capturing else "eager"
    m = x.numel() // max(x.shape[-1], 1)
    dtype = (out_dtype or x.dtype) if weight_scales else x.dtype
    quant = tuple(block_shape) if weight_scales else None
    key = dense_key(x.device, [w.shape[0] for w in weights], x.shape[-1], dtype, quant, mode)
    name, source = requested(m, backend, key)
    warning = None
    if name == GEMV:
        reason = gemv_unsupported_reason(x, weights, weight_scales, block_shape)
        if reason:
            warning = f"dense backend gemv (from {source}) cannot run these inputs: {reason}; running upstream"
            name = UPSTREAM
    elif name not in RUNNERS:
        warning = f"dense backend {name!r} (from {source}) is unknown; running upstream"
        name = UPSTREAM
    return name, warning


def _chosen(op: str, x, weights, weight_scales, block_shape, out_dtype, backend) -> str:
    """select_backend's choice for one call of `op`, logged at debug level."""
    name = select_backend(x, weights, weight_scales, block_shape, out_dtype, backend)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s M=%d N=%s -> %s", op, x.numel() // x.shape[-1], [w.shape[0] for w in weights], name)
    return name


# flexible_layout: as for moefx::moe_experts (backends/op.py); the runners take any strides of `x`.
@torch.library.custom_op("moefx::dense_linear", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _dense_linear_op(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    x_scale: torch.Tensor | None,
    weight_scales: list[torch.Tensor],
    block_shape: list[int] | None,
    out_dtype: torch.dtype | None,
    backend: str,
) -> list[torch.Tensor]:
    if x.numel() == 0:
        return [x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype or x.dtype) for w in weights]
    name = _chosen("dense_linear", x, weights, weight_scales, block_shape, out_dtype, backend)
    return RUNNERS[name](x, weights, biases, x_scale, weight_scales, block_shape, out_dtype)


@_dense_linear_op.register_fake
def _(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype, backend):
    check_args(x, weights, biases, x_scale, weight_scales, block_shape, out_dtype, backend)
    dtype = (out_dtype or x.dtype) if weight_scales else x.dtype
    return [x.new_empty((*x.shape[:-1], w.shape[0]), dtype=dtype) for w in weights]


def _setup_context(ctx, inputs, output) -> None:
    x, weights, biases, _, weight_scales, _, _, _ = inputs
    ctx.fp8 = bool(weight_scales)
    # torch.library passes a bias list holding a None as one non-tensor input: its tensors get no gradient there
    # (the `dense_linear` wrapper gives such calls zero biases when a bias needs one).
    ctx.bias_grads = all(b is not None for b in biases)
    ctx.save_for_backward(x, *weights)


def _backward(ctx, grads):
    x, *weights = ctx.saved_tensors
    n = len(weights)
    if ctx.fp8:
        return None, [None] * n, [None] * n, None, [None] * n, None, None, None
    # Only the gradients autograd asks for: frozen weights (inference, LoRA) skip their [N, K] products.
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_w = list(need_w) if isinstance(need_w, (list, tuple)) else [need_w] * n
    need_b = list(need_b) if isinstance(need_b, (list, tuple)) else [need_b] * n
    gx = None
    gws, gbs = [], []
    x2 = x.reshape(-1, x.shape[-1])
    for i, (w, g) in enumerate(zip(weights, grads)):
        g2 = g.reshape(-1, g.shape[-1])
        if need_x:
            gx = g2 @ w if gx is None else gx + g2 @ w
        gws.append(g2.t() @ x2 if need_w[i] else None)
        gbs.append(g2.sum(0) if need_b[i] else None)
    return (gx.reshape(x.shape) if need_x else None, gws, gbs if ctx.bias_grads else None, None, [], None, None,
            None)


_dense_linear_op.register_autograd(_backward, setup_context=_setup_context)


def dense_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    *,
    x_scale: torch.Tensor | None = None,
    weight_scales: Sequence[torch.Tensor] | None = None,
    block_shape: Sequence[int] | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> list[torch.Tensor]:
    """[x @ w_i^T + b_i for each weight] through `moefx::dense_linear` (see the module docstring for both forms)."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    given = [b for b in biases if b is not None]
    if torch.is_grad_enabled() and len(given) < len(biases) and any(b.requires_grad for b in given):
        # exact (adding +0 to each sum), and it keeps the given biases differentiable (see _setup_context)
        biases = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)]
    scales = list(weight_scales or [])
    bs = [int(b) for b in block_shape] if block_shape is not None else None
    check_args(x, weights, biases, x_scale, scales, bs, out_dtype, backend)
    return torch.ops.moefx.dense_linear(x, list(weights), biases, x_scale, scales, bs, out_dtype, backend)


def check_norm_args(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    backend: str,
    op: str = "rms_norm_dense_linear",
    weight_scales: Sequence[torch.Tensor] = (),
    block_shape: Sequence[int] | None = None,
) -> None:
    """ValueError naming what is wrong with a rms_norm_dense_linear call (or `op`'s): dense_linear's checks for a
    float x (the float form, or the FP8 weight-only form with weight_scales), then the norm's arguments."""
    check_args(x, weights, biases, None, list(weight_scales), block_shape, None, backend, op=op)
    k = x.shape[-1]
    if norm_weight is not None and (tuple(norm_weight.shape) != (k,) or norm_weight.dtype != x.dtype or
                                    norm_weight.device != x.device):
        raise ValueError(f"{op} norm_weight is {list(norm_weight.shape)}/{norm_weight.dtype} on "
                         f"{norm_weight.device}; expected [{k}]/{x.dtype} on x's device {x.device}")
    if not norm_eps >= 0:
        raise ValueError(f"{op} norm_eps={norm_eps} is invalid; it must be >= 0")


@torch.library.custom_op("moefx::rms_norm_dense_linear", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _rms_norm_dense_linear_op(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    backend: str,
    weight_scales: list[torch.Tensor],
    block_shape: list[int] | None,
) -> list[torch.Tensor]:
    if x.numel() == 0:
        return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]
    # dense_linear's key and policy: the norm changes neither M nor the weights the choice is made for
    name = _chosen("rms_norm_dense_linear", x, weights, weight_scales, block_shape, None, backend)
    if name == GEMV and x.is_cuda:
        return _kernel(x, weights, biases, None, weight_scales, block_shape, None, norm_weight, norm_eps)
    return RUNNERS[name](ref_rms_norm(x, norm_weight, norm_eps, False), weights, biases, None, weight_scales,
                         block_shape, None)


@_rms_norm_dense_linear_op.register_fake
def _(x, norm_weight, norm_eps, weights, biases, backend, weight_scales, block_shape):
    check_norm_args(x, norm_weight, norm_eps, weights, biases, backend, weight_scales=weight_scales,
                    block_shape=block_shape)
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


def rms_norm_dense_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    *,
    backend: str = "auto",
    weight_scales: Sequence[torch.Tensor] | None = None,
    block_shape: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """[rms_norm(x) @ w_i^T + b_i for each weight] through `moefx::rms_norm_dense_linear` (module docstring);
    with weight_scales and block_shape, FP8 weights dequantized per block (the weight-only form); inference only."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    scales, bs = _fp8_args(weight_scales, block_shape)
    check_norm_args(x, norm_weight, float(norm_eps), weights, biases, backend, weight_scales=scales, block_shape=bs)
    return torch.ops.moefx.rms_norm_dense_linear(x, norm_weight, float(norm_eps), list(weights), biases, backend,
                                                 scales, bs)


def _fp8_args(weight_scales: Sequence[torch.Tensor] | None, block_shape: Sequence[int] | None
              ) -> tuple[list[torch.Tensor], list[int] | None]:
    return list(weight_scales or []), [int(b) for b in block_shape] if block_shape is not None else None


def check_add_norm_args(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    backend: str,
    weight_scales: Sequence[torch.Tensor] = (),
    block_shape: Sequence[int] | None = None,
) -> None:
    """ValueError naming what is wrong with an add_rms_norm_dense_linear call: the residual, then the norm form's
    checks."""
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"add_rms_norm_dense_linear residual is {list(residual.shape)}/{residual.dtype} on "
                         f"{residual.device}; expected x's {list(x.shape)}/{x.dtype} on {x.device}")
    check_norm_args(x, norm_weight, norm_eps, weights, biases, backend, op="add_rms_norm_dense_linear",
                    weight_scales=weight_scales, block_shape=block_shape)


@torch.library.custom_op("moefx::add_rms_norm_dense_linear", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _add_rms_norm_dense_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    backend: str,
    weight_scales: list[torch.Tensor],
    block_shape: list[int] | None,
) -> list[torch.Tensor]:
    # dense_linear's key and policy, as rms_norm_dense_linear's
    name = _chosen("add_rms_norm_dense_linear", x, weights, weight_scales, block_shape, None, backend)
    if name == GEMV and x.is_cuda and x.numel():
        return _kernel(x, weights, biases, None, weight_scales, block_shape, None, norm_weight, norm_eps, residual)
    h = residual + x  # transformers' order (the sum is the same either way)
    normed = ref_rms_norm(h, norm_weight, norm_eps, False)
    return [*RUNNERS[name](normed, weights, biases, None, weight_scales, block_shape, None), h, normed]


@_add_rms_norm_dense_linear_op.register_fake
def _(x, residual, norm_weight, norm_eps, weights, biases, backend, weight_scales, block_shape):
    check_add_norm_args(x, residual, norm_weight, norm_eps, weights, biases, backend, weight_scales, block_shape)
    return [*(x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights), torch.empty_like(x), torch.empty_like(x)]


def add_rms_norm_dense_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None = None,
    *,
    backend: str = "auto",
    weight_scales: Sequence[torch.Tensor] | None = None,
    block_shape: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """[rms_norm(h) @ w_i^T + b_i for each weight] + [h, rms_norm(h)] with h = residual + x, through
    `moefx::add_rms_norm_dense_linear` (module docstring); FP8 weight-only with weight_scales and block_shape, as
    rms_norm_dense_linear; inference only."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    scales, bs = _fp8_args(weight_scales, block_shape)
    check_add_norm_args(x, residual, norm_weight, float(norm_eps), weights, biases, backend, scales, bs)
    return torch.ops.moefx.add_rms_norm_dense_linear(x, residual, norm_weight, float(norm_eps), list(weights), biases,
                                                     backend, scales, bs)
