"""Offload plan: where expert weights live and how each M is computed, every choice with its source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moefx.env import get_setting, setting_source, settings
from moefx.facts.sizes import DTYPE_BYTES, signature_kv_bytes_per_token
from moefx.log import warn_once
from moefx.machine import free_memory
from moefx.offload.hw import host_info_from_signature

KV_RESERVE_TOKENS = 4096  # per sequence, when the config gives no prefill_token_budget


@dataclass
class OffloadPlan:
    experts: str = "gpu"
    source: str = "default"
    host: str = ""
    host_source: str = ""
    int8: bool = False
    int8_source: str = "default: float weights"
    int8_min_tokens: int = 160
    int8_impl: str = "align"
    # Streaming to the GPU from this many token rows (None = never); filled in by optimize() from the cost model.
    switch_tokens: int | None = None
    switch_source: str = "cost model, measured at optimize()"
    switch_known: bool = False  # False until pinned by env, decided by "no GPU", or computed from measured rates
    switch_pinned: bool = False
    decode_path: str = "CPU experts (below the switch point)"
    tile_e: int = 96
    tile_source: str = "default"
    notes: list[str] = field(default_factory=list)
    device_type: str = "cuda"  # where the model runs: "gpu" means "with the model" off CUDA

    def explain_lines(self) -> list[str]:
        where = self.experts
        if self.experts == "gpu" and self.device_type != "cuda":
            where = f"with the model on {self.device_type} (not offloaded)"
        lines = [f"offload experts = {where}  [{self.source}]"]
        if self.experts != "cpu":
            return lines + [f"offload note: {n}" for n in self.notes]
        lines.append(f"offload host = {self.host}  [{self.host_source}]")
        act = f"int8 activations from M >= {self.int8_min_tokens} ({self.int8_impl} tiles)" if self.int8 else "off"
        lines.append(f"offload int8 = {act}  [{self.int8_source}]")
        switch = "never (CPU for every M)" if self.switch_tokens is None else f"M >= {self.switch_tokens}"
        if not self.switch_known:
            switch = "decided at optimize() from this machine's measured rates"
        lines.append(f"offload decode path = {self.decode_path}  [{self.switch_source.split(':')[0]}]")
        lines.append(f"offload prefill streaming to GPU = {switch}  [{self.switch_source}]")
        lines.append(f"offload staging tile = {self.tile_e} experts x 2 slots  [{self.tile_source}]")
        return lines + [f"offload note: {n}" for n in self.notes]


def _estimate_bytes(ms: Any) -> tuple[int | None, int | None]:
    """(expert bytes over all layers, per-token KV bytes) from the signature; None when a fact is missing."""
    need = (ms.num_experts, ms.hidden_size, ms.moe_intermediate_size, ms.num_layers)
    width = DTYPE_BYTES.get(ms.dtype or "")
    if any(v is None for v in need) or width is None:
        return None, None
    moe_layers = ms.num_layers - (ms.first_dense_layers or 0)
    experts = moe_layers * ms.num_experts * 3 * ms.hidden_size * ms.moe_intermediate_size * width
    return experts, signature_kv_bytes_per_token(ms)


_UNSET = ": max_batch_size unset, the decode engine's memory budget bounds the rest"


def kv_reserve_sequences(cfg: Any) -> int:
    """Sequences the offload KV reserve is sized for: max_batch_size, or one when it is unset (the decode engine
    then bounds its caches by its own memory budget, SAMPLING.md)."""
    return cfg.max_batch_size or 1


def kv_reserve_tokens(cfg: Any) -> int:
    """KV tokens the offload reserve holds: `kv_reserve_sequences` x prefill_token_budget (or KV_RESERVE_TOKENS)."""
    return kv_reserve_sequences(cfg) * (cfg.prefill_token_budget or KV_RESERVE_TOKENS)


def _auto_decision(ms: Any, es: Any, cfg: Any) -> tuple[str, str]:
    if es.device_type != "cuda":
        return "gpu", f"auto: runs on {es.device_type}, experts stay with the model"
    experts, kv = _estimate_bytes(ms)
    if experts is None:
        return "gpu", "auto: model size unknown (signature lacks geometry or dtype), experts stay on the GPU"
    import torch

    if not torch.cuda.is_available():
        return "gpu", "auto: free GPU memory unknown on this machine (planning for another one); experts stay on GPU"
    free = free_memory("cuda")
    sequences = kv_reserve_sequences(cfg)
    reserve = (kv or 0) * kv_reserve_tokens(cfg)
    if experts + reserve > 0.9 * free:
        return "cpu", (f"auto: experts {experts / 2**30:.1f} GiB + KV {reserve / 2**30:.1f} GiB "
                       f"({sequences} sequences{_UNSET if cfg.max_batch_size is None else ''}) > 90% of free GPU")
    return "gpu", (f"auto: experts {experts / 2**30:.1f} GiB + KV {reserve / 2**30:.1f} GiB ({sequences} sequences"
                   f"{_UNSET if cfg.max_batch_size is None else ''}) fit in free GPU memory {free / 2**30:.1f} GiB")


def _from_cache(plan: OffloadPlan, ms: Any, es: Any, host: Any) -> None:
    """Switch point from this machine's cached rates when optimize() measured them before (no measuring here)."""
    from moefx.offload.cost import Geometry, cached_rates, key_for, switch_point

    h, i = ms.hidden_size, ms.moe_intermediate_size
    width = 1 if plan.int8 else DTYPE_BYTES.get(ms.dtype, 2)
    rates = cached_rates(key_for(es.device_name, ms.dtype, (2 * i, h), (h, i), plan.int8, host))
    if rates is None:
        return
    expert_bytes = 3 * h * i * width + (4 * (2 * i + h) if plan.int8 else 0)
    plan.switch_tokens = switch_point(Geometry(ms.num_experts, ms.top_k, h, i, expert_bytes), rates)
    plan.switch_source = f"cost model: {rates.source}"
    plan.switch_known = True


