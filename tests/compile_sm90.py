"""Compile the MoE kernels at every DEFAULT_TILES row (grouped GEMMs, gemv stages) for sm_90a (H200) without a GPU;
print one JSON line.

The interpreter runs only the branches a test takes, so a branch that the GPU compiler rejects (a tile compiled
with a descriptor of the wrong block) passes every CPU test; this compiles what fused_moe and gemv_moe launch, with
the same argument types and descriptor blocks (each row's "gemm1"/"gemm2" are its first and second launch; the rows of
the other gate epilogues hold grouped GEMM 1 and gemv stage 1 at the largest tiles). Run
without TRITON_INTERPRET (test_backends_grouped.py starts it so). It also reports whether ptxas had to serialize a
kernel's wgmmas (C7514: accumulator registers touched while a wgmma it cannot prove finished may still write them).
Usage: python tests/compile_sm90.py [bf16|fp8]   (or `dense`: the dense-linear kernel at its DEFAULT_TILES rows, both
kinds, at the q/k/v shape with the SM count's split-K; `attention`: moefx::decode_attention's kernels; `routing`:
moefx::fused_topk's kernel)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from moefx.kernels import dense_gemm as dense
from moefx.kernels import moe_gemv as gemv
from moefx.kernels import moe_grouped as fmk
from moefx.kernels.activation import ACTIVATIONS
from moefx.kernels.moe_routing import constexprs as route_constexprs

# Qwen3-30B-A3B's expert shapes (the geometry the tiles were measured on)
H, I, TOP_K, BLOCK_SHAPE = 2048, 768, 8, (128, 128)
PTR_ARGS = ("sorted_ptr", "expert_ids_ptr", "num_post_ptr")
LAUNCH_DEFAULT_STAGES = 3  # gemv_moe passes no num_stages: Triton's CUDA default
# what the JIT sees at that geometry: 16-byte aligned tensors, row and expert strides divisible by 16
DIVISIBLE = re.compile(r"_ptr$|^stride_(am|we|wn|xm|om)$")


def _signature(fn, types: dict[str, str], consts: dict) -> dict[str, str]:
    return {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}


def _compile(fn, types: dict[str, str], consts: dict, num_warps: int, num_stages: int,
             divisible: re.Pattern = DIVISIBLE) -> dict:
    """Shared memory, registers, spilled bytes and whether ptxas serialized the wgmmas (C7514) of one kernel."""
    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts and divisible.search(n)}
    src = ASTSource(fn, _signature(fn, types, consts), constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        info = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                              capture_output=True, text=True, check=True).stderr
    return dict(smem=kernel.metadata.shared, regs=int(re.search(r"Used (\d+) registers", info)[1]),
                spill=int(re.search(r"(\d+) bytes spill stores", info)[1]), serialized="C7514" in info)


def _common(cfg: fmk.GemmConfig, fp8: bool, align_m: int) -> dict:
    return dict(FP8=fp8, SBN=BLOCK_SHAPE[0], SBK=BLOCK_SHAPE[1], ALIGN_M=align_m, HALF=cfg.half, BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, INTERPRET=False, TMA=cfg.tma,
                PDL=cfg.pdl, RUNNING=cfg.running)


def compile_row(
    kind: str, cfg1: fmk.GemmConfig, cfg2: fmk.GemmConfig, act: int = 0, limit: float = 0.0
) -> tuple[dict, dict]:
    """GEMM 1's and GEMM 2's resources at these tiles (GEMM 1 with activation id `act` and gate clamp `limit`),
    compiled as fused_moe launches them."""
    fp8 = kind == "fp8"
    cfg1, cfg2 = fmk.normalize_tiles(cfg1, cfg2, BLOCK_SHAPE if fp8 else None)
    w = "fp8e4nv" if fp8 else "bf16"

    def desc(cfg: fmk.GemmConfig, rows: int) -> str:
        return f"tensordesc<{w}[{rows}, {cfg.block_k}]>" if cfg.tma else f"*{w}"

    base = {n: "*i32" for n in PTR_ARGS}
    types1 = base | dict(a_ptr=f"*{w}", as_ptr="*fp32", w_ptr=f"*{w}", w_desc=desc(cfg1, cfg1.block_n),
                         ws_ptr="*fp32", out_ptr=f"*{w}", os_ptr="*fp32")
    gemm1 = _compile(fmk._gemm1_kernel, types1,
                     dict(H=H, I=I, TOP_K=TOP_K) | _common(cfg1, fp8, cfg1.block_m) | dict(ACT=act, LIMIT=limit),
                     cfg1.num_warps, cfg1.num_stages)
    # fused_moe passes the full-block descriptor as the half one when the tile has no half path
    types2 = base | dict(a_ptr=f"*{w}", a_desc=desc(cfg2, cfg2.block_m),
                         a_desc_half=desc(cfg2, cfg2.block_m // 2 if cfg2.half else cfg2.block_m), as_ptr="*fp32",
                         w_ptr=f"*{w}", w_desc=desc(cfg2, cfg2.block_n), ws_ptr="*fp32", out_ptr="*bf16",
                         tw_ptr="*fp32")
    gemm2 = _compile(fmk._gemm2_kernel, types2, dict(H=H, I=I) | _common(cfg2, fp8, cfg1.block_m),
                     cfg2.num_warps, cfg2.num_stages)
    return gemm1, gemm2


def compile_gemv(kind: str, cfg: gemv.GemvConfig, act: int = 0, limit: float = 0.0) -> tuple[dict, dict]:
    """Stage 1's (with activation id `act`, gate clamp `limit`) and stage 2's resources at this GemvConfig, compiled
    as gemv_moe launches it (bf16 hidden, int64 ids, fp32 routing weights and activations; stage 2 with the residual
    epilogue a decode step's layer runs)."""
    fp8 = kind == "fp8"
    bn1, bk1, bn2, bk2, kp = gemv.stage_tiles(cfg, H, I, TOP_K, BLOCK_SHAPE if fp8 else None)
    w = "*fp8e4nv" if fp8 else "*bf16"
    # CHAIN: as a decode step launches them, in the PDL chain between ops (kernels/pdl.py)
    common = dict(H=H, I=I, TOP_K=TOP_K, FP8=fp8, SBN=BLOCK_SHAPE[0], SBK=BLOCK_SHAPE[1], PDL=cfg.pdl,
                  CHAIN=cfg.pdl)
    stage1 = _compile(gemv._gemv_gate_up_kernel,
                      dict(x_ptr="*bf16", ids_ptr="*i64", w_ptr=w, ws_ptr="*fp32", act_ptr="*fp32"),
                      common | dict(BLOCK_N=bn1, BLOCK_K=bk1, ACT=act, LIMIT=limit), cfg.num_warps1,
                      LAUNCH_DEFAULT_STAGES)
    stage2 = _compile(gemv._gemv_down_kernel,
                      dict(act_ptr="*fp32", ids_ptr="*i64", tw_ptr="*fp32", w_ptr=w, ws_ptr="*fp32", res_ptr="*bf16",
                           out_ptr="*bf16"),
                      common | dict(KP=kp, BLOCK_N=bn2, BLOCK_K=bk2, RESIDUAL=True), cfg.num_warps2,
                      LAUNCH_DEFAULT_STAGES)
    return stage1, stage2


def compile_decode_attention() -> list[dict]:
    """moefx::decode_attention's kernel at Qwen3-30B-A3B's attention (8 query heads per KV head, head_dim 128, bf16,
    a bool mask): one slice ("gemm1" and "gemm2" alike), and several slices of 64 positions with their combine
    unrolled over 4 (batch 1, a 256-position cache) and over the kernel's MAX_SPLITS slices (the most); each with K and
    V loaded after the mask (one slice of 512 positions) and with it (SPECULATE: one slice of the longest the launch
    plan speculates over); and moefx::qk_norm_rope_cache's kernel in front."""
    from moefx.kernels import decode_attn as ta

    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", mask_ptr="*i1", out_ptr="*bf16", part_ptr="*fp32",
                 cnt_ptr="*i32", scale="fp32")
    # what the JIT sees at that shape over a static cache (lengths in steps of 256): the q/k/v/out strides, the mask's
    # row stride and the length divisible by 16, the mask's position stride 1 (a constant); without them every
    # element of a K or V block loads on its own, with its own address registers
    divisible = re.compile(r"_ptr$|^stride_[qkvo]|^stride_mb$|^length$")
    rows = []

    def attention(per_split: int, splits_pad: int, speculate: bool) -> dict:
        split = splits_pad > 1
        consts = dict(PER_SPLIT=per_split, G=8, G_PAD=16, D=128, BLOCK=ta.BLOCK_L, MASK=True,
                      MASK_BOOL=True, SPLIT=split, SPLITS_PAD=splits_pad, CHUNK=min(splits_pad, ta.COMBINE_UNROLL),
                      G_COMB=8, IEEE=False, PDL=True, SPECULATE=speculate, stride_ml=1)
        return _compile(ta._decode_attn_kernel, types, consts, 4, LAUNCH_DEFAULT_STAGES, divisible)

    for speculate, one_slice in ((False, 512), (True, ta.SPECULATE_BLOCKS * ta.BLOCK_L)):
        form = ", speculative loads" if speculate else ""
        one = attention(one_slice, 1, speculate)
        rows.append(dict(kind="decode_attention", max_rows=f"split=False ({one_slice} positions){form}", gemm1=one,
                         gemm2=one))
        rows.append(dict(kind="decode_attention", max_rows=f"split=True (4, 64 slices){form}",
                         gemm1=attention(64, 4, speculate), gemm2=attention(64, ta.MAX_SPLITS, speculate)))
    from moefx.kernels import norm_rope_cache as rc

    bf16 = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "keys_ptr",
                                 "values_ptr", "out_ptr")}
    rope = _compile(rc._qk_norm_rope_cache_kernel, bf16 | dict(pos_ptr="*i64", eps="fp32"),
                    dict(HQ=32, D=128, HAS_W=True, PDL=True), 1, LAUNCH_DEFAULT_STAGES)
    rows.append(dict(kind="qk_norm_rope_cache", max_rows="-", gemm1=rope, gemm2=rope))
    return rows


