"""What a provider contributes to a plan (`PlanFragment`), and the preferred pass defaults every MoE causal-LM
provider shares (one place, so families agree)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moefx.facts.execution import ExecutionSignature
from moefx.facts.model import ModelSignature


@dataclass
class PlanFragment:
    """What a provider contributes: preferred pass defaults (name -> (on, why)) and family facts."""

    provider: str
    preferred: dict[str, tuple[bool, str]] = field(default_factory=dict)
    moe_family: bool = True
    causal_lm: bool = True
    notes: list[str] = field(default_factory=list)


# Activation formats the fused quant kernels produce (docs/FUSIONS.md), with dynamic (per-call) scales.
FUSED_QUANT_ACT_DTYPES = ("float8_e4m3fn", "int8")


def quant_preference(ms: ModelSignature, es: ExecutionSignature) -> tuple[bool, str]:
    if ms.quant_act_dtype not in FUSED_QUANT_ACT_DTYPES:
        return False, f"activations are not quantized to {list(FUSED_QUANT_ACT_DTYPES)} (quant={ms.quant_method})"
    if ms.quant_act_scheme != "dynamic":
        return False, f"activation scales are {ms.quant_act_scheme!r}, the fused kernels compute dynamic scales"
    if es.device_type != "cuda":
        return False, f"fused quant kernels are for CUDA, device is {es.device_type}"
    return True, f"{ms.quant_method} {ms.quant_act_dtype} dynamic activations on CUDA"


def causal_lm_preference(ms: ModelSignature, es: ExecutionSignature, gain: str) -> tuple[bool, str]:
    if not ms.is_causal_lm:
        return False, f"architectures {list(ms.architectures)} name no *ForCausalLM head"
    if es.device_type != "cuda":
        return False, f"{gain} pays off on CUDA, device is {es.device_type}"
    return True, f"causal LM on CUDA: {gain}"


# Router kinds moefx::fused_topk computes (softmax group-limited greedy, DeepSeek-V2's, is not one).
FUSED_ROUTINGS = ("softmax", "sigmoid_bias", "sigmoid_bias_group_topk")


def routing_preference(ms: ModelSignature, es: ExecutionSignature) -> tuple[bool, str]:
    if ms.routing not in FUSED_ROUTINGS:
        return False, f"routing {ms.routing!r} is not one the fused kernel computes ({list(FUSED_ROUTINGS)})"
    return causal_lm_preference(
        ms, es, f"{ms.routing} routing in one kernel (at decode torch.topk alone takes longer than the whole "
                f"fused op: docs/FINDINGS.md)"
    )


def dense_preference(ms: ModelSignature, es: ExecutionSignature) -> tuple[bool, str]:
    """The dense-linear passes pay off where a calibration row runs the small-M GEMV for one of the model's
    projections on this device; elsewhere every call they emit would run upstream, one custom-op call more."""
    on, why = causal_lm_preference(ms, es, "the dense GEMV for q/k/v and single projections at decode M")
    if not on:
        return on, why
    from moefx.backends.dense_policy import has_rows_for

    return has_rows_for(ms, es)


def fp8_weight_only_preference(ms: ModelSignature, es: ExecutionSignature) -> tuple[bool, str]:
    """On where the dense policy runs: on the H100 the weight-only decode form beat W8A8 (its quant kernel + GEMV)
    at M = 1, 2 and 4 in one process, 1.16-2.41x, and decoded 8 layers at batch 1 no slower (docs/DENSE.md)."""
    if ms.quant_act_dtype != "float8_e4m3fn":
        return False, f"no FP8 activation quant to drop (quant={ms.quant_method})"
    on, why = dense_preference(ms, es)
    if not on:
        return on, why
    return True, "FP8 decode linears read their float input (no activation-quant kernel; faster than W8A8 at M <= 4)"


def moe_causal_lm_fragment(provider: str, ms: ModelSignature, es: ExecutionSignature) -> PlanFragment:
    quant = quant_preference(ms, es)
    dense = dense_preference(ms, es)
    return PlanFragment(
        provider=provider,
        preferred={
            "eliminate_noops": (True, f"known MoE family {ms.family}"),
            "fuse_act_quant": quant,
            "fuse_norm_quant": quant,
            "rewrite_sampler_syncs": causal_lm_preference(ms, es, "removing sampler host syncs"),
            "last_token_logits": causal_lm_preference(ms, es, "skipping LM-head rows nobody reads"),
            "fuse_moe_routing": routing_preference(ms, es),
            "fuse_moe_residual": causal_lm_preference(
                ms, es, "the MoE block's residual add in the experts' down kernel (one kernel per layer less)"),
            "fuse_qk_norm_rope": causal_lm_preference(
                ms, es, "q/k norm + RoPE + KV-cache write in one kernel (two kernels per layer less)"),
            "fuse_sibling_linears": dense,
            "dense_linears": dense,
            "fuse_norm_linear": dense,
            "fuse_router_topk": dense,
            "fp8_weight_only": fp8_weight_only_preference(ms, es),
        },
        moe_family=True,
        causal_lm=ms.is_causal_lm,
    )
