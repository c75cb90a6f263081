"""Which part of a transformer step a GPU kernel belongs to, by its name: the one classification the decode step
table and the prefill step table share (bench/sections/e2e.py, bench/sections/forward.py), with the floors of each
part at Qwen3-30B-A3B widths. Plain Python, no torch.

A kernel belongs to the first kind in `MATCH_ORDER` one of whose name prefixes it starts with (or, for library
kernels whose mangled names vary, contains one of `contains`); a kernel no kind names is `other`. moefx's own
Triton kernels are named by their function (`_dense_kernel`, `_gemm1_kernel`, ...); torch's grouped GEMM is MoE
experts; other cuBLAS / CUTLASS GEMMs (`nvjet_*`, `*cutlass*`, `*gemm*`) are the dense projections outside moefx's
GEMV (the LM head too, which a table tells apart by its one call per step); cuDNN / flash kernels are attention;
inductor's generated kernels (`triton_*`) are what is left of the norms, residual adds and RoPE after the fusions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    key: str
    label: str  # the part, as the decode table names it
    short: str  # as the prefill table names it
    prefixes: tuple[str, ...] = ()
    contains: tuple[str, ...] = ()

    def matches(self, kernel: str) -> bool:
        return kernel.startswith(self.prefixes) or any(c in kernel for c in self.contains)


KINDS: tuple[Kind, ...] = (
    Kind("dense", "dense projections (q/k/v, o, router; the norms and routing they fuse)", "dense projections",
         ("_dense_kernel", "_fp8_block_gemm_kernel", "nvjet_"), ("cutlass", "gemm", "xmma")),
    Kind("moe", "MoE experts (gate/up, down + residual add)", "MoE experts (align, GEMMs, top-k sum)",
         ("_gemv_gate_up_kernel", "_gemv_down_kernel", "_gemm1_kernel", "_gemm2_kernel", "_topk_sum_kernel",
          "_align_count_kernel", "_align_scatter_kernel", "_align_small_kernel"), ("GroupProblemShape", "grouped")),
    Kind("attention", "attention (decode kernel, combine)", "attention",
         ("_decode_attn_kernel", "_combine_kernel", "cudnn_generated_fort_native_sdpa"), ("flash", "fmha")),
    Kind("router", "routing top-k", "routing top-k", ("_fused_topk_kernel",)),
    Kind("rope", "q/k norm + RoPE + KV-cache write", "q/k norm + RoPE + KV-cache write",
         ("_qk_norm_rope_cache_kernel",)),
    Kind("quant", "FP8 activation quant (and the norm it fuses)", "FP8 activation quant",
         ("_quant_kernel", "_quant_rows_kernel")),
    Kind("inductor", "inductor: norms, residual add (and what the fusions above left)",
         "inductor: norms, residual adds, what the fusions left", ("triton_",)),
)
BY_KEY = {k.key: k for k in KINDS}
# moefx's MoE GEMMs and torch's grouped GEMM before the generic GEMM names; inductor's kernels before them too
MATCH_ORDER = ("moe", "attention", "router", "rope", "quant", "inductor", "dense")
OTHER = "other"
# The decode table's rows are these kinds always (a zero where none ran), then any other kind that ran.
DECODE_ROWS = ("dense", "moe", "attention", "router", "rope", "inductor")


def classify(kernel: str) -> str:
    """The key of the kind `kernel` (a profiler's kernel name) belongs to, else `OTHER`."""
    return next((key for key in MATCH_ORDER if BY_KEY[key].matches(kernel)), OTHER)


# Qwen3-30B-A3B widths (moefx.models.qwen3_moe_config): hidden, head dim, query and KV heads, experts, expert width,
# experts per token, vocabulary.
QWEN3_30B = {"hidden": 2048, "head_dim": 128, "heads": 32, "kv_heads": 4, "experts": 128, "moe_intermediate": 768,
             "top_k": 8, "vocab": 151936}
# bytes per weight: bf16, and FP8 block-128 (one byte, plus an fp32 scale per 128 x 128 block)
WEIGHT_BYTES = {"bf16": 2.0, "fp8_block128": 1.0 + 4.0 / (128 * 128)}


def layer_weights(c: dict[str, int] = QWEN3_30B) -> dict[str, float]:
    """Weights per layer: q/k/v/o (`attn`), the router (`router`, never quantized), one expert's three matrices."""
    h, d, q, kv = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"]
    return {"attn": h * (q + 2 * kv) * d + q * d * h, "router": h * c["experts"],
            "expert": 3 * c["moe_intermediate"] * h}


ONCE = "once"  # the prefill table's bucket of kernels that run once per forward (embedding, LM head, sampling)


def prefill_floors(batch: int, tokens: int, layers: int, hit: float,
                   c: dict[str, int] = QWEN3_30B) -> dict[str, tuple[float, float]]:
    """(bytes, FLOPs) each part of a bf16 forward over `batch` prompts of `tokens` tokens must move and compute
    (last-position logits only), summed over `layers` layers: weights read once, activations read and written
    once at the part's edges (the least any kernel split must move), causal attention FLOPs; `hit`: the distinct
    experts per layer the prompts route to. Parts without FLOPs worth a floor (norms, RoPE, routing) have 0."""
    n = batch * tokens
    h, d, q, kv, e = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"], c["experts"]
    w = layer_weights(c)
    qkv = (q + 2 * kv) * d
    return {
        "dense": (layers * (2 * (w["attn"] + w["router"]) + 2 * n * (h + qkv + q * d + h + h) + 4 * n * e),
                  layers * 2 * n * (w["attn"] + w["router"])),
        "moe": (layers * (2 * hit * w["expert"] + 2 * n * 2 * h), layers * 2 * n * c["top_k"] * w["expert"]),
        "attention": (layers * 2 * n * (qkv + q * d), layers * batch * 2 * 2 * q * d * tokens * tokens / 2),
        "rope": (layers * 2 * n * 2 * qkv, 0.0),  # q/k/v read, q/k rotated and k/v cached written
        "router": (layers * 4 * n * e, 0.0),  # the router's fp32 logits read once
        "inductor": (layers * 2 * n * h * 2 * 4, 0.0),  # two norms: input and residual read, sum and norm written
        ONCE: (2 * (c["vocab"] * h + n * h), 2 * batch * c["vocab"] * h),  # LM head (one row a prompt), embedding
    }