def compile_dense(kind: str, max_m: float, cfg: dense.DenseConfig) -> dict:
    """The dense kernel's resources at one DEFAULT_TILES row, launched as dense_gemv would for q/k/v (N 4096/512/512,
    K = H) at M = min(max_m, 16) on 132 SMs (bf16 activations and outputs, fp32 scales and split-K partials); the
    float rows also with the RMSNorm prologue and its weight ("norm_kernel": q/k/v after fuse_norm_linear) and with the
    residual add before it ("add_norm_kernel": the router after fuse_norm_linear's add form); the FP8 weight-only rows
    (bf16 X, no x_scale) with both prologues too."""
    fp8, wo = kind in ("fp8", "fp8_weight_only"), kind == "fp8_weight_only"
    m = int(min(max_m, 16))
    ns = (4096, 512, 512)
    lp = dense.plan_launch(cfg, m, ns, H, BLOCK_SHAPE if fp8 else None, 132)
    w, split = ("*fp8e4nv" if fp8 else "*bf16"), lp.split_k > 1
    x = "*fp8e4nv" if fp8 and not wo else "*bf16"
    types = dict(x_ptr=x, xs_ptr="*fp32" if fp8 and not wo else "*bf16", nw_ptr=x, r_ptr=x, h_ptr=x, xo_ptr=x,
                 eps="fp32",
                 rb_ptr="*bf16", rw_ptr="*bf16", ri_ptr="*i64", scaling="fp32",
                 part_ptr="*fp32" if split else "*bf16", cnt_ptr="*i32" if split else "*bf16")
    for i in range(dense.MAX_WEIGHTS):
        types |= {f"w{i}_ptr": w, f"ws{i}_ptr": "*fp32" if fp8 else "*bf16", f"b{i}_ptr": "*bf16", f"y{i}_ptr": "*bf16"}
    starts = [0, lp.tiles[0], lp.tiles[0] + lp.tiles[1], sum(lp.tiles)]
    consts = dict(N0=ns[0], N1=ns[1], N2=ns[2], N3=1, T1=starts[1], T2=starts[2], T3=starts[3], NUM_W=3,
                  HB0=False, HB1=False, HB2=False, HB3=False, K=H, N_TOTAL=sum(ns), M_TILES=lp.m_tiles, FP8=fp8,
                  XQ=fp8 and not wo,
                  SBN=BLOCK_SHAPE[0] if fp8 else 1, SBK=BLOCK_SHAPE[1] if fp8 else 1, NORM=False, HAS_NORM_W=False,
                  NORM_BLOCK=1, RESID=False, BLOCK_M=lp.block_m,
                  BLOCK_N=lp.block_n, BLOCK_K=lp.block_k, SPLIT_K=lp.split_k, K_PER_SPLIT=lp.k_per_split,
                  DOT=cfg.dot, IEEE=False, ROUTE=False, SLOT=dense.COUNTER_SLOTS - 1, **dense.NO_ROUTE, PDL=False)
    divisible = re.compile(r"_ptr$|^stride_(xm|wn\d)$")
    row = dict(kind=f"dense {kind}", max_rows=str(max_m), split_k=lp.split_k,
               kernel=_compile(dense._dense_kernel, types, consts, cfg.num_warps, cfg.num_stages, divisible))
    # as a decode step launches it: in the PDL chain (kernels/pdl.py)
    chain = dict(PDL=True)
    row["pdl_kernel"] = _compile(dense._dense_kernel, types, consts | chain, cfg.num_warps, cfg.num_stages, divisible)
    if wo or not fp8:
        norm = dict(NORM=True, HAS_NORM_W=True, NORM_BLOCK=dense.norm_block(lp, H, cfg.dot))
        row["norm_kernel"] = _compile(dense._dense_kernel, types, consts | norm, cfg.num_warps, cfg.num_stages,
                                      divisible)
        row["add_norm_kernel"] = _compile(dense._dense_kernel, types, consts | norm | {"RESID": True},
                                          cfg.num_warps, cfg.num_stages, divisible)
    if not fp8:
        # the router (128 experts, top-8 softmax) with its routing epilogue, as fuse_router_topk leaves it
        rp = dense.plan_launch(cfg, m, (128,), H, None, 132)
        router = dict(N0=128, T1=rp.tiles[0], T2=rp.tiles[0], T3=rp.tiles[0], NUM_W=1, N_TOTAL=128,
                      M_TILES=rp.m_tiles, BLOCK_M=rp.block_m, BLOCK_N=rp.block_n, BLOCK_K=rp.block_k,
                      SPLIT_K=rp.split_k, K_PER_SPLIT=rp.k_per_split, NORM_BLOCK=dense.norm_block(rp, H, cfg.dot),
                      ROUTE=True, ROUTE_ROWS=dense.route_chunk_rows(rp.block_m, 128, cfg.num_warps),
                      **route_constexprs(128, 8, "softmax", True, False, 1, 1))
        rtypes = types | dict(part_ptr="*fp32" if rp.split_k > 1 else "*bf16", cnt_ptr="*i32")
        row["route_kernel"] = _compile(dense._dense_kernel, rtypes, consts | norm | {"RESID": True} | router | chain,
                                       cfg.num_warps, cfg.num_stages, divisible)
    return row


