"""resolve(): combine providers, user rules, env and the user's config into a Plan (fails closed).

Per pass, the first layer that has a word decides:
  user config  >  MOEFX_PASSES (env)  >  first matching rule  >  provider's preferred default  >  off.
A pass is only ever enabled where its `unsupported_reason(ms, es)` is None. An explicit request (config,
env or rule) for an unsupported pass warns once and stays off; with `strict` it is an error. Any env
value that changes what the plan would have done warns once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moefx.facts.execution import ExecutionSignature
from moefx.facts.model import ModelSignature
from moefx.log import warn_once
from moefx.planner.pass_overrides import PASSES_ENV, pass_overrides
from moefx.planner.plan import PassDecision, Plan
from moefx.planner.preferences import PlanFragment
from moefx.planner.registry import match
from moefx.planner.rules import Rule, first_match, load_rules
from moefx.planner.serving import serving_hints


def _state(on: bool) -> str:
    return "on" if on else "off"


def _plan_layer(name: str, fragment: PlanFragment | None, rule: Rule | None) -> tuple[bool, str, str, bool]:
    """(on, source, why, explicit) from the first matching rule, else the provider, else off."""
    if rule is not None and name in rule.passes:
        return rule.passes[name], rule.label, "set by rule", True
    if fragment is None:
        return False, "default off", "profile unknown: no fast paths", False
    source = f"provider {fragment.provider}"
    if name in fragment.preferred:
        on, why = fragment.preferred[name]
        return on, source, why, False
    return False, source, "provider has no preference for this pass", False


def _explicit(name: str, on: bool, source: str, unsupported: str | None, preferred: bool, strict: bool) -> PassDecision:
    if on and unsupported is not None:
        message = f"pass {name} was requested by {source} but is unsupported here ({unsupported}); it stays off"
        if strict:
            raise ValueError(message + " [strict=True]")
        warn_once(message)
        return PassDecision(False, preferred, False, source, f"requested but unsupported: {unsupported}")
    return PassDecision(unsupported is None, preferred, on, source, "explicit request")


def _decide(
    name: str, pass_cls: Any, ms: ModelSignature, es: ExecutionSignature, cfg: Any,
    fragment: PlanFragment | None, rule: Rule | None, env: dict[str, bool],
) -> PassDecision:
    unsupported = pass_cls.unsupported_reason(ms, es)
    plan_on, plan_source, plan_why, plan_explicit = _plan_layer(name, fragment, rule)
    preferred = plan_on
    plan_enabled = plan_on and unsupported is None
    user, env_on = getattr(cfg.pass_config, name, None), env.get(name)
    if user is not None:
        if env_on is not None and env_on != user:
            warn_once(f"{PASSES_ENV} sets {name}={_state(env_on)} but the user config says {_state(user)}; config wins")
        return _explicit(name, user, "user config", unsupported, preferred, cfg.strict)
    if env_on is not None:
        decision = _explicit(name, env_on, f"env {PASSES_ENV}", unsupported, preferred, cfg.strict)
        if decision.enabled != plan_enabled:
            warn_once(
                f"{PASSES_ENV} turns pass {name} {_state(decision.enabled)}; "
                f"the plan says {_state(plan_enabled)} [{plan_source}]"
            )
        return decision
    if plan_explicit:
        return _explicit(name, plan_on, plan_source, unsupported, preferred, cfg.strict)
    if plan_on and unsupported is not None:
        return PassDecision(False, True, False, plan_source, f"preferred but unsupported: {unsupported}")
    return PassDecision(unsupported is None, preferred, plan_enabled, plan_source, plan_why)


def _tp_fits(ms: ModelSignature, tp: int) -> bool:
    """Whether tensor parallelism over `tp` ranks splits this model: its attention heads, its KV heads (or each KV
    head replicated over tp / kv ranks) and its experts' intermediate size."""
    heads, kv, inter = ms.num_heads, ms.num_kv_heads, ms.moe_intermediate_size or ms.intermediate_size
    return ((heads is None or heads % tp == 0) and (kv is None or kv % tp == 0 or tp % kv == 0)
            and (inter is None or inter % tp == 0))


def check_parallel_sizes(ms: ModelSignature, es: ExecutionSignature) -> None:
    """ValueError naming the size and the sizes that fit where tp_size / ep_size do not divide the model."""
    if es.tp_size > 1 and not _tp_fits(ms, es.tp_size):
        valid = [t for t in range(1, 65) if _tp_fits(ms, t)]
        raise ValueError(f"tp_size {es.tp_size} does not divide the model (attention heads {ms.num_heads}, KV heads "
                         f"{ms.num_kv_heads}, expert intermediate size {ms.moe_intermediate_size}); valid tp sizes "
                         f"up to 64: {valid}")
    experts = ms.num_experts
    if es.ep_size > 1 and experts and experts % es.ep_size:
        valid = [e for e in range(1, min(experts, 64) + 1) if experts % e == 0]
        raise ValueError(f"ep_size {es.ep_size} does not divide the model's {experts} experts; valid ep sizes: {valid}")


def resolve(
    ms: ModelSignature | Any,
    es: ExecutionSignature | None = None,
    config: Any = None,
    *,
    rules: Sequence[Rule] | None = None,
) -> Plan:
    """The Plan for `ms` on `es` (default: this machine). `rules` are checked before the config's rule files."""
    from moefx.backends.dense_policy import dense_plan
    from moefx.backends.policy import moe_plan
    from moefx.config import CompilationConfig
    from moefx.offload.plan import offload_plan
    from moefx.passes import PASS_REGISTRY

    cfg = CompilationConfig.from_any(config)
    if not isinstance(ms, ModelSignature):
        ms = ModelSignature.from_config(ms)
    if es is None:
        es = ExecutionSignature.detect(mode=cfg.mode, max_batch_size=cfg.max_batch_size)
    ms = ms.with_dtype(es.dtype, "execution signature")  # the run's stated compute dtype, where the config has none
    check_parallel_sizes(ms, es)
    env = pass_overrides()
    fragment, why = match(ms, es)
    all_rules = [*(rules or ()), *(r for path in cfg.rules for r in load_rules(path))]
    rule = first_match(all_rules, ms, es)

    plan = Plan(model=ms, execution=es, profile=fragment.provider if fragment else "unknown", profile_reason=why)
    plan.rule = rule.label if rule is not None else None
    for name, cls in PASS_REGISTRY.items():  # pipeline order
        plan.passes[name] = _decide(name, cls, ms, es, cfg, fragment, rule, env)
    requested = set(env) | set(rule.passes if rule is not None else ())
    for name in sorted(requested - set(PASS_REGISTRY)):
        warn_once(f"pass {name} is set by {PASSES_ENV} or a rule but no pass of that name is registered; ignored")

    pins = {**rule.moe, "source": rule.label} if rule is not None and rule.moe else None
    if pins is None and fragment is None:
        # Fail closed: an unmatched model keeps its own experts code unless the user forces a backend.
        pins = {"backend": "upstream", "source": f"profile unknown ({why})"}
    plan.moe = moe_plan(ms, es, cfg, pins=pins)
    plan.dense = dense_plan(ms, es, cfg)
    plan.offload = offload_plan(ms, es, cfg)
    plan.serving, plan.serving_sources = serving_hints(ms, es, cfg, fragment)
    return plan
