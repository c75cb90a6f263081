"""moefx.audit_syncs and `moefx audit-syncs`: every sync and graph break listed with its line and verdict."""

from __future__ import annotations

import json

import pytest
import torch

import moefx
from moefx.cli import main as cli_main


def sampler(logits, temperature, unfinished):
    t = temperature.item()
    scaled = logits / t
    kth = torch.topk(scaled, 5)[0][..., -1, None]
    scaled[scaled < kth] = -float("inf")
    probs = torch.softmax(scaled.clamp(min=-t * 1e4), -1)
    tok = torch.multinomial(probs, 1)
    if unfinished.max() == 0:
        return tok, None
    return tok, torch.nonzero(probs > 0.5)


def _line(fn_src: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(sampler)
    return start + next(i for i, ln in enumerate(lines) if fn_src in ln)


@pytest.mark.compile
def test_audit_lists_syncs_and_breaks_with_lines_and_verdicts():
    report = moefx.audit_syncs(sampler, torch.randn(4, 64), torch.tensor(0.8), torch.ones(4, dtype=torch.long))
    by_what = {}
    for f in report.findings:
        by_what.setdefault((f.kind, f.what), []).append(f)
        assert "test_audit_syncs.py" in f.where and f.why
    branch = [f for f in report.findings if f.kind == "graph break" and f"line {_line('if unfinished')}" in f.where]
    assert branch and not branch[0].removed and "host" in branch[0].why
    multinomial = by_what[("sync op", "multinomial (input check reads back)")][0]
    assert multinomial.removed and f"line {_line('torch.multinomial')}" in multinomial.where
    assert by_what[("sync op", "boolean-mask assignment")][0].removed
    nonzero = by_what[("sync op", "nonzero")][0]
    assert not nonzero.removed and "data-dependent" in nonzero.why
    item = by_what[("sync op", ".item()")][0]
    assert not item.removed and "Python scalar op" in item.why  # -t * 1e4 is host math on the scalar
    assert "removed by moefx" in report.format()
    assert json.loads(json.dumps(report.to_dict()))["findings"]


@pytest.mark.compile
def test_cli_audits_the_tiny_model_decode_step(tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert cli_main(["audit-syncs", "tiny-qwen3-moe", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "multinomial" in text and "audit_syncs.py" in text
    findings = json.loads(out.read_text())["findings"]
    kinds = {(f["kind"], f["removed"]) for f in findings}
    assert ("graph break", False) in kinds  # the per-step stop check
    assert ("sync op", True) in kinds  # multinomial -> exponential race


def test_cli_rejects_unknown_model():
    assert cli_main(["audit-syncs", "no-such-model", "--device", "cpu"]) == 2


# Stands for a torch Python function that syncs (torch.unique, a torch.cuda helper): a function in a module named
# torch.*, the innermost frame a real sync warning would name.
_TORCH_SIDE = {"__name__": "torch.fake_helper", "warnings": __import__("warnings")}
_SYNC_SRC = 'def sync():\n    warnings.warn("called a synchronizing CUDA operation", stacklevel=1)\n'
exec(compile(_SYNC_SRC, "torch/fake_helper.py", "exec"), _TORCH_SIDE)


def test_runtime_sync_warnings_name_the_audited_line_not_torch():
    """A sync raised inside torch's Python code is reported at the audited function's line that called it; one
    raised directly there at its own line; other warnings are not syncs, and another thread's syncs (the debug
    mode is process-wide) are not the function's."""
    import threading
    import warnings

    from moefx.audit import _record_sync_warnings, _same_line

    def step():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # direct
        _TORCH_SIDE["sync"]()  # through torch
        warnings.warn("something else", stacklevel=1)
        other = threading.Thread(target=_TORCH_SIDE["sync"])
        other.start()
        other.join()

    lines, start = __import__("inspect").getsourcelines(step)
    direct, through = (start + next(i for i, ln in enumerate(lines) if tag in ln) for tag in ("# direct", "# through"))
    found = _record_sync_warnings(step)
    assert found == [f'"{__file__}", line {direct}', f'"{__file__}", line {through}']
    assert _same_line(f'"{__file__}", line {direct} (warnings.warn(...))', found[0])
    assert not _same_line(f'"{__file__}", line {direct}0, in step', found[0])
