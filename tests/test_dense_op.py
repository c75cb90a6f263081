"""`moefx::dense_linear`: argument checks, fake impl, upstream bit for bit, the gemv CPU path, autograd, the dense
policy (config > env > exact row > upstream; eager and capture rows), the tables and the plan's dense section."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml

import moefx
from moefx.backends import dense as D
from moefx.backends import dense_policy as P
from moefx.backends.calibration import MRange
from moefx.signatures import ExecutionSignature, ModelSignature, resolve

pytestmark = pytest.mark.usefixtures("isolated_moe_tables")


@pytest.fixture(autouse=True)
def _no_dense_env(monkeypatch):
    monkeypatch.delenv(P.ENV, raising=False)


def _case(m=3, ns=(12, 8), k=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m, k, generator=g, dtype=dtype)
    ws = [torch.randn(n, k, generator=g, dtype=dtype) for n in ns]
    bs = [torch.randn(ns[0], generator=g, dtype=dtype)] + [None] * (len(ns) - 1)
    return x, ws, bs


def test_upstream_is_the_unfused_linears_bit_for_bit():
    x, ws, bs = _case(dtype=torch.bfloat16)
    outs = D.dense_linear(x, ws, bs, backend="auto")  # no CPU row: upstream
    assert [o.shape for o in outs] == [(2, 3, 12), (2, 3, 8)]
    assert all(torch.equal(o, F.linear(x, w, b)) for o, w, b in zip(outs, ws, bs))


def test_gemv_on_cpu_is_the_fp32_reference():
    x, ws, bs = _case(dtype=torch.bfloat16)
    outs = D.dense_linear(x, ws, bs, backend="gemv")
    for o, w, b in zip(outs, ws, bs):
        ref = (x.float() @ w.float().t() + (b.float() if b is not None else 0)).to(torch.bfloat16)
        assert torch.equal(o, ref)


def test_fp8_form_upstream_is_fp8_block_gemm():
    from moefx.ops.quant import QuantScheme, quant_weight_fp8_block

    x = torch.randn(3, 64)
    a, a_s = torch.ops.moefx.quant(x, *QuantScheme("fp8_group", 32).args())
    qs = [quant_weight_fp8_block(torch.randn(n, 64), 32, 32) for n in (32, 16)]
    ws, ss = [q for q, _ in qs], [s for _, s in qs]
    outs = D.dense_linear(a, ws, None, x_scale=a_s, weight_scales=ss, block_shape=(32, 32), out_dtype=torch.bfloat16)
    for o, w, s in zip(outs, ws, ss):
        assert torch.equal(o, torch.ops.moefx.fp8_block_gemm(a, a_s, w, s, 32, 32, None, torch.bfloat16))


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="fast"), "backend='fast'"),
    (dict(biases=[None]), "one bias entry"),
    (dict(block_shape=(128, 128)), "FP8 form"),
    (dict(weight_scales=[torch.ones(1, 1)] * 2, block_shape=(128, 128), x_scale=torch.ones(2, 3, 1)), "float8"),
])
def test_bad_arguments_name_the_problem(kwargs, match):
    x, ws, bs = _case()
    kwargs.setdefault("biases", bs)
    with pytest.raises(ValueError, match=match):
        D.dense_linear(x, ws, **kwargs)
    with pytest.raises(ValueError, match="expected \\[N, 16\\]"):
        D.dense_linear(x, [ws[0][:, :8]])


def test_fake_impl_gives_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, ws = torch.empty(5, 7, 16, dtype=torch.bfloat16), [torch.empty(n, 16, dtype=torch.bfloat16) for n in (4, 9)]
        outs = torch.ops.moefx.dense_linear(x, ws, [None, None], None, [], None, None, "auto")
    assert [tuple(o.shape) for o in outs] == [(5, 7, 4), (5, 7, 9)] and outs[0].dtype == torch.bfloat16


def test_autograd_of_the_float_form_matches_separate_linears():
    x, ws, bs = _case()
    leaves = [t.clone().requires_grad_() for t in (x, *ws, bs[0])]
    xg, w0, w1, b0 = leaves
    loss = sum((o * (i + 1)).sum() for i, o in enumerate(D.dense_linear(xg, [w0, w1], [b0, None])))
    loss.backward()
    ref = [t.clone().requires_grad_() for t in (x, *ws, bs[0])]
    (F.linear(ref[0], ref[1], ref[3]).sum() + 2 * F.linear(ref[0], ref[2]).sum()).backward()
    assert all(torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(leaves, ref))


# ------------------------------------------------------------------------------------------------------ policy


def _write_row(path, key: P.DenseKey, ranges: str = "gemv@1-4,upstream@5-"):
    from moefx.backends.calibration import parse_ranges

    timings = {"gemv": {1: 1.0, 4: 1.0, 8: 3.0}, "upstream": {1: 2.0, 4: 2.0, 8: 2.0}}  # the grid: M 1..8
    row = P.DenseRow(key, parse_ranges(ranges, "test"), {"date": "2026-12-01"}, "", timings)
    return P.write_dense_row(path, row)


def _cpu_key(x, ws, mode="eager"):
    return P.dense_key(x.device, [w.shape[0] for w in ws], x.shape[-1], x.dtype, None, mode)


def test_policy_uses_the_exact_row_per_mode_and_m(tmp_path, monkeypatch):
    x, ws, _ = _case(m=2)  # 4 rows
    table = tmp_path / "xdg" / "moefx" / "calibration" / "dense.yaml"
    assert _write_row(table, _cpu_key(x, ws)) == "dense.yaml#dense1"
    assert D.select_backend(x, ws, [], None, None, capturing=False) == "gemv"
    assert D.select_backend(torch.cat([x, x], 1), ws, [], None, None, capturing=False) == "upstream"  # M = 8
    assert D.select_backend(x, ws, [], None, None, capturing=True) == "upstream"  # no capture row
    assert D.select_backend(x, ws[:1], [], None, None, capturing=False) == "upstream"  # other N: other key
    monkeypatch.setenv(P.ENV, "upstream")
    assert D.select_backend(x, ws, [], None, None, capturing=False) == "upstream"
    assert D.select_backend(x, ws, [], None, None, backend="gemv", capturing=False) == "gemv"  # the call's word wins


def test_gemv_never_runs_past_the_calibrated_grid(tmp_path, monkeypatch):
    x, ws, _ = _case(m=2)
    _write_row(tmp_path / "xdg" / "moefx" / "calibration" / "dense.yaml", _cpu_key(x, ws), ranges="gemv@1-")
    assert D.select_backend(torch.cat([x, x], 1), ws, [], None, None, capturing=False) == "gemv"  # M = 8
    assert D.select_backend(torch.cat([x] * 4, 1), ws, [], None, None, capturing=False) == "upstream"  # M = 16
    assert "past the calibrated grid" in P.requested(16, "auto", _cpu_key(x, ws))[1]


def test_env_value_is_validated(monkeypatch):
    x, ws, _ = _case()
    monkeypatch.setenv(P.ENV, "fastest")
    with pytest.raises(ValueError, match="MOEFX_DENSE_BACKEND"):
        D.select_backend(x, ws, [], None, None, capturing=False)


def test_tables_are_validated_and_keep_other_sections(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("rows: []\n")
    key = P.DenseKey("NVIDIA H200", (9, 0), 132, (4096, 512, 512), 2048, "bfloat16", None, "capture")
    _write_row(path, key)
    _write_row(path, key, "gemv@1-16,upstream@17-")  # same key: replaced
    data = yaml.safe_load(path.read_text())
    assert data["rows"] == [] and len(data["dense_rows"]) == 1
    from moefx.backends import calibration as C

    moe_key = C.CalibrationKey("NVIDIA H200", (9, 0), 132, 8, 64, 32, 2, "bfloat16", None, "capture")
    C.write_row(path, C.CalibrationRow(moe_key, (MRange("gemv", 1, None),), {"date": "2026-12-01"}, ""))
    data = yaml.safe_load(path.read_text())  # a MoE row written into the same file keeps the dense rows
    assert len(data["rows"]) == 1 and len(data["dense_rows"]) == 1
    (row,) = P.load_dense_table(path)
    assert row.key == key and row.ranges[0] == MRange("gemv", 1, 16)
    data["dense_rows"][0]["ranges"][0]["backend"] = "grouped"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="dense backend \\['grouped'\\]"):
        P.load_dense_table(path)
    data["dense_rows"][0]["key"]["N"] = 4096
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="'N' must be a non-empty list"):
        P.load_dense_table(path)


def test_config_key_is_validated_and_hashed():
    assert moefx.CompilationConfig.from_any({"dense_backend": "gemv"}).dense_backend == "gemv"
    with pytest.raises(ValueError, match="'dense_backend' has invalid value 'gemm'"):
        moefx.CompilationConfig.from_any({"dense_backend": "gemm"})
    base = moefx.CompilationConfig()
    assert moefx.CompilationConfig.from_any({"dense_backend": "upstream"}).compute_hash() != base.compute_hash()


def test_plan_explains_each_projection_with_its_row(tmp_path, monkeypatch):
    from moefx.backends import calibration
    from moefx.models.catalog import catalog_config

    monkeypatch.setattr(calibration, "PACKAGE_TABLES", tmp_path / "none")  # only the row written here
    calibration.invalidate()

    ms = ModelSignature.from_config(catalog_config("qwen3-30b-a3b"))
    es = ExecutionSignature.preset("h200", mode="capture")
    table = tmp_path / "xdg" / "moefx" / "calibration" / "dense.yaml"
    key = P.DenseKey("NVIDIA H200", (9, 0), 132, (4096, 512, 512), 2048, "bfloat16", None, "capture")
    _write_row(table, key, "gemv@1-16,upstream@17-")
    plan = resolve(ms, es)
    text = plan.explain()
    assert "dense q/k/v key = NVIDIA H200 cap=9.0 sms=132 N=4096,512,512 K=2048 bfloat16 quant=none  [" in text
    assert "dense q/k/v capture M 1..16 = gemv  [dense.yaml#dense1]" in text
    assert "dense o eager M 1..inf = upstream  [no calibration row for eager]" in text
    assert "dense router key = NVIDIA H200 cap=9.0 sms=132 N=128 K=2048" in text
    assert plan.passes["fuse_sibling_linears"].enabled and plan.passes["dense_linears"].enabled  # a gemv row here
    assert not plan.passes["fp8_weight_only"].enabled  # a bf16 model: no activation quant to drop
    assert "no FP8 activation quant" in plan.passes["fp8_weight_only"].reason
    forced = resolve(ms, es, {"dense_backend": "upstream"})
    assert "dense o capture M 1..inf = upstream  [user config]" in forced.explain()


def test_fp8_weight_only_is_on_for_an_fp8_model_where_the_gemv_runs(tmp_path, monkeypatch):
    from moefx.backends import calibration
    from moefx.models.catalog import catalog_config
    from moefx.quantize import Fp8BlockConfig

    monkeypatch.setattr(calibration, "PACKAGE_TABLES", tmp_path / "none")
    calibration.invalidate()
    config = {**catalog_config("qwen3-30b-a3b"), "quantization_config": Fp8BlockConfig().quantization_config()}
    ms = ModelSignature.from_config(config)
    es = ExecutionSignature.preset("h200", mode="capture")
    assert not resolve(ms, es).passes["fp8_weight_only"].enabled  # no row yet: the dense passes are off too
    table = tmp_path / "xdg" / "moefx" / "calibration" / "dense.yaml"
    key = P.DenseKey("NVIDIA H200", (9, 0), 132, (4096, 512, 512), 2048, "bfloat16", (128, 128), "capture")
    _write_row(table, key, "gemv@1-16,upstream@17-")
    decision = resolve(ms, es).passes["fp8_weight_only"]
    assert decision.enabled and "faster than W8A8" in decision.reason
    off = resolve(ms, es, {"pass_config": {"fp8_weight_only": False}})
    assert not off.passes["fp8_weight_only"].enabled and off.passes["dense_linears"].enabled


def test_no_row_means_the_dense_passes_are_not_preferred(tmp_path, monkeypatch):
    from moefx.backends import calibration
    from moefx.models.catalog import catalog_config

    monkeypatch.setattr(calibration, "PACKAGE_TABLES", tmp_path / "none")
    calibration.invalidate()
    plan = resolve(ModelSignature.from_config(catalog_config("qwen3-30b-a3b")), ExecutionSignature.preset("h200"))
    decision = plan.passes["fuse_sibling_linears"]
    assert not decision.enabled and "no dense calibration row" in decision.reason
