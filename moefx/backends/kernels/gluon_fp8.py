"""FP8 grouped GEMM 1 in Gluon (Hopper), warp-specialized: one loader warp group, two consumer warp groups.

Same inputs and outputs as `fused_moe_kernels._gemm1_kernel` with FP8=True and running-scale accumulators: rows
of the padded sorted pairs (one expert per 128-row block), gate and up tiles of w13, silu(gate) * up quantized per
row to e4m3 with one scale per tile row. The loader gathers the activation rows by cp.async and the weight tiles by
TMA into STAGES buffers; each consumer warp group owns 64 of the 128 rows and runs its own K loop, so while one
rescales its accumulators (per-step block scales) the other's wgmma keeps the tensor cores busy. mbarriers only:
`ready` (TMA bytes plus the loader's arrival once its cp.async rows have landed), `empty` (both consumers done
with a stage). GPU only (Gluon has no interpreter): tests are `-m gpu`; CI compiles it for sm_90a.
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
ROWS = gl.constexpr(64)  # rows per consumer warp group (one wgmma M)
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128
LOADER_REGS, CONSUMER_REGS = 40, 232


@gluon.jit
def _consume(a_buf, g_buf, u_buf, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, sorted_ptr, num_pairs, row0, e,
             pid_n, stride_se, stride_sn, stride_sk, H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr,
             SBN: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
             OFF: gl.constexpr):
    """Rows OFF .. OFF + 64 of the block: the K loop on the staged tiles, then SiLU-mul, e4m3 quant and the stores."""
    NK: gl.constexpr = H // BLOCK_K
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    offs_m = gl.arange(0, ROWS, layout=rows_l)
    pairs = gl.load(sorted_ptr + row0 + OFF + offs_m)
    row_mask = pairs < num_pairs
    as_rows = as_ptr + (pairs // TOP_K).to(gl.int64) * NK
    g_s = ws_ptr + e * stride_se + ((pid_n * BLOCK_N) // SBN) * stride_sn
    u_s = ws_ptr + e * stride_se + ((I + pid_n * BLOCK_N) // SBN) * stride_sn
    # running-scale accumulators: after step k they hold the sum in units of step k's scales (s = a_s * w_s per row)
    acc_g = warpgroup_mma_init(gl.zeros([ROWS, BLOCK_N], gl.float32, mma))
    acc_u = warpgroup_mma_init(gl.zeros([ROWS, BLOCK_N], gl.float32, mma))
    sg_prev = gl.full([ROWS], 1.0, gl.float32, rows_l)
    su_prev = gl.full([ROWS], 1.0, gl.float32, rows_l)
    for k in range(NK):
        s = k % STAGES
        a_sk = gl.load(as_rows + k, mask=row_mask, other=1.0)
        sg = gl.maximum(gl.load(g_s + k * stride_sk), MIN_SCALE) * a_sk
        su = gl.maximum(gl.load(u_s + k * stride_sk), MIN_SCALE) * a_sk
        mbarrier.wait(ready.index(s), (k // STAGES) & 1)
        # both of step k-1's dots are done (waiting for the gate dot alone across the back edge makes ptxas
        # serialize every wgmma, C7514), so its stage goes back to the loader
        acc_g = warpgroup_mma_wait(0, deps=[acc_g])
        mbarrier.arrive(empty.index((k + STAGES - 1) % STAGES), count=1, pred=k > 0)
        a = a_buf.index(s).slice(OFF, ROWS)
        acc_g = warpgroup_mma(a, g_buf.index(s).permute((1, 0)), acc_g * (sg_prev / sg)[:, None], is_async=True)
        acc_u = warpgroup_mma_wait(1, deps=[acc_u])  # the up rescale runs while the gate dot does
        acc_u = warpgroup_mma(a, u_buf.index(s).permute((1, 0)), acc_u * (su_prev / su)[:, None], is_async=True)
        sg_prev = sg
        su_prev = su
    acc_g, acc_u = warpgroup_mma_wait(0, deps=[acc_g, acc_u])

    acc_g = acc_g * sg_prev[:, None]
    acc_u = acc_u * su_prev[:, None]
    act = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u  # padding rows: a = 0, so act = 0
    scale = gl.maximum(gl.max(gl.abs(act), axis=1), 1e-10) / FP8_MAX
    q = gl.minimum(gl.maximum(act / scale[:, None], -FP8_MAX), FP8_MAX).to(gl.float8e4nv)
    rows = (row0 + OFF + offs_m).to(gl.int64)  # sorted position: GEMM 2 reads row blocks
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + rows[:, None] * I + offs_n[None, :], q)
    gl.store(os_ptr + rows * (I // BLOCK_N) + pid_n, scale)


@gluon.jit
def _consume_low(a_buf, g_buf, u_buf, ready, empty, a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr,
                 num_pairs, row0, e, pid_n, stride_se, stride_sn, stride_sk, H: gl.constexpr, I: gl.constexpr,
                 TOP_K: gl.constexpr, SBN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr):
    _consume(a_buf, g_buf, u_buf, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, sorted_ptr, num_pairs, row0, e,
             pid_n, stride_se, stride_sn, stride_sk, H, I, TOP_K, SBN, BLOCK_N, BLOCK_K, STAGES, 0)


@gluon.jit
def _consume_high(a_buf, g_buf, u_buf, ready, empty, a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr,
                  num_pairs, row0, e, pid_n, stride_se, stride_sn, stride_sk, H: gl.constexpr, I: gl.constexpr,
                  TOP_K: gl.constexpr, SBN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr):
    _consume(a_buf, g_buf, u_buf, ready, empty, as_ptr, ws_ptr, out_ptr, os_ptr, sorted_ptr, num_pairs, row0, e,
             pid_n, stride_se, stride_sn, stride_sk, H, I, TOP_K, SBN, BLOCK_N, BLOCK_K, STAGES, ROWS)


@gluon.jit
def _load(a_buf, g_buf, u_buf, ready, empty, a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr,
          num_pairs, row0, e, pid_n, stride_se, stride_sn, stride_sk, H: gl.constexpr, I: gl.constexpr,
          TOP_K: gl.constexpr, SBN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          BLOCK_K: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr):
    """The loader warp group: per K step, wait for the stage to be free, start the weight tiles (TMA, counted in
    bytes on `ready`) and the gathered rows (cp.async); LAG steps later, once this group's rows of that step have
    landed, arrive on its `ready` (cp.async writes, then a proxy fence, then the arrival)."""
    NK: gl.constexpr = H // BLOCK_K
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    pairs = gl.load(sorted_ptr + row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld)))
    a_ptrs = (a_ptr + ((pairs // TOP_K).to(gl.int64) * H)[:, None]
              + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))[None, :])
    a_mask = (pairs < num_pairs)[:, None]
    g_row = (e * (2 * I) + pid_n * BLOCK_N).to(gl.int32)
    for k in range(NK):
        s = k % STAGES
        mbarrier.wait(empty.index(s), ((k // STAGES) & 1) ^ 1)  # a fresh barrier passes the phase before its first
        mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [g_row, k * BLOCK_K], ready.index(s), g_buf.index(s))
        tma.async_copy_global_to_shared(w_desc, [g_row + I, k * BLOCK_K], ready.index(s), u_buf.index(s))
        async_copy.async_copy_global_to_shared(a_buf.index(s), a_ptrs + k * BLOCK_K, mask=a_mask)
        async_copy.commit_group()
        if k >= LAG:
            async_copy.wait_group(LAG)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index((k - LAG) % STAGES), count=1)
    for j in gl.static_range(LAG):
        async_copy.wait_group(LAG - 1 - j)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index((NK - LAG + j) % STAGES), count=1)


@gluon.jit
def _gemm1_fp8_ws_kernel(
    a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr,
    sorted_ptr, expert_ids_ptr, num_post_ptr, num_pairs, num_pid_m,
    stride_se, stride_sn, stride_sk,
    H: gl.constexpr, I: gl.constexpr, TOP_K: gl.constexpr, SBN: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, LAG: gl.constexpr, LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
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

    a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    a_buf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, BLOCK_K], a_sl)
    g_buf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    u_buf = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)  # the TMA bytes' expect, the loader's rows
        mbarrier.init(empty.index(i), count=2)  # both consumers
    # the argument tuples are written out in the call: a tuple bound to a name would turn its constexprs into values
    gl.warp_specialize([
        (_consume_low, (a_buf, g_buf, u_buf, ready, empty, a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr,
                        num_pairs, row0, e, pid_n, stride_se, stride_sn, stride_sk, H, I, TOP_K, SBN, BLOCK_M, BLOCK_N,
                        BLOCK_K, STAGES, LAG)),
        (_consume_high, (a_buf, g_buf, u_buf, ready, empty, a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr,
                         num_pairs, row0, e, pid_n, stride_se, stride_sn, stride_sk, H, I, TOP_K, SBN, BLOCK_M,
                         BLOCK_N, BLOCK_K, STAGES, LAG)),
        (_load, (a_buf, g_buf, u_buf, ready, empty, a_ptr, as_ptr, w_desc, ws_ptr, out_ptr, os_ptr, sorted_ptr,
                 num_pairs, row0, e, pid_n, stride_se, stride_sn, stride_sk, H, I, TOP_K, SBN, BLOCK_M, BLOCK_N,
                 BLOCK_K, STAGES, LAG)),
    ], [4, 4], [CONSUMER_REGS, LOADER_REGS])


def gluon_problem(h: int, inter: int, block_shape: tuple[int, int], block_m: int, device: torch.device) -> str | None:
    """Why the Gluon GEMM 1 cannot run this call, or None."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return "the Gluon FP8 GEMM 1 is written for Hopper (wgmma)"
    if block_shape != (128, 128):
        return f"the Gluon FP8 GEMM 1 takes 128x128 weight blocks, not {block_shape}"
    if h % 128 or inter % 128:
        return f"the Gluon FP8 GEMM 1 needs H and I multiples of 128 (H={h}, I={inter})"
    if block_m != BLOCK_M:
        return f"the Gluon FP8 GEMM 1 takes BLOCK_M {BLOCK_M}, not {block_m}"
    return None


def gemm1_fp8(a: torch.Tensor, a_s: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, out: torch.Tensor,
              out_s: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post: torch.Tensor,
              num_pairs: int, top_k: int, block_m: int, group_m: int, num_stages: int) -> None:
    """GEMM 1 (+SiLU-mul, +e4m3 quant of the result) over the padded sorted pairs; see the module docstring."""
    h, inter = a.shape[1], w13.shape[1] // 2
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    w_desc = TensorDescriptor.from_tensor(w13.view(-1, h), [BLOCK_N, BLOCK_K], layout)
    num_pid_m = sorted_ids.numel() // BLOCK_M
    _gemm1_fp8_ws_kernel[(num_pid_m * (inter // BLOCK_N),)](
        a, a_s, w_desc, w13_scale, out, out_s, sorted_ids, expert_ids, num_post, num_pairs, num_pid_m,
        *w13_scale.stride(),
        H=h, I=inter, TOP_K=top_k, SBN=128, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=group_m,
        STAGES=num_stages, LAG=num_stages - 2, LOADER_REGS=LOADER_REGS, CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4, maxnreg=168,
    )
