import json

from moefx.cli import main as cli_main

EAGER = '{"mode": "eager"}'


def test_bench_runs_both_arms_and_applies_the_red_line(tmp_path, capsys):
    out = tmp_path / "ab.json"
    args = ["bench", "--a", EAGER, "--b", EAGER, "--runs", "1", "--new-tokens", "4", "--prompt-len", "4"]
    # A red line no change can cross: passes, and the JSON has one run per arm with every metric.
    assert cli_main([*args, "--red-line", "1000", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [len(data["runs"][arm]) for arm in ("a", "b")] == [1, 1]
    assert set(data["medians"]["b"]) == {"prefill_ms", "itl_ms", "decode_tok_s"}
    assert "decode tok/s B vs A" in capsys.readouterr().out
    # A red line every result crosses: the command reports a regression and fails.
    assert cli_main([*args, "--red-line", "-1000"]) == 1
    assert "REGRESSION" in capsys.readouterr().out


def test_bench_validates_configs_before_running(capsys):
    assert cli_main(["bench", "--b", '{"moe_backend": "fast"}']) == 2
    assert "valid choices" in capsys.readouterr().err
