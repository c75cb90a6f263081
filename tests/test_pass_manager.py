import subprocess
import sys

import pytest
import torch
import torch._inductor.config as inductor_config

import moefx
import moefx.passes.manager
from moefx.config import CompilationConfig
from moefx.passes import PASS_REGISTRY, PIPELINE, PassManager


def test_uuid_depends_on_toggles_and_config_only():
    on = CompilationConfig.from_any({"pass_config": {"eliminate_noops": True}})
    a = PassManager(on, ["eliminate_noops"]).uuid()
    assert a == PassManager(CompilationConfig.from_any(on.to_dict()), ["eliminate_noops"]).uuid()
    assert a != PassManager(on, []).uuid()
    other = CompilationConfig.from_any({"pass_config": {"eliminate_noops": True}, "max_batch_size": 4})
    assert a != PassManager(other, ["eliminate_noops"]).uuid()


def test_uuid_covers_pass_source(monkeypatch):
    cfg = CompilationConfig()
    cls = PASS_REGISTRY["eliminate_noops"]
    before = PassManager(cfg, ["eliminate_noops"]).uuid()
    monkeypatch.setattr(cls, "source_digest", classmethod(lambda c: "edited"))
    assert PassManager(cfg, ["eliminate_noops"]).uuid() != before


def test_every_pass_with_every_toggle_has_a_uuid():
    """Each pass's source digest reads files that exist (a moved module named by path would only fail where the pass
    is enabled, on CUDA)."""
    cfg = CompilationConfig()
    for name, cls in PASS_REGISTRY.items():
        assert len(cls.source_digest()) == 64, name
    assert PassManager(cfg, list(PASS_REGISTRY)).uuid()


def test_passes_run_in_pipeline_order_and_the_order_is_in_the_uuid(monkeypatch):
    cfg = CompilationConfig()
    names = ["fuse_act_quant", "eliminate_noops", "fuse_norm_quant"]
    manager = PassManager(cfg, names)
    assert manager.enabled == ["eliminate_noops", "fuse_norm_quant", "fuse_act_quant"]
    assert list(PASS_REGISTRY) == [cls.name for cls in PIPELINE]
    before = manager.uuid()
    monkeypatch.setattr(moefx.passes.manager, "PASS_REGISTRY", dict(reversed(PASS_REGISTRY.items())))
    reordered = PassManager(cfg, names)
    assert reordered.enabled == ["fuse_act_quant", "fuse_norm_quant", "eliminate_noops"]
    assert reordered.uuid() != before


def test_importing_the_passes_loads_no_engine_module():
    code = ("import sys, moefx.passes; "
            "print(sorted(m for m in sys.modules if m.startswith(('moefx.sampling', 'moefx.engine'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_unknown_pass_is_rejected():
    with pytest.raises(ValueError, match="registered passes"):
        PassManager(CompilationConfig(), ["fuse_everything"])


def test_reports_and_graph_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the passes must run
    moefx.clear_compile_reports()
    cfg = {"pass_config": {"eliminate_noops": True, "dump_graph_dir": str(tmp_path)}}

    def f(x):
        return x.view(4, 4).reshape(2, 8).reshape(16) * 2

    torch._dynamo.reset()
    out = torch.compile(f, backend=moefx.backend(cfg))(torch.randn(16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    (report,) = moefx.compile_reports()
    assert report.passes == ["eliminate_noops"]
    assert report.matches["eliminate_noops"] >= 1 and report.nodes_after < report.nodes_before
    assert any("eliminate_noops = on" in d for d in report.plan_decisions)
    assert (tmp_path / "graph000_before.txt").exists() and (tmp_path / "graph000_after.txt").exists()
    moefx.clear_compile_reports()
    assert moefx.compile_reports() == []


@pytest.mark.compile
def test_cache_never_serves_a_graph_built_with_other_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    on = {"pass_config": {"eliminate_noops": True}}
    off = {"pass_config": {"eliminate_noops": False}}

    def f(x):
        return x.view(4, 4).reshape(16).sin()

    x = torch.randn(16, dtype=torch.bfloat16)

    def compile_with(cfg):
        torch._dynamo.reset()
        moefx.clear_compile_reports()
        with inductor_config.patch(fx_graph_cache=True):
            torch.compile(f, backend=moefx.backend(cfg))(x)
        return moefx.compile_reports()

    first = compile_with(on)
    assert [r.passes for r in first] == [["eliminate_noops"]] and not first[0].from_cache
    # Same toggles: inductor's FX graph cache serves the graph; the passes do not run again, the report
    # stored with the cache entry comes back.
    (cached,) = compile_with(on)
    assert cached.from_cache and cached.content() == first[0].content()
    # Other toggles: a different cache key, so the graph is rebuilt and the manager runs with them.
    rebuilt = compile_with(off)
    assert [r.passes for r in rebuilt] == [[]] and not rebuilt[0].from_cache


def _silu_quant(x):
    d = x.shape[-1] // 2
    y = torch.nn.functional.silu(x[..., :d]) * x[..., d:]
    yg = y.float().view(-1, 128)
    s = yg.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    return (yg / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s


def _two_compiles(tmp_path, monkeypatch, device):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cfg = {"pass_config": {"fuse_act_quant": True}}
    x = torch.randn(16, 512, dtype=torch.bfloat16, device=device)
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        moefx.clear_compile_reports()
        with inductor_config.patch(fx_graph_cache=True):
            out = torch.compile(_silu_quant, backend=moefx.backend(cfg))(x)
        runs.append((moefx.compile_reports(), out))
    return runs, _silu_quant(x)


@pytest.mark.compile
def test_warm_fx_cache_gives_the_same_report(tmp_path, monkeypatch):
    """Compile the same function twice: the second compile is an FX graph cache hit and reports exactly what
    the first did (fused, with the rewrite line), marked as coming from the cache."""
    (first, out1), (second, out2) = _two_compiles(tmp_path, monkeypatch, "cpu")[0]
    assert len(first) == len(second) == 1
    assert first[0].matches == {"fuse_act_quant": 1} and first[0].rewrites["fuse_act_quant"]
    assert not first[0].from_cache and second[0].from_cache
    assert second[0].content() == first[0].content()
    assert "from the FX graph cache" in second[0].summary()
    assert torch.equal(out1[0].view(torch.uint8), out2[0].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.compile
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warm_fx_cache_gives_the_same_report_on_cuda(tmp_path, monkeypatch):
    runs, ref = _two_compiles(tmp_path, monkeypatch, "cuda")
    (first, out1), (second, out2) = runs
    assert first[0].matches == {"fuse_act_quant": 1} and second[0].from_cache
    assert second[0].content() == first[0].content()
    assert (out1[0].float() != ref[0].float()).float().mean().item() < 1e-3
    assert ((out1[1] - ref[1]).abs() <= 1e-6 * ref[1].abs()).all()
