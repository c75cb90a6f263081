"""The experts-implementation compatibility matrix (moefx/integrations/transformers_compat.py) in CI: every model
class of the installed transformers that uses the experts interface, tiny, with eager / grouped_mm / moefx."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from moefx.integrations import transformers_compat as tc

pytestmark = pytest.mark.usefixtures("isolated_moe_tables")
# rows that must exist, run the op and pass every check (transformers' own MoE test suites; Gemma 4: GELU-tanh)
CORE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "qwen3_next", "gemma4_text",
        "qwen3_moe hidden_act=gelu")
DOC = Path(__file__).resolve().parents[1] / "docs" / "COMPAT.md"


@pytest.fixture(scope="module")
def rows() -> list[tc.Row]:
    return tc.run_matrix()


@pytest.mark.slow
def test_every_row_passes_what_grouped_mm_passes_or_names_its_fallback(rows):
    failing = {r.model_type: tc.failures(r) for r in rows if tc.failures(r)}
    assert not failing, failing
    by_type = {r.model_type: r for r in rows}
    for name in CORE:
        row = by_type[name]
        assert row.error is None and row.reason is None and row.plain is None, (name, row.error, row.reason, row.plain)
        assert all(row.passed("moefx", c) for c in tc.CHECKS), (name, row.results["moefx"])
    for row in rows:
        if row.error is None and row.reason is None:  # every check ran (generate: or said why not)
            assert set(row.results["moefx"]) == set(tc.CHECKS), row
    assert any(r.reason == "expert biases" for r in rows)  # gpt-oss: falls back, naming why
    not_run = [r for r in rows if r.error]
    assert len(not_run) <= len(rows) // 10, [(r.model_type, r.error) for r in not_run]


@pytest.mark.slow  # it needs the whole matrix (the rows fixture, 137 s on 2 cores): the default tier leaves it out
def test_docs_table_lists_the_rows_of_its_transformers_version(rows):
    text = DOC.read_text()
    version = re.search(r"transformers (\S+), torch", text)
    assert version, "docs/COMPAT.md has no generated table"
    if version[1] != transformers.__version__:
        pytest.skip(f"docs/COMPAT.md was generated with transformers {version[1]}")
    listed = set(re.findall(r"^\| ([a-z0-9_]+(?: [a-z_]+=\S+)?) \|", text, re.M)) - {"model type"}
    assert listed == {r.model_type for r in rows}


def test_the_matrix_catches_a_wrong_backward(monkeypatch):
    """A backward off by 0.1% in the hidden-state gradient fails the backward check (the checks can fail)."""
    from moefx.backends import backward

    right = backward.backward_reference

    def wrong(*args):
        dx, *rest = right(*args)
        return (dx * 1.001, *rest)

    monkeypatch.setattr(backward, "backward_reference", wrong)
    with tc.one_thread():
        row = tc.run_row("qwen3_moe", transformers.Qwen3MoeForCausalLM, checks=("backward",))
    assert [f.split(":")[0] for f in tc.failures(row)] == ["backward"]


@pytest.mark.compile
def test_inductor_fullgraph_forward_and_backward_of_an_experts_module():
    """The matrix compiles with aot_eager; one experts module (GELU, the grouped path) also through inductor."""
    model = tc._tiny_model("qwen3_moe", transformers.Qwen3MoeForCausalLM, extra=dict(hidden_act="gelu"))
    tc._set_impl(model, "moefx")
    experts = next(m for m in model.modules() if tc.is_experts_module(m))
    x, idx, w = tc._experts_inputs(experts)

    def run(fn):
        xs = x.clone().requires_grad_()
        out = fn(xs, idx, w)
        out.pow(2).sum().backward()
        grads = [xs.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
        experts.zero_grad(set_to_none=True)
        return [out.detach(), *grads]

    want = run(experts)
    torch._dynamo.reset()
    got = run(torch.compile(experts, backend="inductor", fullgraph=True))
    torch._dynamo.reset()
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
