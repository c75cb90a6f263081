"""YAML rules: schema validation with file and index, operators, first match wins, pins reach the MoE plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import moefx.log
from moefx.models.catalog import catalog_config
from moefx.planner.rules import first_match, parse_rule
from moefx.signatures import ExecutionSignature, ModelSignature, load_rules, resolve

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rules.yaml"
QWEN = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))
DS = ModelSignature.from_config(catalog_config("deepseek-v3"))
H200 = ExecutionSignature.preset("h200", mode="capture", max_batch_size=64, dtype="bfloat16", cpu_isa=("avx2",))


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moefx.log, "_warned", set())
    for var in ("MOEFX_PASSES", "MOEFX_MOE_BACKEND", "MOEFX_USE_GEMV"):
        monkeypatch.delenv(var, raising=False)


def _write(tmp_path: Path, rules: object) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "rules": rules}))
    return path


def _rule(match: dict, **rest: object):
    return parse_rule({"match": match, **(rest or {"passes": {"eliminate_noops": False}})}, "t.yaml", 0)


def test_example_file_loads_and_pins_capture_ranges() -> None:
    rules = load_rules(EXAMPLE)
    assert [r.name for r in rules] == ["qwen3-hopper-decode", "fp8-block-fused-quant", "big-expert-count-amx-host"]
    plan = resolve(QWEN, H200, {"rules": [str(EXAMPLE)]})
    assert plan.rule is not None and plan.rule.endswith("#0 (qwen3-hopper-decode)")
    capture = plan.moe.policies["capture"]
    assert [capture.backend_for(m) for m in (1, 16, 17, 512)] == ["gemv", "gemv", "grouped", "grouped"]
    assert "qwen3-hopper-decode" in capture.source
    assert "qwen3-hopper-decode" not in plan.moe.policies["eager"].source  # the pin is capture-only
    assert "qwen3-hopper-decode" in plan.explain()


def test_example_rule_for_fp8_block_checkpoints() -> None:
    rules = load_rules(EXAMPLE)
    assert first_match(rules, DS, H200) is rules[1]
    assert first_match(rules, DS, H200.replace(device_type="cpu", device_name=None)) is None
    amx = H200.replace(device_type="cpu", device_name=None, cpu_isa=("avx512f", "amx_int8"))
    assert first_match(rules, DS, amx) is rules[2]


def test_first_match_wins(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        {"match": {"family": "qwen3_moe"}, "passes": {"eliminate_noops": False}},
        {"match": {"model_type": "qwen3_moe"}, "passes": {"eliminate_noops": True}},
    ])
    rules = load_rules(path)
    assert first_match(rules, QWEN, H200) is rules[0]
    plan = resolve(QWEN, H200, {"rules": [str(path)]})
    assert not plan.pass_enabled("eliminate_noops")
    assert plan.passes["eliminate_noops"].source == f"rule {path}#0"


def test_rules_argument_comes_before_config_files(tmp_path: Path) -> None:
    path = _write(tmp_path, [{"match": {"family": "qwen3_moe"}, "passes": {"eliminate_noops": True}}])
    first = _rule({"family": "qwen3_moe"})
    plan = resolve(QWEN, H200, {"rules": [str(path)]}, rules=[first])
    assert plan.rule == "rule t.yaml#0" and not plan.pass_enabled("eliminate_noops")


@pytest.mark.parametrize(
    "match, hits",
    [
        ({"num_experts": {"min": 128, "max": 128}}, True),
        ({"num_experts": {"min": 129}}, False),
        ({"max_batch_size": {"max": 63}}, False),
        ({"device_name": {"regex": "H200$"}}, True),
        ({"device_name": {"regex": "^H200"}}, False),
        ({"model_type": {"in": ["mixtral", "qwen3_moe"]}}, True),
        ({"model.dtype": "bfloat16", "execution.dtype": "bfloat16"}, True),
        ({"capability": [9, 0]}, True),
        ({"capability": [8, 0]}, False),
        ({"cpu_isa": "avx2"}, True),
        ({"cpu_isa": "amx_int8"}, False),
        ({"architectures": "Qwen3MoeForCausalLM"}, True),
        ({"quant_method": None}, True),  # explicit null matches "not quantized"
        ({"kv_lora_rank": {"min": 0}}, False),  # unknown facts never satisfy a condition
        ({"norm_topk_prob": True, "routing": "softmax"}, True),
    ],
)
def test_operators(match: dict, hits: bool) -> None:
    assert _rule(match).matches(QWEN, H200) is hits


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"match": {"family": "qwen3_moe"}, "passes": {"eliminate_noops": True}, "extra": 1}, "unknown rule keys"),
        ({"passes": {"eliminate_noops": True}}, "'match' must be"),
        ({"match": {"family": "qwen3_moe"}}, "'passes' and/or 'moe'"),
        ({"match": {"famly": "x"}, "passes": {"eliminate_noops": True}}, "not a signature field"),
        ({"match": {"dtype": "bfloat16"}, "passes": {"eliminate_noops": True}}, "both signatures"),
        ({"match": {"gpu.device_name": "x"}, "passes": {"eliminate_noops": True}}, "prefix"),
        ({"match": {"num_experts": {"between": [1, 2]}}, "passes": {"eliminate_noops": True}}, "unknown operator"),
        ({"match": {"num_experts": {"min": "8"}}, "passes": {"eliminate_noops": True}}, "must be a number"),
        ({"match": {"device_name": {"regex": "("}}, "passes": {"eliminate_noops": True}}, "bad regex"),
        ({"match": {"family": "qwen3_moe"}, "passes": {"fuse_everything": True}}, "unknown pass"),
        ({"match": {"family": "qwen3_moe"}, "passes": {"eliminate_noops": "yes"}}, "true or false"),
        ({"match": {"family": "qwen3_moe"}, "moe": {"backend": "fast"}}, "moe backend 'fast' is invalid"),
        ({"match": {"family": "qwen3_moe"}, "moe": {"backend": "gemv", "ranges": "gemv@1-"}}, "'moe' must be"),
        ({"match": {"family": "qwen3_moe"}, "moe": {"ranges": "gemv@1-16,grouped@18-"}}, "starts at M=18"),
        ({"match": {"family": "qwen3_moe"}, "moe": {"ranges": "warp@1-"}}, "unknown backends"),
        ({"match": {"family": "qwen3_moe"}, "moe": {"backend": "gemv", "mode": "compile"}}, "moe mode"),
        ("just a string", "must be a mapping"),
        ({"match": {"device_type": "gpu"}, "passes": {"eliminate_noops": True}},
         r"'gpu' is no value an ExecutionSignature can hold, so the rule would never match; valid choices: "
         r"\['cpu', 'cuda'"),
        ({"match": {"mode": {"in": ["capture", "graphs"]}}, "passes": {"eliminate_noops": True}},
         r"'graphs' is no value.*'capture'"),
    ],
)
def test_malformed_rule_names_file_and_index(tmp_path: Path, rule: object, message: str) -> None:
    good = {"match": {"family": "qwen3_moe"}, "passes": {"eliminate_noops": True}}
    path = _write(tmp_path, [good, rule])
    with pytest.raises(ValueError, match=message) as info:
        load_rules(path)
    assert f"{path}: rules[1]" in str(info.value)


@pytest.mark.parametrize(
    "text, message",
    [("rules: {}", "'rules' list"), ("version: 2\nrules: []", r"version 2 is not supported; valid versions: \[1\]"),
     ("rules: []\nrule: []", r"unknown top-level keys \['rule'\]; valid keys"), ("rules: [", "not valid YAML"),
     ("- a", "'rules' list")],
)
def test_malformed_rule_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_rules(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_rules(tmp_path / "missing.yaml")


def test_rule_can_enable_a_pass_for_an_unknown_model() -> None:
    rule = _rule({"model_type": "llama"}, passes={"eliminate_noops": True}, moe={"backend": "upstream"})
    plan = resolve(ModelSignature(model_type="llama"), H200, rules=[rule])
    assert plan.profile == "unknown" and plan.pass_enabled("eliminate_noops")
    assert plan.moe.policies["eager"].source == "rule t.yaml#0"


def test_rule_file_content_is_part_of_the_config_hash(tmp_path: Path) -> None:
    from moefx.config import CompilationConfig

    path = _write(tmp_path, [{"match": {"family": "qwen3_moe"}, "passes": {"eliminate_noops": True}}])
    before = CompilationConfig.from_any({"rules": [str(path)]}).compute_hash()
    _write(tmp_path, [{"match": {"family": "qwen3_moe"}, "passes": {"eliminate_noops": False}}])
    assert CompilationConfig.from_any({"rules": [str(path)]}).compute_hash() != before


def test_a_rule_on_a_family_no_provider_declares_warns_with_the_families(tmp_path: Path) -> None:
    path = _write(tmp_path, [{"match": {"family": "qwen3-moe"}, "passes": {"eliminate_noops": True}}])
    with pytest.warns(UserWarning, match=r"rules\[0\]: match key 'family': no registered provider has family "
                                         r"'qwen3-moe', so the rule matches only a hand-written signature that "
                                         r"states it; registered families: \[.*'qwen3_moe'.*\]; did you mean "
                                         r"'qwen3_moe'\?"):
        (rule,) = load_rules(path)
    assert not rule.matches(QWEN, H200)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_rules(_write(tmp_path, [{"match": {"family": {"in": ["qwen3_moe", "mixtral"]}},
                                      "passes": {"eliminate_noops": True}}]))  # registered families: silent
