"""`moefx::moe_experts`: one custom op that picks its backend per call from M (token rows of the call).

The choice is made inside the op, at run time, from shapes only, so a compiled graph holds a single
`moefx::moe_experts` node whatever M is (also a symbolic M) and a captured CUDA graph never switches
backend on data. `backend` is "auto" (environment override, else the exact calibration row, else
upstream), a backend name (forced; still subject to the backend's own support check) or a policy spec
from a plan ("eager=gemv@1-16,grouped@17-;capture=..."). `upstream` names the plain path: "reference"
(the reference loop) for direct calls, "transformers" (transformers' own grouped_mm experts path) for
HF experts modules. `activation` names the gate activation (moefx/kernels/activation.py: silu, gelu, gelu_tanh);
`gate_limit` (None: off) clamps gate and up before it (the clamped SwiGLU of DeepSeek-V4, GLM-5-Next, HY-V4).
The op is differentiable (`torch.library.register_autograd`, formula and paths in backward.py): gradients for
hidden, topk_weights and unquantized w13 / w2, whichever backend ran the forward; under `torch.compile` the
backward graph holds one `moefx::moe_experts_backward` node per op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moefx.backends import backward as _backward
from moefx.backends import calibration
from moefx.backends.calibration import find_row, key_for_tensors
from moefx.backends.capture_mode import decides_as_captured
from moefx.backends.policy import (
    HOST_SYNCING_BACKENDS,
    UPSTREAM,
    MoePolicy,
    env_override,
    env_token,
    is_policy_spec,
    parse_policy_spec,
)
from moefx.backends.registry import BACKENDS, MoeCall
from moefx.config import MOE_BACKEND_ALIASES
from moefx.kernels.activation import check_limit, gate_up, get_activation
from moefx.kernels.memo import ShapeMemo, tensor_meta
from moefx.log import get_logger, warn_once

log = get_logger("moefx.backends")
UPSTREAMS = ("reference", "transformers")


def _named(backend: str) -> str:
    """A backend's name for one of its aliases (config.MOE_BACKEND_ALIASES: `legacy` is `reference`)."""
    return MOE_BACKEND_ALIASES.get(backend, backend)


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Registered backends that run on `device` (default: CUDA when present, else CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return sorted(name for name, b in BACKENDS.items() if dev.type in b.devices)


def _validate_backend_arg(
    backend: str, upstream: str, activation: str = "silu", gate_limit: float | None = None
) -> None:
    get_activation(activation)
    check_limit(gate_limit)
    backend, upstream = _named(backend), _named(upstream)
    if upstream not in UPSTREAMS:
        raise ValueError(f"moe_experts upstream={upstream!r} is invalid; valid choices: {list(UPSTREAMS)}")
    if backend in ("auto", UPSTREAM) or backend in BACKENDS:
        return
    if is_policy_spec(backend):
        parse_policy_spec.__wrapped__(backend)  # uncached: this also runs while dynamo traces
        return
    raise ValueError(
        f"moe_experts backend={backend!r} is invalid; valid choices: {['auto', UPSTREAM, *sorted(BACKENDS)]} "
        f"or a policy spec like 'eager=gemv@1-16,grouped@17-;capture=grouped@1-'"
    )


def _requested(m: int, backend: str, key_args: tuple, capturing: bool) -> tuple[str, str]:
    """(backend name or 'upstream', where the choice came from) for one call."""
    mode = "capture" if capturing else "eager"
    if backend != "auto":
        if is_policy_spec(backend):
            return parse_policy_spec(backend)[mode].backend_for(m), f"plan policy ({mode})"
        return backend, "forced by the caller"
    env = env_override()
    if env.forced:
        return env.forced, env.source
    row = find_row(key_for_tensors(*key_args, mode))
    if row is None:
        return UPSTREAM, f"no calibration row ({mode})"
    pol = MoePolicy(row.ranges, row.source).without(env.disabled, "backend switch")
    return pol.backend_for(m), row.source


_DECISIONS = ShapeMemo()


def select_backend(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    block_shape: Sequence[int] | None = None,
    backend: str = "auto",
    upstream: str = "reference",
    capturing: bool | None = None,
    activation: str = "silu",
    gate_limit: float | None = None,
) -> str:
    """The backend one call runs: the policy's choice for M, or the plain path with a one-time warning why.

    `capturing` None reads the capture rows on a capturing stream or under `as_captured()` (capture_mode.py);
    True/False asks what would run. The choice reads only the key below (shapes, strides, dtypes, devices, the
    arguments, the MoE env knobs' raw values, the calibration tables' generation and, for CPU rows, the thread
    count), so it is made once per key (memo.py).
    """
    backend, upstream = _named(backend), _named(upstream)
    explicit = capturing is not None
    if capturing is None:
        capturing = decides_as_captured(hidden)
    bs = tuple(block_shape) if block_shape is not None else None
    args = (hidden, topk_ids, w13, w2, w13_scale, bs, backend, upstream, capturing, activation, gate_limit)
    if torch.compiler.is_compiling():  # traced (vLLM's compiled forward calls this): shapes may be symbolic
        found = _decide(*args)
    else:
        key = (tensor_meta(hidden), topk_ids.shape, tensor_meta(w13), tensor_meta(w2), w13_scale is None, bs,
               backend, upstream, capturing, activation, gate_limit, env_token(), calibration._generation,
               torch.get_num_threads())
        found = _DECISIONS.get(key)
        if found is None or BACKENDS.get(found[2]) is not found[3]:  # the requested backend (un)registered since
            found = _DECISIONS.put(key, _decide(*args))
    name, warning, _, _ = found
    if warning:
        warn_once(warning)  # once per process, as on the call that decided
    # Only a real capture refuses a host-syncing backend; a direct call under as_captured() runs it.
    in_capture = capturing if explicit else hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    if in_capture and name in HOST_SYNCING_BACKENDS:
        raise RuntimeError(
            f"moefx::moe_experts: backend {name!r} syncs the host and cannot run inside CUDA-graph capture; "
            f"calibrate a capture row (`moefx calibrate --modes capture`) or force a capture-safe backend"
        )
    return name


def _decide(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    bs: tuple[int, ...] | None,
    backend: str,
    upstream: str,
    capturing: bool,
    activation: str,
    gate_limit: float | None,
) -> tuple[str, str | None, str, object]:
    """(backend name, the warning that says why it is the plain path or None, the backend asked for and its
    registered object, None when it is not registered: a decision is stale once that changes)."""
    # transformers' FP8 experts path lives on its module (and needs its hub kernels): FP8 runs the oracle.
    plain = "reference" if upstream == "transformers" and w13_scale is not None else upstream
    key_args = (hidden, topk_ids, w13, bs)
    name, source = _requested(int(hidden.shape[0]), backend, key_args, capturing)
    requested, warning = name, None
    if name == UPSTREAM:
        name = plain
    elif name not in BACKENDS:
        warning = f"MoE backend {name!r} (from {source}) is not registered here; running {plain}"
        name = plain
    else:
        reason = BACKENDS[name].unsupported_reason(MoeCall.unrouted(hidden, w13, w2, w13_scale, bs, activation,
                                                                   gate_limit))
        if reason:
            warning = f"MoE backend {name!r} (from {source}) cannot run these inputs: {reason}; running {plain}"
            name = plain
    return name, warning, requested, BACKENDS.get(requested)


class _UpstreamExperts:
    """The attributes transformers' experts forwards read, over the op's [E, 2I, H] / [E, H, I] weights."""

    has_gate, has_bias, is_transposed = True, False, False

    def __getattr__(self, name: str) -> bool:
        # Feature flags that newer transformers versions read (`has_post_expert_norm`, `_is_expert_parallel`, ...):
        # the op's plain [E, 2I, H] / [E, H, I] layout has none of those features.
        if name.startswith(("has_", "_is_")):
            return False
        raise AttributeError(name)

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, activation: str, gate_limit: float | None):
        self.num_experts, self.gate_up_proj, self.down_proj = w13.shape[0], w13, w2
        self.activation, self.gate_limit = activation, gate_limit

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_out.chunk(2, dim=-1)
        return gate_up(gate, up, self.activation, self.gate_limit)


