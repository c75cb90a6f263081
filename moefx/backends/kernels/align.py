"""On-GPU token sort/align for the grouped MoE GEMMs: no host sync, fixed shapes, CUDA-graph safe.

Output layout (same in the Triton and PyTorch versions): the M*k (token, slot) pairs, flattened as
pair = token * k + slot, are grouped by expert; each expert's group is padded to a multiple of
BLOCK_M with the sentinel M*k. `sorted_ids` has the worst-case length M*k + E*(BLOCK_M-1) (rounded up
to BLOCK_M), `expert_ids[b]` is the expert of block b (-1 past the end), `num_post[0]` the padded
length actually used. Order inside an expert's group is not fixed (atomics); results do not depend
on it because every pair's row is computed and summed independently.
Small calls (up to SMALL_ALIGN_PAIRS pairs) use one single-program launch instead of four: counts and
starts come from a one-hot [pairs, E] tile in registers, each pair's rank inside its expert from a
[pairs, pairs] comparison (pairs then sit in ascending order inside each expert, as in the PyTorch version).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moefx.backends.kernels.common import max_padded_len

SMALL_ALIGN_PAIRS = 128  # up to this many pairs (M*k) one program aligns them all
SMALL_ALIGN_ELEMS = 32768  # ... and holds the one-hot [pairs, E] tile (8 warps: 128 values per thread)


@triton.jit
def _align_small_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, max_padded, max_blocks,
    num_experts, BLOCK_M: tl.constexpr, NP: tl.constexpr, BLOCK_E: tl.constexpr, PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # H200: 3.6 µs at 8 pairs, 7.5 µs at 128 (the four launches read ~13 µs at 2048); a 2-D cumsum ranked no faster
    p = tl.arange(0, NP)
    valid = p < numel
    e = tl.load(ids_ptr + p, mask=valid, other=-1).to(tl.int32)
    onehot = (e[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    padded = (tl.sum(onehot, axis=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    rank = tl.sum(((e[:, None] == e[None, :]) & (p[None, :] < p[:, None])).to(tl.int32), axis=1)
    pos = tl.sum(onehot * (ends - padded)[None, :], axis=1) + rank
    slots = tl.arange(0, PAD)
    tl.store(sorted_ptr + slots, numel, mask=slots < max_padded)
    tl.debug_barrier()  # the sentinel fill lands before the pairs overwrite their slots
    tl.store(sorted_ptr + pos, p, mask=valid)
    ends = tl.where(tl.arange(0, BLOCK_E) < num_experts, ends, 2147483647)
    b = tl.arange(0, BLOCK_B)
    owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(expert_ids_ptr + b, tl.where(b * BLOCK_M < total, owner, -1), mask=b < max_blocks)
    tl.store(num_post_ptr, total)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, sorted_ptr, numel, max_padded, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_ptr + offs, numel, mask=offs < max_padded)
    valid = offs < numel
    e = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    tl.atomic_add(counts_ptr + e, 1, mask=valid)


@triton.jit
def _prefix_kernel(
    counts_ptr, cursor_ptr, expert_ids_ptr, num_post_ptr, num_experts, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # Every program redoes the (tiny) prefix sum over experts and writes BLOCK_B entries of expert_ids;
    # program 0 also writes the per-expert cursors and the padded total.
    pid = tl.program_id(0)
    e_offs = tl.arange(0, BLOCK_E)
    e_mask = e_offs < num_experts
    counts = tl.load(counts_ptr + e_offs, mask=e_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(cursor_ptr + e_offs, ends - padded, mask=e_mask)
        tl.store(num_post_ptr, total)
    ends = tl.where(e_mask, ends, 2147483647)
    b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    # the expert of block b = the number of experts whose padded group ends at or before b's first row
    owner = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    owner = tl.where(b * BLOCK_M < total, owner, -1)
    tl.store(expert_ids_ptr + b, owner, mask=b < max_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < numel
    e = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    pos = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
    tl.store(sorted_ptr + pos, offs, mask=valid)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton sort/align: (sorted_ids int32, expert_ids int32, num_post int32[1]); no host sync; one launch for
    small calls, four otherwise."""
    ids = topk_ids.reshape(-1)
    numel = ids.numel()
    max_padded = max_padded_len(numel, num_experts, block_m)
    max_blocks = max_padded // block_m
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    np2 = triton.next_power_of_2(max(numel, 1))
    if np2 <= SMALL_ALIGN_PAIRS and np2 * block_e <= SMALL_ALIGN_ELEMS:
        _align_small_kernel[(1,)](
            ids, sorted_ids, expert_ids, num_post, numel, max_padded, max_blocks, num_experts,
            BLOCK_M=block_m, NP=np2, BLOCK_E=block_e, PAD=triton.next_power_of_2(max_padded),
            BLOCK_B=triton.next_power_of_2(max_blocks), num_warps=8,
        )
        return sorted_ids, expert_ids, num_post
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block = 1024
    grid = (triton.cdiv(max(max_padded, numel), block),)
    _count_kernel[grid](ids, counts, sorted_ids, numel, max_padded, BLOCK=block)
    _prefix_kernel[(triton.cdiv(max_blocks, 64),)](
        counts, cursor, expert_ids, num_post, num_experts, max_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=64,
    )
    _scatter_kernel[(triton.cdiv(numel, block),)](ids, cursor, sorted_ids, numel, BLOCK=block)
    return sorted_ids, expert_ids, num_post
