"""The `offload` model transform: expert weights to host memory, the experts' forward swapped for ours.

Routing, attention, norms and everything else stay where they are; only `experts(hidden, top_k_index,
top_k_weights)` (the transformers 5 experts contract) runs here. Below the switch point each call is split by
the cost model between the CPU and experts streamed through the GPU staging ring (CPU only without a GPU or
when the switch is pinned); from the switch point every routed expert is streamed.

Streamed tiles are computed on the GPU by a MoE backend, which the caller hands in (`backends`: moefx's
`BACKENDS`, from `moefx.optimize`): the CPU backend (`moefx/backends/cpu.py`) computes with this package's host
experts, so this package sits below the backends and names none of them itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from moefx.facts.sizes import config_kv_shape, kv_bytes_per_token
from moefx.facts.weights import is_stacked_experts
from moefx.log import get_logger
from moefx.machine import free_memory
from moefx.offload import cpu_kernel
from moefx.offload.cost import (
    Geometry,
    MachineRates,
    cpu_seconds,
    machine_rates,
    measure_stream_overhead,
    median_seconds,
    modelled_seconds,
    split_experts,
    switch_point,
)
from moefx.offload.cpu_experts import KERNEL_MAX_ROWS_PER_EXPERT, CpuMath, ExpertPool, ExpertStore, cpu_moe, route
from moefx.offload.gpu_budget import plan_gpu_memory
from moefx.offload.hw import host_info
from moefx.offload.placement import to_host
from moefx.offload.plan import kv_reserve_tokens
from moefx.offload.staging import StagingRing
from moefx.offload.stream_host import StreamHost, build_stream_host

log = get_logger("moefx.offload")

DECODE_POOL_MAX_TOKENS = 32  # up to this many rows the tuned multi-worker pool runs; above, one worker per node


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules that hold transformers-5 style stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    return [(name, mod) for name, mod in model.named_modules() if is_stacked_experts(mod)]


def unsupported_reason(mod: torch.nn.Module) -> str | None:
    """None when the module matches the layout and math our expert path computes; else why it is left alone."""
    if getattr(mod, "has_bias", False):
        return "experts have biases"
    if getattr(mod, "is_transposed", False) or not getattr(mod, "is_concatenated", True):
        return "experts weights are transposed or interleaved"
    if not getattr(mod, "has_gate", True):
        return "experts have no gate projection"
    act = getattr(mod, "act_fn", None)
    if not _is_silu(act):
        return f"activation {type(act).__name__} is not SiLU"
    e, two_i, h = mod.gate_up_proj.shape
    if tuple(mod.down_proj.shape) != (e, h, two_i // 2) or two_i % 2:
        return f"shapes {tuple(mod.gate_up_proj.shape)} / {tuple(mod.down_proj.shape)} are not [E,2I,H] / [E,H,I]"
    return None


def _is_silu(act: Any) -> bool:
    """transformers' SiLUActivation or torch's SiLU, checked on a probe so a look-alike name cannot pass."""
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        return False
    probe = torch.linspace(-6, 6, 25)
    return bool(torch.allclose(act(probe), torch.nn.functional.silu(probe)))


# MoE backends by name, each called as fn(hidden, topk_ids, topk_weights, w13, w2)
TileBackends = Mapping[str, Callable[..., torch.Tensor]]


def pick_tile_backend(backends: TileBackends) -> str:
    """MoE backend that computes streamed tiles on the GPU: MOEFX_MOE_BACKEND if it names a GPU backend, else
    `grouped` when registered, else `reference`."""
    from moefx.env import get_setting

    forced = get_setting("MOEFX_MOE_BACKEND")
    if forced in backends and forced != "cpu":
        return forced
    return "grouped" if "grouped" in backends else "reference"


def validated_tile_backend(store: ExpertStore, device: torch.device, dtype: torch.dtype,
                           backends: TileBackends) -> tuple[str, str]:
    """(backend, note): the picked tile backend if it matches `reference` on a small slice of this layer, else
    `reference`."""
    from moefx.kernels.moe_call import MoeCall

    name = pick_tile_backend(backends)
    if name == "reference":
        return name, "reference (oracle)"
    n = min(4, store.num_experts)
    w13 = store.w13[:n].to(device)
    w2 = store.w2[:n].to(device)
    if store.int8:
        w13 = w13.to(dtype) * store.w13_scale[:n, :, None].to(device, dtype)
        w2 = w2.to(dtype) * store.w2_scale[:n, :, None].to(device, dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, w13.shape[2], generator=gen).to(device, dtype)
    ids = torch.randint(0, n, (16, 1), generator=gen).to(device)
    wts = torch.rand(16, 1, generator=gen).to(device)
    call = MoeCall(x, ids, wts, w13, w2)
    try:
        ref = backends["reference"].apply(call).float()
        out = backends[name].apply(call).float()
        err = ((out - ref).norm() / ref.norm()).item()
    except Exception as exc:  # a backend that cannot run these tiles is not used for them
        return "reference", f"reference ({name} failed on a tile check: {type(exc).__name__}: {exc})"
    bound = 1e-5 if dtype == torch.float32 else 2e-2  # an fp32 model must not lose precision (e.g. to TF32)
    if not err <= bound:
        return "reference", f"reference ({name} off by {err:.2e} > {bound:.0e} on a tile check)"
    return name, f"{name} (checked against reference on this layer: {err:.1e})"


class OffloadRuntime:
    """State shared by every offloaded layer of one model: CPU pools, the GPU staging ring, the switch point."""

    def __init__(self, device: torch.device, dtype: torch.dtype, math_int8: bool, min_tokens: int, impl: str,
                 backends: TileBackends) -> None:
        self.device = device
        self.backends = backends
        self.dtype = dtype
        self.host = host_info()
        self.int8_activations = math_int8
        self.min_tokens = min_tokens
        self.impl = impl
        self.decode_pool = ExpertPool(self.host, 1)
        self.large_pool = self.decode_pool
        self.ring: StagingRing | None = None
        self.switch_tokens: int | None = None
        self.rates: MachineRates | None = None
        self.geom: Geometry | None = None
        self.tile_backend = "reference"
        self.prefetch_bytes = 0  # host kernel prefetch distance, measured with the machine rates
        self.split_min_tokens = 1  # below this M a call never splits (measured end to end: `measure_split_start`)
        self.stream_host: StreamHost | None = None  # CPU-only calls queued on the GPU stream (no sync per layer)

    def math(self, m: int) -> CpuMath:
        return CpuMath(self.int8_activations and m >= self.min_tokens, self.impl, prefetch_bytes=self.prefetch_bytes)

    def set_decode_workers(self, workers: int) -> None:
        if workers != self.decode_pool.workers_per_node:
            self.decode_pool = ExpertPool(self.host, workers)

    def tile_compute(self, x, ids, weights, w13, w2) -> torch.Tensor:
        from moefx.kernels.moe_call import MoeCall

        return self.backends[self.tile_backend].apply(MoeCall(x, ids, weights, w13, w2))


class OffloadedExperts:
    """The replacement forward of one experts module."""

    def __init__(self, store: ExpertStore, runtime: OffloadRuntime) -> None:
        self.store = store
        self.rt = runtime

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        return self.collect(self.launch(hidden_states, top_k_index, top_k_weights))

    def streamed(self, m: int) -> bool:
        rt = self.rt
        return rt.ring is not None and rt.switch_tokens is not None and m >= rt.switch_tokens

    def cpu_only(self, m: int) -> bool:
        rt = self.rt
        return not self.streamed(m) and (rt.ring is None or rt.rates is None or m < rt.split_min_tokens)

    def queue_reason(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                     ) -> str | None:
        """Why this call is not queued on the stream (None: the stream host takes it)."""
        rt, m = self.rt, hidden_states.shape[0]
        if rt.stream_host is None or hidden_states.device.type != "cuda":
            return "no stream host (see the plan)"
        if not self.cpu_only(m):
            return f"{m} rows stream experts to the GPU"
        if rt.math(m).int8_activations:
            return "INT8 activation path"
        return rt.stream_host.unsupported(self.store, hidden_states, top_k_index, top_k_weights)

    def launch(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> dict:
        """Queue the call without waiting for the GPU. Decode sizes are queued whole on the stream (`stream_host`).
        Otherwise the device-to-host copies of the inputs are queued; GPU work queued after this and before
        `collect` (e.g. shared experts) runs while the host computes its experts."""
        call = {"args": (hidden_states, top_k_index, top_k_weights), "event": None}
        reason = self.queue_reason(hidden_states, top_k_index, top_k_weights)
        if reason is None:
            call["out"] = self.rt.stream_host(self.store, hidden_states, top_k_index, top_k_weights)
            return call
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"moefx offload: this experts call ({hidden_states.shape[0]} rows) cannot be captured "
                               f"in a CUDA graph: {reason}; only calls queued on the stream can")
        if hidden_states.device.type == "cpu" or self.streamed(hidden_states.shape[0]):
            call["host"] = (hidden_states, top_k_index, top_k_weights)
            return call
        call["host"] = tuple(_pinned_copy(t) for t in (hidden_states, top_k_index, top_k_weights))
        call["event"] = torch.cuda.Event()
        call["event"].record(torch.cuda.current_stream(hidden_states.device))
        return call

    def collect(self, call: dict) -> torch.Tensor:
        """The expert sum for a launched call, on the inputs' device and dtype."""
        if "out" in call:
            return call["out"]
        rt = self.rt
        hidden_states, top_k_index, top_k_weights = call["args"]
        m = hidden_states.shape[0]
        if self.streamed(m):
            return rt.ring.run(self.store, hidden_states, top_k_index, top_k_weights, rt.tile_compute)
        pool = rt.decode_pool if m <= DECODE_POOL_MAX_TOKENS else rt.large_pool
        device = hidden_states.device
        x, ids, w = call["host"]
        if call["event"] is not None:
            call["event"].synchronize()
        if self.cpu_only(m):
            return _to_device(cpu_moe(self.store, x, ids, w, pool, rt.math(m)), device)
        routed = route(ids, self.store.num_experts)
        on_gpu, _ = split_experts([float(c) for c in routed[2]], m, rt.geom, rt.rates)
        gpu_experts = [e for e, g in zip(routed[1], on_gpu, strict=True) if g]
        job = rt.ring.start(self.store, hidden_states, top_k_index, top_k_weights, routed, gpu_experts)
        # The host computes its share while the GPU's share is still being copied over PCIe.
        cpu_part = set(routed[1]) - set(gpu_experts)
        out = _to_device(cpu_moe(self.store, x, ids, w, pool, rt.math(m), routed, cpu_part, torch.float32), device)
        out += rt.ring.finish(job, rt.tile_compute)
        return out.to(hidden_states.dtype)


