"""The env knob table (docs/OFFLOAD.md):
defaults, aliases (warn once, value kept), conflicts and bad values raise, settings()."""

import warnings

import pytest

import moefx.offload as offload
from moefx.offload import SETTINGS

SPEC_ROWS = {
    "MOEFX_OFFLOAD_EXPERTS": ("gpu", {"VLLM_EXPERTS_LOAD_DEVICE"}),
    "MOEFX_OFFLOAD_INT8": (None, {"XIAOTU_MOE_INT8", "XIAOTU_MOE_W4A8"}),
    "MOEFX_OFFLOAD_INT8_ALIGN": (True, {"XIAOTU_MOE_INT8_ALIGN"}),
    "MOEFX_OFFLOAD_INT8_VNNI": (False, {"XIAOTU_MOE_INT8_VNNI"}),
    "MOEFX_OFFLOAD_INT8_VNNI_MIN_TOKENS": (160, {"XIAOTU_MOE_INT8_VNNI_MIN_TOKENS", "XIAOTU_MOE_I8_MIN_M"}),
    "MOEFX_OFFLOAD_STAGE_TILE_E": (96, {"XIAOTU_GPF_STAGE_TILE_E"}),
    "MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS": (None, {"VLLM_XIAOTU_GPU_PREFILL_MIN_TOKENS"}),
    "MOEFX_MOE_BACKEND": ("auto", set()),
    "MOEFX_DENSE_BACKEND": ("auto", set()),
    "MOEFX_MEMORY_BUDGET": (None, set()),
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for s in SETTINGS:
        for var in (s.name, *s.aliases):
            monkeypatch.delenv(var, raising=False)


def test_table_matches_spec_and_defaults():
    assert {s.name: (s.default, set(s.aliases)) for s in SETTINGS} == SPEC_ROWS
    assert offload.settings() == {name: default for name, (default, _) in SPEC_ROWS.items()}


@pytest.mark.parametrize(
    "name,var,raw,value",
    [
        ("MOEFX_OFFLOAD_EXPERTS", "MOEFX_OFFLOAD_EXPERTS", "cpu", "cpu"),
        ("MOEFX_OFFLOAD_EXPERTS", "VLLM_EXPERTS_LOAD_DEVICE", "cuda", "gpu"),
        ("MOEFX_OFFLOAD_INT8", "XIAOTU_MOE_W4A8", "1", True),
        ("MOEFX_OFFLOAD_INT8", "MOEFX_OFFLOAD_INT8", "off", False),
        ("MOEFX_OFFLOAD_INT8_VNNI_MIN_TOKENS", "XIAOTU_MOE_I8_MIN_M", "32", 32),
        ("MOEFX_OFFLOAD_STAGE_TILE_E", "XIAOTU_GPF_STAGE_TILE_E", "48", 48),
        ("MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS", "VLLM_XIAOTU_GPU_PREFILL_MIN_TOKENS", "0", 0),
        ("MOEFX_MOE_BACKEND", "MOEFX_MOE_BACKEND", "reference", "reference"),
        ("MOEFX_MOE_BACKEND", "MOEFX_MOE_BACKEND", "legacy", "reference"),  # the reference backend's former name
    ],
)
def test_values_and_aliases(monkeypatch, name, var, raw, value):
    monkeypatch.setenv(var, raw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert offload.get_setting(name) == value
        assert offload.settings()[name] == value
    alias_warnings = [w for w in caught if "is an alias of" in str(w.message)]
    assert bool(alias_warnings) == (var != name)
    assert offload.setting_source(name) == f"env {var}"


def test_alias_warns_once(monkeypatch):
    monkeypatch.setenv("XIAOTU_MOE_INT8_ALIGN", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert offload.get_setting("MOEFX_OFFLOAD_INT8_ALIGN") is False
    # once per process (conftest gives each test a fresh process's record): exactly one warning
    assert len([w for w in caught if "XIAOTU_MOE_INT8_ALIGN" in str(w.message)]) == 1


@pytest.mark.parametrize(
    "var,raw",
    [
        ("MOEFX_OFFLOAD_EXPERTS", "disk"),
        ("XIAOTU_MOE_INT8", "maybe"),
        ("MOEFX_OFFLOAD_STAGE_TILE_E", "0"),
        ("XIAOTU_MOE_I8_MIN_M", "many"),
        ("MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS", "-1"),
        ("MOEFX_MOE_BACKEND", "fastest"),
    ],
)
def test_bad_value_names_variable(monkeypatch, var, raw):
    monkeypatch.setenv(var, raw)
    with pytest.raises(ValueError, match=var):
        offload.settings()


def test_conflicting_alias_and_canonical(monkeypatch):
    monkeypatch.setenv("MOEFX_OFFLOAD_INT8", "1")
    monkeypatch.setenv("XIAOTU_MOE_INT8", "0")
    with pytest.raises(ValueError, match="conflicting values for MOEFX_OFFLOAD_INT8"):
        offload.get_setting("MOEFX_OFFLOAD_INT8")
    monkeypatch.setenv("XIAOTU_MOE_INT8", "true")  # same value spelled differently is no conflict
    assert offload.get_setting("MOEFX_OFFLOAD_INT8") is True


def test_unknown_setting_name():
    with pytest.raises(ValueError, match="valid names"):
        offload.get_setting("MOEFX_OFFLOAD_TURBO")
