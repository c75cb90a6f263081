"""Post-grad FX passes. Importing this package registers every pass by its toggle name."""

from moefx.passes import (
    dense_linears,  # noqa: F401
    eliminate_noops,  # noqa: F401
    fuse_act_quant,  # noqa: F401
    fuse_moe_residual,  # noqa: F401
    fuse_moe_routing,  # noqa: F401
    fuse_norm_linear,  # noqa: F401
    fuse_norm_quant,  # noqa: F401
    fuse_qk_norm_rope,  # noqa: F401
    fuse_router_topk,  # noqa: F401
    fuse_sibling_linears,  # noqa: F401
    last_token_logits,  # noqa: F401
    rewrite_sampler_syncs,  # noqa: F401
)
from moefx.passes.base import PASS_REGISTRY, MoefxPass, PassContext, register_pass
from moefx.passes.manager import PassManager

__all__ = ["PASS_REGISTRY", "MoefxPass", "PassContext", "PassManager", "register_pass"]
