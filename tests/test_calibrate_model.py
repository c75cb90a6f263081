"""`moefx calibrate --model`: every row the plan reads (MoE and dense) in one command; the shipped H100 rows; the
one-line warning on a CUDA device without rows; the benchmark model built in its dtype."""

from __future__ import annotations

import warnings

import pytest
import torch

from moefx.backends.calibration import load_table, user_table_dir
from moefx.backends.dense_policy import load_dense_table
from moefx.config import CompilationConfig
from moefx.models.catalog import catalog_config
from moefx.optimize import uncalibrated_calls
from moefx.signatures import ExecutionSignature, ModelSignature, resolve

FP8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}


@pytest.mark.parametrize("extra", [{}, FP8], ids=["bf16", "fp8"])
def test_h100_plan_sends_batch1_moe_and_qkv_to_moefx_kernels(extra):
    ms = ModelSignature.from_config({**catalog_config("qwen3-30b-a3b"), **extra})
    plan = resolve(ms, ExecutionSignature.preset("h100", mode="capture"), CompilationConfig())
    assert plan.moe.policy("capture").backend_for(1) == "gemv"
    assert "nvidia-h100" in plan.moe.policy("capture").source
    (qkv,) = [e for e in plan.dense.entries if e.label == "q/k/v"]
    assert qkv.policies["capture"].backend_for(1) == "gemv"
    assert "nvidia-h100" in qkv.policies["capture"].source
    assert plan.pass_enabled("fuse_norm_linear") and plan.pass_enabled("fuse_sibling_linears")
    assert uncalibrated_calls(plan) == []


def test_a_cuda_device_without_rows_names_every_upstream_call():
    ms = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))
    plan = resolve(ms, ExecutionSignature.preset("a100", mode="capture"), CompilationConfig())
    assert uncalibrated_calls(plan) == ["MoE experts", "dense q/k/v", "dense o", "dense router"]
    forced = resolve(ms, ExecutionSignature.preset("a100", mode="capture"),
                     CompilationConfig(moe_backend="grouped", dense_backend="upstream"))
    assert uncalibrated_calls(forced) == []  # a backend the user chose is not a missing row
    cpu = resolve(ms, ExecutionSignature.detect(device="cpu"), CompilationConfig())
    assert uncalibrated_calls(cpu) == []


def test_optimize_warns_once_in_one_line_on_a_cuda_device_without_rows(monkeypatch):
    import moefx
    from moefx.models.tiny import build_model, tiny_qwen3_moe_config

    real = ExecutionSignature.detect

    def on_an_a100(*args, **kwargs):
        es = real(*args, **kwargs)
        return ExecutionSignature.preset("a100", mode=es.mode, dtype=es.dtype)

    monkeypatch.setattr(ExecutionSignature, "detect", classmethod(lambda cls, *a, **k: on_an_a100(*a, **k)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            moefx.optimize(build_model(tiny_qwen3_moe_config()), config={"mode": "eager"})
    lines = [str(w.message) for w in caught if "no calibration rows" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "MoE experts" in lines[0] and "moefx calibrate --model" in lines[0]


def test_calibrate_model_quick_writes_moe_and_dense_rows(tmp_path, capsys):
    from moefx.cli import main

    out = tmp_path / "t.yaml"
    assert main(["calibrate", "--model", "tiny-qwen3-moe", "--quick", "--output", str(out), "--plot", "none"]) == 0
    printed = capsys.readouterr().out
    moe_rows, dense_rows = load_table(out), load_dense_table(out)
    assert len(moe_rows) == 1 and moe_rows[0].key.mode == "eager"
    assert {tuple(r.key.N) for r in dense_rows} == {(64, 32, 32), (64,), (8,)}  # q/k/v, o, router of the tiny model
    assert all(r.provenance["command"].startswith("moefx calibrate --model tiny-qwen3-moe") for r in dense_rows)
    assert "--parts dense" in dense_rows[0].provenance["command"]
    assert "4 rows in" in printed
    # re-running replaces the rows, it does not add to them
    assert main(["calibrate", "--model", "tiny-qwen3-moe", "--quick", "--output", str(out), "--plot", "none",
                 "--parts", "dense"]) == 0
    assert len(load_dense_table(out)) == 3 and len(load_table(out)) == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--parts", "attention"], "valid choices: ['moe', 'dense']"),
    (["--experts", "4", "--hidden", "16", "--intermediate", "8", "--topk", "2", "--parts", "dense"],
     "--parts dense needs --model"),
])
def test_calibrate_parts_bad_input(argv, message, capsys):
    from moefx.cli import main

    base = [] if "--experts" in argv else ["--model", "tiny-qwen3-moe"]
    assert main(["calibrate", *base, *argv, "--quick", "--output", str(user_table_dir() / "x.yaml")]) == 2
    assert message in capsys.readouterr().err


def test_build_model_creates_parameters_in_the_dtype_asked_for(monkeypatch):
    from moefx.models.tiny import build_model, tiny_qwen3_moe_config

    drawn = []
    real = torch.nn.init.normal_

    def spy(tensor, *args, **kwargs):
        drawn.append(tensor.dtype)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", spy)
    model = build_model(tiny_qwen3_moe_config(), dtype=torch.bfloat16, routing="balanced")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert drawn and set(drawn) == {torch.bfloat16}  # never drawn in float32 first
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(("preset", "calibrates"), [("a100", True), ("h100", False)])
def test_precompile_calibrates_first_on_a_cuda_device_without_rows(preset, calibrates, monkeypatch, capsys):
    import argparse

    import moefx.cli
    from moefx.cli import precompile

    calls = []
    monkeypatch.setattr(ExecutionSignature, "detect",
                        classmethod(lambda cls, *a, **k: ExecutionSignature.preset(preset, mode=k["mode"])))
    monkeypatch.setattr(moefx.cli, "main", lambda argv: calls.append(argv) or 0)
    args = argparse.Namespace(model="qwen3-30b-a3b", device="cuda", dtype=None)
    precompile._calibrate_if_missing(args, CompilationConfig(mode="capture"))
    if calibrates:
        assert calls == [["calibrate", "--model", "qwen3-30b-a3b", "--device", "cuda"]]
        assert "running `moefx calibrate --model qwen3-30b-a3b` first" in capsys.readouterr().out
    else:
        assert calls == []
