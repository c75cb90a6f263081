import pytest
import torch
import torch._inductor.config as inductor_config

import moefx
from moefx.config import CompilationConfig
from moefx.passes import PASS_REGISTRY, PassManager


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
    assert [r.passes for r in first] == [["eliminate_noops"]]
    # Same toggles: inductor's FX graph cache serves the graph, so the pass manager does not run again.
    assert compile_with(on) == []
    # Other toggles: a different cache key, so the graph is rebuilt and the manager runs with them.
    rebuilt = compile_with(off)
    assert [r.passes for r in rebuilt] == [[]]
