"""FP8 grouped GEMM 1 in Gluon (Hopper): the Triton kernel's job with the wgmma waits and loads placed by hand.

Same inputs and outputs as `fused_moe_kernels._gemm1_kernel` with FP8=True and running-scale accumulators: rows
of the padded sorted pairs (one expert per BLOCK_M block), gate and up tiles of w13, silu(gate) * up quantized per
row to e4m3 with one scale per tile row. Weight tiles by TMA (one mbarrier per stage), activation rows gathered by
cp.async; the up accumulator is rescaled while the gate dot runs. Overlapping the gate rescale with the previous up
dot too (wait 1 at the top of the loop) makes ptxas serialize every wgmma (C7514), so the loop waits for both.
Measured on the H200 (bench/NOTES-moe.md, eighth session): correct, and 6-10% slower than the Triton kernel at
M=1024 and 4096, so no default uses it (GemmConfig.gluon). GPU only (Gluon has no interpreter): its tests are
`-m gpu`; CI compiles it for sm_90a.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

FP8_MAX = gl.constexpr(448.0)
MIN_SCALE = gl.constexpr(1e-12)  # as fused_moe_kernels.MIN_SCALE: running accumulators divide by weight scales


@gluon.jit
def _issue_loads(step, a_buf, g_buf, u_buf, ready, a_ptrs, a_mask, w_desc, g_row,
                 I: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, NK: gl.constexpr):
    """Start loading K step `step` into its stage. Past the last step everything is predicated off (not branched
    around: a branch between wgmma issue and wait makes ptxas serialize every wgmma) and the cp.async group is
    empty, so the group count per step stays fixed for `wait_group`."""
    s = step % STAGES
    live = step < NK
    k0 = step * BLOCK_K
    async_copy.async_copy_global_to_shared(a_buf.index(s), a_ptrs + k0, mask=a_mask & live)
    mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes, pred=live)
    tma.async_copy_global_to_shared(w_desc, [g_row, k0], ready.index(s), g_buf.index(s), pred=live)
    tma.async_copy_global_to_shared(w_desc, [g_row + I, k0], ready.index(s), u_buf.index(s), pred=live)
    async_copy.commit_group()


@gluon.jit
def _gemm1_fp8_kernel(
    a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr,
    sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_pid_m,
    stride_se, stride_sn, stride_sk,
    H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr, SBN: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    NK: gl.constexpr = H // BLOCK_K
    num_pid_n: gl.constexpr = I // BLOCK_N
    pid = gl.program_id(0)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    row0 = pid_m * BLOCK_M
    if row0 >= gl.load(num_post_ptr):
        return
    e = gl.load(expert_ids_ptr + pid_m).to(gl.int64)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])
    a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)

    # activation rows: gathered by token (cp.async, 16 bytes a thread), padding rows zero-filled
    pairs_ld = gl.load(sorted_ptr + row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld)))
    a_ptrs = (a_ptr + ((pairs_ld // TOP_K).to(gl.int64) * H)[:, None]
              + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))[None, :])
    a_mask = (pairs_ld < num_pairs)[:, None]
    # scales: activation per (row, K group), weight per (tile, K group)
    offs_m = gl.arange(0, BLOCK_M, layout=rows_l)
    pairs = gl.load(sorted_ptr + row0 + offs_m)
    row_mask = pairs < num_pairs
    as_rows = as_ptr + (pairs // TOP_K).to(gl.int64) * NK
    g_s = ws_ptr + e * stride_se + ((pid_n * BLOCK_N) // SBN) * stride_sn
    u_s = ws_ptr + e * stride_se + ((I + pid_n * BLOCK_N) // SBN) * stride_sn
    g_row = (e * (2 * I) + pid_n * BLOCK_N).to(gl.int32)

    a_buf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_sl)
    g_buf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    u_buf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for step in gl.static_range(STAGES - 1):
        _issue_loads(step, a_buf, g_buf, u_buf, ready, a_ptrs, a_mask, w_desc, g_row, I, BLOCK_K, STAGES, NK)

    # running-scale accumulators: after step k they hold the sum in units of step k's scales (s = a_s * w_s per row)
    acc_g = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma))
    acc_u = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma))
    sg_prev = gl.full([BLOCK_M], 1.0, gl.float32, rows_l)
    su_prev = gl.full([BLOCK_M], 1.0, gl.float32, rows_l)
    for k in range(NK):
        s = k % STAGES
        async_copy.wait_group(STAGES - 2)  # this thread's rows of step k are in
        mbarrier.wait(ready.index(s), (k // STAGES) & 1)  # the weight tiles of step k are in
        fence_async_shared()  # cp.async writes (generic proxy) before the wgmma reads (async proxy)
        gl.thread_barrier()  # every thread's rows are in
        a_sk = gl.load(as_rows + k, mask=row_mask, other=1.0)
        sg = gl.maximum(gl.load(g_s + k * stride_sk), MIN_SCALE) * a_sk
        su = gl.maximum(gl.load(u_s + k * stride_sk), MIN_SCALE) * a_sk
        # both previous dots done: waiting for the gate dot only (wait 1, the up dot still running) would be the better
        # overlap, but ptxas cannot follow that wait across the loop's back edge and serializes every wgmma (C7514)
        acc_g = warpgroup_mma_wait(0, deps=[acc_g])
        acc_g = warpgroup_mma(a_buf.index(s), g_buf.index(s).permute((1, 0)), acc_g * (sg_prev / sg)[:, None],
                              is_async=True)
        acc_u = warpgroup_mma_wait(1, deps=[acc_u])  # this gate dot may run while the up accumulator is rescaled
        acc_u = warpgroup_mma(a_buf.index(s), u_buf.index(s).permute((1, 0)), acc_u * (su_prev / su)[:, None],
                              is_async=True)
        sg_prev = sg
        su_prev = su
        gl.thread_barrier()  # both warp groups are past step k-1's dots: its stage may be refilled
        _issue_loads(k + STAGES - 1, a_buf, g_buf, u_buf, ready, a_ptrs, a_mask, w_desc, g_row, I, BLOCK_K, STAGES,
                     NK)
    acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])
    async_copy.wait_group(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    acc_g = acc_g * sg_prev[:, None]
    acc_u = acc_u * su_prev[:, None]
    act = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u  # padding rows: a = 0, so act = 0
    scale = gl.maximum(gl.max(gl.abs(act), axis=1), 1e-10) / FP8_MAX
    q = gl.minimum(gl.maximum(act / scale[:, None], -FP8_MAX), FP8_MAX).to(gl.float8e4nv)
    rows = (row0 + offs_m).to(gl.int64)  # sorted position: GEMM 2 reads row blocks
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols_l)
    gl.store(out_ptr + rows[:, None] * I + offs_n[None, :], q)
    gl.store(os_ptr + rows * (I // BLOCK_N) + pid_n, scale)


def gluon_problem(h: int, inter: int, block_shape: tuple[int, int], block_m: int, device: torch.device) -> str | None:
    """Why the Gluon GEMM 1 cannot run this call, or None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "the Gluon FP8 GEMM 1 is written for Hopper (wgmma)"
    if block_shape != (128, 128):
        return f"the Gluon FP8 GEMM 1 takes 128x128 weight blocks, not {block_shape}"
    if h % 128 or inter % 128:
        return f"the Gluon FP8 GEMM 1 needs H and I multiples of 128 (H={h}, I={inter})"
    if block_m not in (64, 128):
        return f"the Gluon FP8 GEMM 1 takes BLOCK_M 64 or 128, not {block_m}"
    return None


def gemm1_fp8(a: torch.Tensor, a_s: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, out: torch.Tensor,
              out_s: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post: torch.Tensor,
              num_pairs: int, top_k: int, block_m: int, group_m: int, num_stages: int) -> None:
    """GEMM 1 (+SiLU-mul, +e4m3 quant of the result) over the padded sorted pairs; see the module docstring."""
    h, inter = a.shape[1], w13.shape[1] // 2
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    w_desc = TensorDescriptor.from_tensor(w13.view(-1, h), [128, 128], layout)
    num_pid_m = sorted_ids.numel() // block_m
    _gemm1_fp8_kernel[(num_pid_m * (inter // 128),)](
        a, a_s, w_desc, w13_scale, out, out_s, sorted_ids, expert_ids, num_post, num_pairs, num_pid_m,
        *w13_scale.stride(),
        H=h, I=inter, TOP_K=top_k, SBN=128, BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, GROUP_M=group_m,
        STAGES=num_stages, num_warps=block_m // 16,
    )