def compile_routing() -> list[dict]:
    """moefx::fused_topk's kernel at `launch_shape` for a prefill (4096 rows) and a decode call (1 row): Qwen3-30B-A3B's
    router (128 experts, top-8 softmax, renormalized, bf16 logits), DeepSeek-V3's (256 experts, sigmoid + bias, 8 groups
    keep 4, fp32 logits) and a 2048-expert one (a row over 4 warps); contiguous logits, as the JIT specializes them."""
    from moefx.kernels import moe_routing as mr

    rows = []
    for name, e, dtype, args in (("qwen3", 128, "*bf16", ("softmax", True, False, 1, 1)),
                                 ("deepseek_v3", 256, "*fp32", ("sigmoid", True, True, 8, 4)),
                                 ("2048 experts", 2048, "*bf16", ("softmax", True, False, 1, 1))):
        types = dict(logits_ptr=dtype, bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", scaling="fp32")
        for t in (4096, 1):
            r, warps = mr.launch_shape(t, e)
            consts = mr.constexprs(e, 8, *args) | dict(ROWS=r, stride_e=1)
            kernel = _compile(mr._fused_topk_kernel, types, consts, warps, LAUNCH_DEFAULT_STAGES,
                              re.compile(r"_ptr$|^stride_t$"))
            rows.append(dict(kind=f"fused_topk {name}", max_rows=f"{r} rows, {warps} warps", gemm1=kernel,
                             gemm2=kernel))
    return rows


def epilogue_variants() -> list[tuple[str, int, float]]:
    """(name, ACT id, LIMIT) of every GEMM-1 epilogue besides plain SiLU: the other activations, clamped SwiGLU."""
    return [(a.name, a.kernel_id, 0.0) for a in ACTIVATIONS.values() if a.kernel_id] + [("silu clamped", 0, 7.0)]


def main() -> None:
    if sys.argv[1:] == ["attention"]:
        print(json.dumps(compile_decode_attention()))
        return
    if sys.argv[1:] == ["routing"]:
        print(json.dumps(compile_routing()))
        return
    if sys.argv[1:] == ["dense"]:
        print(json.dumps([compile_dense(kind, max_m, cfg) for kind in dense.DEFAULT_TILES
                          for max_m, cfg in dense.DEFAULT_TILES[kind]]))
        return
    kinds = sys.argv[1:] or list(fmk.DEFAULT_TILES)
    rows = []
    for kind in kinds:
        for max_m, cfg in gemv.DEFAULT_TILES[kind]:
            stage1, stage2 = compile_gemv(kind, cfg)
            rows.append(dict(kind=f"gemv {kind}", max_rows=str(max_m), gemm1=stage1, gemm2=stage2))
        for max_rows, cfg1, cfg2 in fmk.DEFAULT_TILES[kind]:
            gemm1, gemm2 = compile_row(kind, cfg1, cfg2)
            rows.append(dict(kind=kind, max_rows=str(max_rows), gemm1=gemm1, gemm2=gemm2))
        # the other epilogues, at the largest tiles (the most registers): grouped GEMM 1, gemv stage 1
        _, cfg1, cfg2 = fmk.DEFAULT_TILES[kind][-1]
        for name, act, limit in epilogue_variants():
            gemm1 = compile_row(kind, cfg1, cfg2, act, limit)[0]
            stage1 = compile_gemv(kind, gemv.DEFAULT_TILES[kind][-1][1], act, limit)[0]
            rows.append(dict(kind=f"{kind} {name}", max_rows="inf", gemm1=gemm1, gemm2=stage1))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