def _transformers_upstream(call: MoeCall) -> torch.Tensor:
    """transformers' default experts path (grouped_mm) on the op's layout: the plain path for HF models."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    experts = _UpstreamExperts(call.w13, call.w2, call.activation, call.gate_limit)
    return grouped_mm_experts_forward(experts, call.hidden, call.topk_ids, call.topk_weights)


# flexible_layout: inductor hands over its buffers as they are (the backends make `hidden` contiguous). Under the
# default exact-strides constraint it copies an input it has not stored yet once per op reading it: the router's
# and the experts' input, one post-attention norm, was computed twice per layer (docs/FINDINGS.md).
@torch.library.custom_op("moefx::moe_experts", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def _moe_experts_op(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: list[int] | None = None,
    backend: str = "auto",
    upstream: str = "reference",
    activation: str = "silu",
    gate_limit: float | None = None,
) -> torch.Tensor:
    return _run((hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, block_shape, backend, upstream,
                 activation, gate_limit))


def _run(args: tuple, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Both ops' body over moefx::moe_experts' arguments: the experts' sum in hidden's dtype, plus `residual` when
    given (added by the backend where it can, else by one add here; either way rounded as a separate add would)."""
    hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, block_shape, backend, upstream, activation, \
        gate_limit = args
    if hidden.shape[0] == 0:
        out = hidden.new_zeros(0, w2.shape[1])
        return out if residual is None else residual + out
    bs = tuple(block_shape) if block_shape is not None else None
    call = MoeCall(hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, bs, activation, gate_limit)
    name = select_backend(hidden, topk_ids, w13, w2, w13_scale, bs, backend, upstream, activation=activation,
                          gate_limit=gate_limit)
    log.debug("moe_experts M=%d -> %s", hidden.shape[0], name)
    if name == "transformers":
        out = _transformers_upstream(call)
        return out if residual is None else residual + out
    return BACKENDS[name].apply(call, residual)


