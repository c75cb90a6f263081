"""GPU memory priority with experts offloaded (docs/OFFLOAD.md, "GPU memory priority"), fixed: KV pool -> prefill
staging -> activation workspace.

Each consumer gets its bytes only from what the ones before it left. The KV pool and the staging ring are
requirements (a clear error names the knob when they do not fit); the activation workspace takes what is left.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIORITY = ("kv_pool", "prefill_staging", "activation_workspace")

_GIB = float(1 << 30)


@dataclass(frozen=True)
class GpuMemoryBudget:
    free: int
    kv_pool: int
    prefill_staging: int
    activation_workspace: int

    def explain_line(self) -> str:
        parts = " -> ".join(f"{name} {getattr(self, name) / _GIB:.2f} GiB" for name in PRIORITY)
        return f"offload gpu memory (priority order) = {parts} of {self.free / _GIB:.2f} GiB free"


def plan_gpu_memory(
    free: int, kv_pool: int, staging: int, tile_e: int | None = None, expert_bytes: int | None = None
) -> GpuMemoryBudget:
    """Split `free` GPU bytes in priority order; ValueError naming the knob when KV or staging cannot fit."""
    if kv_pool > free:
        raise ValueError(
            f"the KV pool needs {kv_pool / _GIB:.2f} GiB but only {free / _GIB:.2f} GiB of GPU memory is free; "
            "lower config key 'max_batch_size' (or the model's max_position_embeddings)"
        )
    left = free - kv_pool
    if staging > left:
        hint = ""
        if tile_e is not None and expert_bytes:
            fits = left // (2 * expert_bytes)
            hint = f" (at most {fits} experts per tile fit)" if fits >= 1 else " (not even one expert per tile fits)"
        raise ValueError(
            f"the prefill staging ring needs {staging / _GIB:.2f} GiB but {left / _GIB:.2f} GiB is left after the "
            f"KV pool; lower MOEFX_OFFLOAD_STAGE_TILE_E (now {tile_e}){hint}, or set "
            "MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS=0 to never stream experts to the GPU"
        )
    return GpuMemoryBudget(free, kv_pool, staging, left - staging)