_LAYERS: list[weakref.ref] = []  # op argument `layer` -> that layer's OffloadedExperts


@torch.library.custom_op("moefx::offloaded_experts", mutates_args=())
def offloaded_experts_op(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, layer: int
) -> torch.Tensor:
    """One offloaded layer's expert sum. An opaque op to torch.compile, so a compiled model stays one graph
    (no graph break per layer) and the host-side work runs where the call sits in it."""
    experts = _LAYERS[layer]()
    if experts is None:
        raise RuntimeError(f"moefx offload: layer handle {layer} outlived its model")
    return experts(hidden_states, top_k_index, top_k_weights)


@offloaded_experts_op.register_fake
def _(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(hidden_states)


def op_forward(experts: OffloadedExperts):
    """The experts module's new forward: the custom op bound to this layer's handle."""
    layer = len(_LAYERS)
    _LAYERS.append(weakref.ref(experts))

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return offloaded_experts_op(hidden_states, top_k_index, top_k_weights, layer)

    return forward


def shared_overlap_forward(block: torch.nn.Module):
    """Forward for a DeepSeek-V3-style MoE block (gate, experts, shared_experts; out = experts + shared) that queues
    the shared experts on the GPU between the experts' launch and collect, so they overlap the host's work."""
    experts: OffloadedExperts = block.experts.moefx_offload

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        residuals = hidden_states
        orig_shape = hidden_states.shape
        _, topk_weights, topk_indices = block.gate(hidden_states)
        flat = hidden_states.view(-1, hidden_states.shape[-1])
        call = experts.launch(flat, topk_indices, topk_weights)
        shared = block.shared_experts(residuals)
        return experts.collect(call).view(*orig_shape) + shared

    return torch.compiler.disable(forward)


# MoE blocks whose forward is exactly `experts(gate(x)) + shared_experts(x)` (checked in tests vs the original).
SHARED_OVERLAP_BLOCKS = ("DeepseekV3MoE",)


def _to_device(y: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return y
    y_pinned = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
    y_pinned.copy_(y)
    return y_pinned.to(device, non_blocking=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _model_device_dtype(model: torch.nn.Module, skip: set[int]) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        if id(p) not in skip:
            return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def _kv_reserve(model: torch.nn.Module, cfg: Any, width: int) -> int:
    """Bytes the KV pool reserves first: `kv_reserve_tokens` of the model's KV bytes per token (0 when its config
    does not state the attention geometry)."""
    conf = getattr(model, "config", None)
    per_token = kv_bytes_per_token(*config_kv_shape(conf), width) if conf is not None else None
    return kv_reserve_tokens(cfg) * (per_token or 0)


def _expert_bytes(mod: torch.nn.Module, int8: bool) -> int:
    _, two_i, h = mod.gate_up_proj.shape
    if int8:
        return 3 * (two_i // 2) * h + 4 * (two_i + h)
    return 3 * (two_i // 2) * h * mod.gate_up_proj.element_size()


def apply_offload(model: torch.nn.Module, plan: Any, cfg: Any, backends: TileBackends) -> list[str]:
    """Move experts to host memory and swap their forward, when the plan says experts = cpu; streamed tiles run on
    `backends`."""
    op = plan.offload
    if op is None or op.experts != "cpu":
        return []
    found = experts_modules(model)
    skip_ids = {id(p) for _, m in found for p in (m.gate_up_proj, m.down_proj)}
    device, dtype = _model_device_dtype(model, skip_ids)
    applied, usable = _usable(found)
    if not usable:
        op.notes.append("no transformers-style experts module found; nothing offloaded")
        return applied + ["no experts offloaded"]
    cuda = device.type == "cuda"
    budget = None
    if cuda and (not op.switch_pinned or op.switch_tokens is not None):
        # The fixed GPU memory priority is checked before the model is touched: KV pool first, then the ring.
        expert_bytes = _expert_bytes(usable[0], op.int8)
        staging = 2 * min(op.tile_e, usable[0].gate_up_proj.shape[0]) * expert_bytes
        free = free_memory(device)
        kv = _kv_reserve(model, cfg, dtype.itemsize)
        budget = plan_gpu_memory(free, kv, staging, tile_e=op.tile_e, expert_bytes=expert_bytes)
    rt = OffloadRuntime(device, dtype, op.int8, op.int8_min_tokens, op.int8_impl, backends)
    holding = ""
    for mod in usable:
        store, holding = _offload_module(mod, op.int8, rt.host, pin=cuda)
        mod.moefx_offload = OffloadedExperts(store, rt)
        mod.forward = op_forward(mod.moefx_offload)
    applied.extend(_rewire_shared_blocks(model))
    first = usable[0].moefx_offload.store
    top_k = _top_k(model, first)
    rt.geom = Geometry(first.num_experts, top_k, first.w13.shape[2], first.w2.shape[2], first.expert_bytes)
    rates = machine_rates(first, dtype, device, rt.host, top_k)
    rt.set_decode_workers(rates.decode_workers)
    rt.prefetch_bytes = rates.prefetch_bytes
    if cuda:
        op.notes.append(_queue_decode(usable[0].moefx_offload, dtype, top_k))
    cost_model = cuda and not op.switch_pinned
    if budget is not None and (cost_model or op.switch_tokens is not None):
        rt.ring = StagingRing(first, op.tile_e, device)
        rt.tile_backend, how = validated_tile_backend(first, device, dtype, backends)
        if cost_model:  # the fixed cost of a call that streams anything, with this ring and tile backend
            rates = replace(rates, stream_overhead_s=measure_stream_overhead(rt.ring, first, dtype, rates,
                                                                             rt.tile_compute))
            rt.rates = rates
        op.notes.append(budget.explain_line())
        op.notes.append(f"streamed tiles computed by MoE backend {how}")
    if rt.rates is not None:
        rt.split_min_tokens, how = measure_split_start(usable[0].moefx_offload, top_k)
        op.notes.append(how)
    if cost_model:
        _record_cost_model(op, rt.geom, rates, rt.split_min_tokens)
    rt.switch_tokens = op.switch_tokens if cuda else None
    op.notes.append(f"CPU expert pool: decode {rt.decode_pool.describe()}; large M {rt.large_pool.describe()}")
    op.notes.append(_host_kernel_note(first, dtype))
    applied.append(f"{len(usable)} experts modules offloaded ({holding}); {first.expert_bytes} bytes per expert")
    log.info("offload: %s", "; ".join(applied))
    return applied


def _queue_decode(experts: OffloadedExperts, dtype: torch.dtype, top_k: int) -> str:
    """Set up the stream host for decode-size calls, with its thread count measured; the plan line says how."""
    rt = experts.rt
    threads = torch.get_num_threads()
    rt.stream_host, why = build_stream_host(experts.store, dtype, top_k, DECODE_POOL_MAX_TOKENS, threads,
                                            rt.prefetch_bytes, rt.host.numa_nodes)
    if rt.stream_host is None:
        return f"decode calls sync with the GPU at every layer (not queued on the stream: {why})"
    threads, shown = measure_queue_threads(experts, top_k)
    rt.stream_host.set_threads(threads)
    return (f"decode calls (up to {DECODE_POOL_MAX_TOKENS} rows, CPU alone) queued on the GPU stream as host "
            f"functions, no sync per layer; host kernel threads {rt.stream_host.threads} (measured ms at M=1: "
            f"{shown})")


@torch.no_grad()
def measure_queue_threads(experts: OffloadedExperts, top_k: int) -> tuple[int, str]:
    """All of torch's threads or one fewer for the queued host kernel: the Python thread keeps running (queueing
    the next layers) while the kernel does, and an OpenMP team one thread short of cores can win."""
    rt = experts.rt
    e, h = experts.store.num_experts, experts.store.w13.shape[2]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, h, generator=gen).to(rt.device, rt.dtype)
    ids = torch.randperm(e, generator=gen)[:top_k].view(1, -1).to(rt.device)
    w = torch.full(ids.shape, 1.0 / ids.shape[1], device=rt.device)
    full = torch.get_num_threads()
    times = {}
    for threads in sorted({full, max(1, full - 1)}, reverse=True):
        rt.stream_host.set_threads(threads)
        times[threads] = _median_call_seconds(experts, (x, ids, w), rt.device, reps=9)
    best = min(times, key=times.get)
    return best, ", ".join(f"{t} threads {s * 1e3:.2f}" for t, s in times.items())


SPLIT_PROBE_TOKENS = (1, 2, 4, 8, 16, 32)


@torch.no_grad()
def measure_split_start(experts: OffloadedExperts, top_k: int) -> tuple[int, str]:
    """Smallest probed M from which the cost model's CPU/GPU split beats the CPU alone, timed end to end on this
    layer (uniform random routing, median of 5). At decode sizes both sides read the same DRAM and the split
    pays fixed host time, which the model can only estimate; a measurement settles it. Above the probes the
    model decides."""
    rt = experts.rt
    e, h = experts.store.num_experts, experts.store.w13.shape[2]
    gen = torch.Generator().manual_seed(2)
    saved = rt.split_min_tokens
    times = {}
    try:
        for m in SPLIT_PROBE_TOKENS:
            x = torch.randn(m, h, generator=gen).to(rt.device, rt.dtype)
            ids = torch.rand(m, e, generator=gen).topk(min(top_k, e), dim=-1).indices.to(rt.device)
            w = torch.full(ids.shape, 1.0 / ids.shape[1], device=rt.device)
            for label, start in (("cpu", m + 1), ("split", 1)):
                rt.split_min_tokens = start
                times[(m, label)] = _median_call_seconds(experts, (x, ids, w), rt.device)
    finally:
        rt.split_min_tokens = saved
    start = SPLIT_PROBE_TOKENS[-1] * 2
    for m in reversed(SPLIT_PROBE_TOKENS):
        if times[(m, "split")] > 0.95 * times[(m, "cpu")]:
            break
        start = m
    shown = ", ".join(f"M={m}: {times[(m, 'cpu')] * 1e3:.2f}/{times[(m, 'split')] * 1e3:.2f}"
                      for m in SPLIT_PROBE_TOKENS)
    return start, f"CPU alone below M={start}, split from there (measured ms CPU alone/split: {shown})"


def _median_call_seconds(fn, args: tuple, device: torch.device, reps: int = 5) -> float:
    """Median seconds of `fn(*args)` to the end of its GPU work (each call syncs, so the next starts on an idle
    stream)."""

    def call() -> None:
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return median_seconds(call, reps)


def _host_kernel_note(store: ExpertStore, dtype: torch.dtype) -> str:
    reason = cpu_kernel.unsupported(store.w13.dtype, dtype)
    if reason is None:
        return (f"CPU experts at small M (<= {KERNEL_MAX_ROWS_PER_EXPERT} rows per expert): moefx host kernel, "
                f"{cpu_kernel.kernel().detail}")
    return f"CPU experts: torch ops only (host kernel not used: {reason})"


def _usable(found: list[tuple[str, torch.nn.Module]]) -> tuple[list[str], list[torch.nn.Module]]:
    """Modules our path computes, all with the first one's shapes (the staging ring is sized once)."""
    applied, usable = [], []
    for name, mod in found:
        reason = unsupported_reason(mod)
        if reason is None and usable and (
            mod.gate_up_proj.shape != usable[0].gate_up_proj.shape or mod.down_proj.shape != usable[0].down_proj.shape
        ):
            reason = "expert shapes differ from the first offloaded layer"
        if reason:
            applied.append(f"left {name} on its device: {reason}")
        else:
            usable.append(mod)
    return applied, usable


def _rewire_shared_blocks(model: torch.nn.Module) -> list[str]:
    overlapped = 0
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if type(block).__name__ in SHARED_OVERLAP_BLOCKS and hasattr(experts, "moefx_offload"):
            block.forward = shared_overlap_forward(block)
            overlapped += 1
    return [f"{overlapped} MoE blocks queue their shared experts on the GPU while the host computes"] if (
        overlapped) else []


def _record_cost_model(op: Any, geom: Geometry, rates: MachineRates, split_start: int = 1) -> None:
    op.switch_tokens = switch_point(geom, rates)
    op.switch_known = True
    op.switch_source = (
        f"cost model: CPU {rates.cpu_gbps:.1f} GB/s, {rates.cpu_tflops:.2f} TFLOP/s; "
        f"H2D {rates.h2d_gbps:.1f} GB/s; both at once {rates.shared_gbps or float('nan'):.1f} GB/s; "
        f"GPU {rates.gpu_tflops:.0f} TFLOP/s; {rates.stream_overhead_s * 1e3:.2f} ms per streaming call; "
        f"host kernel prefetch {rates.prefetch_bytes} B [{rates.source}]"
    )
    shares = ", ".join(f"M={m}: {modelled_seconds(m, geom, rates)[1]:.0%}" for m in (1, 4, 64, 512, 2048)
                       if m >= split_start)
    if split_start > 1:
        op.decode_path = (f"CPU alone below M={split_start} (measured), then CPU and GPU streaming at once, split "
                          f"per call by the cost model (GPU share {shares})")
        return
    gain = cpu_seconds(1, geom, rates) / modelled_seconds(1, geom, rates)[0]
    op.decode_path = (f"CPU and GPU streaming at once, split per call by the cost model (GPU share {shares}; "
                      f"modelled {gain:.2f}x CPU-only at M=1)")


def _top_k(model: torch.nn.Module, store: ExpertStore) -> int:
    conf = getattr(model, "config", None)
    k = getattr(conf, "num_experts_per_tok", None) if conf is not None else None
    return int(k) if k else min(8, store.num_experts)


def _offload_module(mod: torch.nn.Module, int8: bool, host: Any, pin: bool) -> tuple[ExpertStore, str]:
    w13, w2 = mod.gate_up_proj.detach(), mod.down_proj.detach()
    del mod.gate_up_proj
    del mod.down_proj
    store = ExpertStore.from_weights(w13, w2, int8=int8)  # quantized where the weights are (fast on a GPU)
    del w13, w2
    held = []
    tensors = {}
    for field in ("w13", "w2", "w13_scale", "w2_scale"):
        t = getattr(store, field)
        if t is not None:
            tensors[field], how = to_host(t, host, pin)
            held.append(how)
    return ExpertStore(**tensors), held[0]