def offload_plan(ms: Any, es: Any, cfg: Any) -> OffloadPlan:
    """User config > env MOEFX_OFFLOAD_EXPERTS > default gpu; 'auto' decides from model size and free GPU memory.

    Every offload/MoE env knob that is set is validated here, offload on or off: a typo fails now, not on the
    day offload is turned on. An explicit 'gpu' for a model that is not on CUDA keeps the experts where the model
    is, with a one-time warning and a note in the plan."""
    settings()
    if cfg.offload.experts is not None:
        choice, source = cfg.offload.experts, "user config"
    else:
        choice, source = get_setting("MOEFX_OFFLOAD_EXPERTS"), setting_source("MOEFX_OFFLOAD_EXPERTS")
    asked_gpu = choice == "gpu" and source != "default"  # asked for by name, not what 'auto' decided
    if choice == "auto":
        choice, source = _auto_decision(ms, es, cfg)
    plan = OffloadPlan(experts=choice, source=source, device_type=es.device_type)
    if asked_gpu and es.device_type != "cuda":
        note = (f"offload experts 'gpu' ({source}) has no GPU to use: the model runs on {es.device_type}, so its "
                f"experts stay where the model is ('cpu' offloads the experts of a CUDA model to host memory)")
        plan.notes.append(note)
        warn_once(note)
    if choice != "cpu":
        return plan
    host = host_info_from_signature(es)
    plan.host, plan.host_source = host.describe(), host.source
    int8 = get_setting("MOEFX_OFFLOAD_INT8")
    if int8 is not None:
        plan.int8, plan.int8_source = int8, setting_source("MOEFX_OFFLOAD_INT8")
    elif ms.quant_weight_dtype == "int8":
        plan.int8, plan.int8_source = True, "weight format int8"
    plan.int8_min_tokens = get_setting("MOEFX_OFFLOAD_INT8_VNNI_MIN_TOKENS")
    from moefx.offload.cpu_experts import int8_impl

    plan.int8_impl = int8_impl(get_setting("MOEFX_OFFLOAD_INT8_ALIGN"), get_setting("MOEFX_OFFLOAD_INT8_VNNI"))
    if plan.int8 and not host.has_int8_dot:
        plan.notes.append("CPU lacks VNNI/AMX int8 dot products: the int8 path runs but without hardware int8 dots")
    if not plan.int8 and (ms.dtype == "bfloat16") and not host.has_bf16_dot:
        plan.notes.append("CPU lacks AVX512-BF16/AMX: bf16 expert GEMMs run in oneDNN's emulated bf16 (slower)")
    plan.tile_e, plan.tile_source = get_setting("MOEFX_OFFLOAD_STAGE_TILE_E"), setting_source(
        "MOEFX_OFFLOAD_STAGE_TILE_E"
    )
    pinned = get_setting("MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS")
    if es.device_type != "cuda":
        plan.switch_tokens, plan.switch_source = None, f"no GPU ({es.device_type}): nothing to stream to"
        plan.switch_known = True
    elif pinned is not None:
        plan.switch_tokens = None if pinned == 0 else pinned
        plan.switch_known = plan.switch_pinned = True
        never = " (0 = never)" if pinned == 0 else ""
        plan.switch_source = setting_source("MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS") + never
    else:
        plan.decode_path = "CPU and GPU streaming at once, split per call by the cost model"
        if ms.hidden_size and ms.moe_intermediate_size and ms.num_experts and ms.top_k and ms.dtype:
            _from_cache(plan, ms, es, host)
    if es.mode == "capture":
        plan.notes.append("mode=capture: only decode-size offloaded expert calls (queued on the stream) can be "
                          "captured; a CUDA graph holding a larger call fails when recorded, see docs/OFFLOAD.md")
    return plan
