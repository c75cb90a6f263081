"""`moefx.explain_fusions` and `moefx explain-fusions FILE.py:FUNC`: every candidate, fused or not, with its
file:line and reason (FX level: the graph is captured, nothing is code-generated)."""

from __future__ import annotations

import textwrap

import pytest

import moefx
from moefx.cli import main as cli_main

USER_CODE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F


    def rms_norm(x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)


    def block(x, w, h):
        y = rms_norm(x, w)
        s = y.float().abs().amax(-1, keepdim=True) / 127.0
        q = torch.round(y.float() / s).clamp(-128, 127).to(torch.int8)
        d = h.shape[-1] // 2
        a = F.silu(h[..., :d]) * h[..., d:]
        s2 = a.float().abs().amax(-1, keepdim=True) / 127.0
        q2 = (a.float() / s2).clamp(-128, 127).to(torch.int8)
        return q, s, q2, s2


    def example_inputs():
        return [torch.randn(8, 256, dtype=torch.bfloat16), torch.rand(256, dtype=torch.bfloat16) + 0.5,
                torch.randn(8, 512, dtype=torch.bfloat16)]
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_block.py"
    path.write_text(USER_CODE)
    return path


def test_explain_fusions_lists_fused_and_left_alone_with_locations(user_file):
    from moefx.cli.explain_fusions import example_inputs, load_function

    module, fn = load_function(f"{user_file}:block")
    out = moefx.explain_fusions(fn, *example_inputs(module, fn))
    (fused,) = out.fused
    (left,) = out.left_alone
    assert fused.pass_name == "fuse_norm_quant" and fused.location.endswith("user_block.py:15")
    assert "RMSNorm" in fused.detail and "rms_norm_quant" in fused.detail
    assert left.location.endswith("user_block.py:19") and "no round()" in left.detail
    text = str(out)
    assert "1 fused, 1 left alone" in text and "user_block.py:19" in text


def test_cli_explain_fusions(user_file, capsys):
    assert cli_main(["explain-fusions", f"{user_file}:block", "--inputs", "8x256", "256", "8x512"]) == 0
    printed = capsys.readouterr().out
    assert "[fused]" in printed and "[left alone]" in printed and "user_block.py:19" in printed


def test_cli_explain_fusions_names_bad_targets(user_file, capsys):
    assert cli_main(["explain-fusions", f"{user_file}:nope"]) == 2
    assert "no function 'nope'" in capsys.readouterr().err
    assert cli_main(["explain-fusions", f"{user_file}:block", "--inputs", "8y256"]) == 2
    assert "shape must look like 64x512" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["explain-fusions", f"{user_file}:block", "--dtype", "int4"])


def test_cli_explain_fusions_honours_pass_toggles(user_file, capsys):
    """`-cc.pass_config.fuse_norm_quant=false` was ignored (the candidate still printed "[fused]"): the pass is off
    now, named as off, and none of its candidates is listed; the other pass still runs."""
    args = ["explain-fusions", f"{user_file}:block", "--inputs", "8x256", "256", "8x512"]
    assert cli_main([*args, "-cc.pass_config.fuse_norm_quant=false"]) == 0
    printed = capsys.readouterr().out
    assert "[fused]" not in printed and "pass fuse_norm_quant is off (pass_config.fuse_norm_quant=false)" in printed
    assert "user_block.py:19 (fuse_act_quant)" in printed and "(fuse_norm_quant)" not in printed
    assert cli_main([*args, "-cc.pass_config.fuse_act_quant=false"]) == 0
    printed = capsys.readouterr().out
    assert "[fused]" in printed and "pass fuse_act_quant is off" in printed and "(fuse_act_quant)" not in printed
