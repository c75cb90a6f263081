"""ExecutionSignature detection/validation, provider registration, and the `moefx plan` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import moefx.log
from moefx.cli import main
from moefx.facts import execution as execution_mod
from moefx.models.catalog import catalog_config
from moefx.planner.registry import PROVIDERS
from moefx.signatures import ExecutionSignature, ModelSignature, Provider, register_provider, resolve


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moefx.log, "_warned", set())
    for var in ("MOEFX_PASSES", "MOEFX_MOE_BACKEND", "MOEFX_USE_GEMV"):
        monkeypatch.delenv(var, raising=False)


def test_cpu_isa_and_numa_are_read_from_the_system_files(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_int8 amx_tile\n\nprocessor\t: 1\n")
    assert execution_mod.read_cpu_isa(cpuinfo) == ("avx2", "avx512f", "amx_int8")
    assert execution_mod.read_cpu_isa(tmp_path / "missing") == ()
    nodes = tmp_path / "node"
    for name in ("node0", "node1", "possible", "has_cpu"):
        (nodes / name).mkdir(parents=True)
    assert execution_mod.count_numa_nodes(nodes) == 2
    assert execution_mod.count_numa_nodes(tmp_path / "none") == 1


def test_detect_fills_this_machine() -> None:
    es = ExecutionSignature.detect(device="cpu", mode="eager", max_batch_size=8, dtype="bf16")
    assert (es.device_type, es.mode, es.max_batch_size, es.dtype) == ("cpu", "eager", 8, "bfloat16")
    assert es.numa_nodes >= 1 and set(es.cpu_isa) <= set(execution_mod.CPU_ISA_FLAGS)
    assert es.torch_version


@pytest.mark.parametrize(
    "fields, message",
    [({"mode": "fast"}, "mode"), ({"device_type": "gpu"}, "device_type"), ({"tp_size": 0}, "tp_size"),
     ({"max_batch_size": True}, "max_batch_size"), ({"cpu_isa": ("avx9",)}, "cpu_isa"),
     ({"dtype": "fp33"}, r"dtype 'fp33' is not a torch dtype; valid compute dtypes: \['bfloat16', 'float16'")],
)
def test_bad_execution_fields_raise(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutionSignature(**fields)


def test_presets_and_hand_set_fields_plan_for_another_machine() -> None:
    es = ExecutionSignature.preset("H200", tp_size=4)
    assert (es.device_type, es.device_name, es.capability, es.multiprocessor_count, es.tp_size) == (
        "cuda", "NVIDIA H200", (9, 0), 132, 4)
    assert ExecutionSignature.from_dict({"device_type": "cuda", "capability": [8, 9]}).capability == (8, 9)
    with pytest.raises(ValueError, match="valid presets"):
        ExecutionSignature.preset("tpu")
    with pytest.raises(ValueError, match="unknown ExecutionSignature fields"):
        ExecutionSignature.from_dict({"gpu": "x"})


def test_register_provider_in_one_class(monkeypatch: pytest.MonkeyPatch) -> None:
    from moefx.facts import architectures
    from moefx.planner import registry

    monkeypatch.setattr(registry, "PROVIDERS", dict(PROVIDERS))
    monkeypatch.setattr(architectures, "ARCHITECTURES", dict(architectures.ARCHITECTURES))

    @register_provider
    class MixtralNext(Provider):
        name = "mixtral_next"
        family = "mixtral"
        model_types = ("mixtral_next",)

        @classmethod
        def implied(cls, get):
            return {"routing": "softmax", "norm_topk_prob": True, "moe_intermediate_size": get("intermediate_size")}

    data = {**catalog_config("mixtral-8x7b"), "model_type": "mixtral_next"}
    ms = ModelSignature.from_config(data)
    assert ms.family == "mixtral" and registry.provider_for("mixtral_next") is MixtralNext
    plan = resolve(ms, ExecutionSignature(dtype="bfloat16"))
    assert plan.profile == "mixtral_next" and plan.pass_enabled("eliminate_noops")
    with pytest.raises(ValueError, match="owned by 'mixtral'"):

        @register_provider
        class Clash(Provider):
            name = "clash"
            family = "mixtral"
            model_types = ("mixtral",)

    with pytest.raises(ValueError, match="must set 'model_types'"):
        register_provider(type("Empty", (Provider,), {"name": "e", "family": "f", "model_types": ()}))


def test_cli_plan_builtin_on_a_preset(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "deepseek-v3", "--device", "h200", "--mode", "capture", "--max-batch-size", "32", "--tp", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "profile = deepseek_v3" in out and "NVIDIA H200" in out
    assert "serving prefill_token_budget = 4096" in out and "vocab_parallel_lm_head = True" in out
    assert "serving capture_sizes = [1, 2, 4, 8, 16, 24, 32]" in out


def test_cli_plan_json_from_a_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(catalog_config("olmoe-1b-7b")))
    assert main(["plan", str(tmp_path), "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"] == "olmoe" and data["model"]["num_experts"] == 64
    assert data["execution"]["device_type"] == "cpu" and data["passes"]["eliminate_noops"]["enabled"] is True


def test_cli_plan_yaml_signature_with_execution(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sig = tmp_path / "sig.yaml"
    sig.write_text(yaml.safe_dump({
        "model": catalog_config("qwen1.5-moe-a2.7b"),
        "execution": {"device_type": "cuda", "device_name": "NVIDIA L40S", "capability": [8, 9], "mode": "capture",
                      "max_batch_size": 17},
    }))
    assert main(["plan", str(sig)]) == 0
    out = capsys.readouterr().out
    assert "profile = qwen2_moe" in out and "NVIDIA L40S" in out
    assert "16, 17]" in out and "prefill_token_budget = None" in out


def test_cli_plan_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "no-such-model"]) == 2
    assert "valid names" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": {}, "gpu": {}}))
    assert main(["plan", str(bad)]) == 2
    assert "unknown sections" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, fragments",
    [(["--device", "h300"], ["device 'h300' is invalid", "'cpu', 'cuda'", "'h200'", "did you mean 'h200'?"]),
     (["--dtype", "fp33"], ["dtype 'fp33' is not a torch dtype", "['bfloat16', 'float16', 'float32']"]),
     (["--device", "h200", "--dtype", "fp33"], ["dtype 'fp33'"])],
)
def test_cli_plan_bad_device_or_dtype_is_one_line_exit_2(argv: list[str], fragments: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tiny-qwen3-moe", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moefx plan: error: "), err
    assert all(f in err for f in fragments), err
    assert ExecutionSignature(dtype="bf16").dtype == "bfloat16"  # aliases still read


def test_architecture_facts_agree_with_the_providers(monkeypatch: pytest.MonkeyPatch) -> None:
    from moefx.facts import architectures
    from moefx.planner import registry

    for provider in PROVIDERS.values():
        for model_type in provider.model_types:
            assert architectures.architecture_for(model_type).family == provider.family, model_type
    monkeypatch.setattr(registry, "PROVIDERS", {})
    monkeypatch.setattr(architectures, "ARCHITECTURES", dict(architectures.ARCHITECTURES))
    with pytest.raises(ValueError, match="model_type 'mixtral' is of family 'mixtral', not 'other'"):
        register_provider(type("Other", (Provider,), {"name": "o", "family": "other", "model_types": ("mixtral",)}))
