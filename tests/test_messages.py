"""What a user reads: errors name the bad value and the valid choices, explain() says exactly what happens."""

from __future__ import annotations

import pytest

from moefx.config import CompilationConfig
from moefx.models.catalog import catalog_config
from moefx.signatures import ExecutionSignature, ModelSignature, resolve


@pytest.mark.parametrize(
    "data, fragments",
    [({"mode": 3}, ["'mode'", "got 3", "valid choices: ['eager', 'compile', 'capture']"]),
     ({"moe_backend": None}, ["'moe_backend'", "got None", "valid choices"])],
)
def test_a_non_string_enum_value_lists_the_choices(data: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        CompilationConfig.from_any(data)
    assert all(f in str(err.value) for f in fragments), str(err.value)


@pytest.mark.parametrize(
    "override, fragments",
    [("pass_confg.x=1", ["'pass_confg' is not a config section", "['offload', 'pass_config']",
                         "did you mean 'pass_config'"]),
     ("offload.exprts.x=1", ["'offload.exprts' is not a config section", "offload has no sections",
                             "its keys: ['experts']"])],
)
def test_an_override_into_a_missing_section_lists_the_sections(override: str, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        CompilationConfig().with_overrides([override])
    assert all(f in str(err.value) for f in fragments), str(err.value)


def test_offload_env_values_are_validated_with_offload_off(monkeypatch: pytest.MonkeyPatch) -> None:
    ms, es = ModelSignature.from_config(catalog_config("tiny-qwen3-moe")), ExecutionSignature(dtype="float32")
    monkeypatch.setenv("MOEFX_OFFLOAD_STAGE_TILE_E", "many")
    with pytest.raises(ValueError, match=r"MOEFX_OFFLOAD_STAGE_TILE_E='many' is invalid: expected an integer >= 1"):
        resolve(ms, es)  # offload is off (the default): the typo still fails now
    monkeypatch.setenv("MOEFX_OFFLOAD_STAGE_TILE_E", "48")
    assert resolve(ms, es).offload.experts == "gpu"


def test_explain_says_what_runs_on_a_cpu_without_calibration(isolated_moe_tables) -> None:
    plan = resolve(ModelSignature.from_config(catalog_config("tiny-qwen3-moe")), ExecutionSignature(dtype="float32"))
    text = plan.explain()
    assert "moe backend = auto  [no calibration row matched: upstream for every M]" in text
    assert "offload experts = with the model on cpu (not offloaded)  [default]" in text
    assert "dtype=float32 [config 'dtype']" in text
    unknown = resolve(ModelSignature.from_config({}), ExecutionSignature()).explain()
    assert "profile = unknown  [the config states no model_type]" in unknown and "None" not in unknown.split("\n")[2]


def test_offload_gpu_on_a_cpu_model_says_the_experts_stay_with_the_model(monkeypatch) -> None:
    ms, es = ModelSignature.from_config(catalog_config("tiny-qwen3-moe")), ExecutionSignature(dtype="float32")
    monkeypatch.delenv("MOEFX_OFFLOAD_EXPERTS", raising=False)
    with pytest.warns(UserWarning, match=r"offload experts 'gpu' \(user config\) has no GPU to use: the model runs "
                                         r"on cpu, so its experts stay where the model is"):
        plan = resolve(ms, es, {"offload": {"experts": "gpu"}})
    assert plan.offload.experts == "gpu"
    assert "offload note: offload experts 'gpu' (user config) has no GPU to use" in plan.explain()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = resolve(ms, es)  # not asked for: nothing to warn about
    assert "offload note" not in default.explain()
