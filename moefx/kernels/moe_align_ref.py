"""The padded expert-block layout of `moe_align.moe_align` (its buffer sizes and its PyTorch reference).

No Triton import: the grouped backend's CPU path and the kernel's launcher both size their buffers here.
"""

from __future__ import annotations

import torch


def max_padded_len(numel: int, num_experts: int, block_m: int) -> int:
    """Worst case of the padded sorted length, so every buffer is sized without looking at the ids."""
    return -(-(numel + num_experts * (block_m - 1)) // block_m) * block_m


def moe_align_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch version of `moe_align.moe_align` (same layout, pairs in ascending order inside each expert)."""
    ids = topk_ids.reshape(-1).long()
    numel = ids.numel()
    dev = ids.device
    max_padded = max_padded_len(numel, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(ids, stable=True)
    sorted_e = ids[order]
    rank = torch.arange(numel, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids[starts[sorted_e] + rank] = order.to(torch.int32)
    block_start = torch.arange(max_padded // block_m, device=dev) * block_m
    ends = torch.cumsum(padded, 0)
    expert_ids = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    total = padded.sum()
    expert_ids = torch.where(block_start < total, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.reshape(1).to(torch.int32)
