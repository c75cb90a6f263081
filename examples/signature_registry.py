"""The signature registry: plan for a machine you are not on, add a provider, pin a backend with a YAML rule.

    python examples/signature_registry.py

Runs anywhere (no GPU, no download): the model is a published config from moefx's catalog and the machine is a
named preset, so the plan is the one moefx would make on an H200.
"""

from __future__ import annotations

from pathlib import Path

from moefx.models.catalog import catalog_config
from moefx.signatures import ExecutionSignature, ModelSignature, Provider, register_provider, resolve

RULES = Path(__file__).with_name("rules.yaml")


def plan_for_h200() -> str:
    # [readme:plan]
    ms = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))  # or a config.json, a folder, an HF config
    es = ExecutionSignature.preset("h200", mode="capture", max_batch_size=64)  # the machine: named, not detected
    plan = resolve(ms, es, {"rules": [str(RULES)]})
    print(plan.explain())  # every decision and who made it: provider, rule, calibration row, or why not
    # [/readme]
    return plan.explain()


# [readme:provider]
@register_provider
class MyMoe(Provider):
    """A new family: softmax top-k routing, no shared experts (the built-in MoE causal-LM pass defaults)."""

    name = "my_moe"
    family = "my_moe"
    model_types = ("my_moe",)  # exactly these model_types; anything else stays on the plain path

    @classmethod
    def implied(cls, get):  # facts the architecture fixes, for keys its config.json leaves out
        return {"routing": "softmax", "num_shared_experts": 0, "first_dense_layers": 0}
# [/readme]


def plan_for_new_family() -> str:
    config = {**catalog_config("qwen3-30b-a3b"), "model_type": "my_moe", "architectures": ["MyMoeForCausalLM"]}
    plan = resolve(ModelSignature.from_config(config), ExecutionSignature.preset("h200", mode="capture"))
    print(plan.explain())
    return plan.explain()


def plan_unknown_family() -> str:
    """Fail closed: a model_type no provider declares gets the plain path, and the plan says why."""
    config = {**catalog_config("qwen3-30b-a3b"), "model_type": "somebody_elses_moe"}
    plan = resolve(ModelSignature.from_config(config), ExecutionSignature.preset("h200"))
    print(plan.explain())
    return plan.explain()


def main() -> None:
    print("== Qwen3-30B-A3B planned for an H200, with examples/rules.yaml")
    text = plan_for_h200()
    assert "qwen3-hopper-decode" in text, "the YAML rule should match an H200 in capture mode"
    print("\n== a family registered by the example's provider")
    assert "my_moe" in plan_for_new_family()
    print("\n== a family nobody registered")
    assert "profile = unknown" in plan_unknown_family()


if __name__ == "__main__":
    main()