@_moe_experts_op.register_fake
def _(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
      *args: object, **kwargs: object) -> torch.Tensor:
    return hidden.new_empty(hidden.shape[0], w2.shape[1])


_moe_experts_op.register_autograd(_backward.backward, setup_context=_backward.setup_context)


# `moefx::moe_experts_residual(Tensor residual, <moefx::moe_experts' arguments>) -> Tensor`: residual [M, H] +
# moe_experts(...), what the `fuse_moe_residual` pass emits for a decoder layer's last residual add. Bit for bit the
# two ops; one launch fewer where the backend adds in its epilogue (gemv). Inference only (no autograd).
_LIB = torch.library.Library("moefx", "FRAGMENT")  # other moefx files define more ops in the same namespace
_LIB.define(str(_moe_experts_op._opoverload._schema).replace("moefx::moe_experts(", "moe_experts_residual(Tensor "
                                                             "residual, ", 1), tags=(torch.Tag.flexible_layout,))


_MOE_ARGS = _moe_experts_op._opoverload._schema.arguments


@torch.library.impl(_LIB, "moe_experts_residual", "CompositeExplicitAutograd")
def _moe_experts_residual(residual: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    rest = tuple(kwargs.get(a.name, a.default_value) for a in _MOE_ARGS[len(args):])  # the dispatcher leaves them out
    return _run((*args, *rest), residual)


@torch.library.register_fake("moefx::moe_experts_residual", lib=_LIB)
def _(residual: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


def moe_experts(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    backend: str = "auto",
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: Sequence[int] | None = None,
    upstream: str = "reference",
    activation: str = "silu",
    gate_limit: float | None = None,
) -> torch.Tensor:
    """Routed experts: sum_j w[m, j] * down(act(gate(x_m)) * up(x_m)) over experts topk_ids[m, j].

    Shapes and the FP8 block convention are the `MoEBackend` contract (moefx/backends/registry.py); `activation` is
    a name in moefx/kernels/activation.py, `gate_limit` the clamped-SwiGLU limit. Differentiable (backward.py).
    """
    _validate_backend_arg(backend, upstream, activation, gate_limit)
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"moe_experts shapes: hidden [M, H], topk_ids/topk_weights [M, k], w13 [E, 2I, H], w2 [E, H, I]; got "
            f"{tuple(hidden.shape)}, {tuple(topk_ids.shape)}/{tuple(topk_weights.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    if (w13_scale is None) != (block_shape is None) or (w13_scale is None) != (w2_scale is None):
        raise ValueError("moe_experts: FP8 weights need w13_scale, w2_scale and block_shape together")
    bs = [int(b) for b in block_shape] if block_shape is not None else None
    return torch.ops.moefx.moe_experts(
        hidden, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, bs, backend, upstream, activation,
        None if gate_limit is None else float(gate_limit),
    )
