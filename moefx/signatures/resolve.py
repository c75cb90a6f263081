"""resolve(): combine providers, user rules, env and the user's config into a Plan (fails closed)."""

from __future__ import annotations

from typing import Any

from moefx.signatures.execution import ExecutionSignature
from moefx.signatures.model import ModelSignature
from moefx.signatures.plan import PassDecision, Plan


def resolve(ms: ModelSignature, es: ExecutionSignature, config: Any = None) -> Plan:
    from moefx.backends.policy import moe_plan
    from moefx.config import CompilationConfig
    from moefx.offload.plan import offload_plan
    from moefx.passes import PASS_REGISTRY

    cfg = CompilationConfig.from_any(config)
    plan = Plan(model=ms, execution=es, profile="unknown")
    for name in PASS_REGISTRY:
        user = getattr(cfg.pass_config, name)
        if user is not None:
            plan.passes[name] = PassDecision(True, False, user, "user config")
        else:
            plan.passes[name] = PassDecision(True, False, False, "default off", "no provider matched")
    plan.moe = moe_plan(ms, es, cfg)
    plan.offload = offload_plan(ms, es, cfg)
    return plan
