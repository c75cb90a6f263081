"""`moefx bench`: both arms run in their own processes, the red line applies, and noise makes it inconclusive."""

import json

import pytest

from moefx.cli import main as cli_main
from moefx.cli.bench import EXIT_INCONCLUSIVE, EXIT_OK, EXIT_REGRESSION, spread_pct, summarize, verdict

EAGER = '{"mode": "eager"}'


@pytest.mark.slow
def test_bench_runs_both_arms_end_to_end(tmp_path, capsys):
    out = tmp_path / "ab.json"
    args = ["bench", "--a", EAGER, "--b", EAGER, "--runs", "1", "--repeats", "2", "--new-tokens", "3",
            "--prompt-len", "4", "--red-line", "1000", "--json", str(out), "-cc.max_batch_size=2"]
    assert cli_main(args) == EXIT_OK  # a red line no noise reaches: a verdict, and it is ok
    data = json.loads(out.read_text())
    assert [len(data["runs"][arm]) for arm in ("a", "b")] == [1, 1]
    assert [len(data["runs"][arm][0]) for arm in ("a", "b")] == [2, 2]  # --repeats samples per process
    assert set(data["medians"]["b"]) == set(data["spread_pct"]["a"]) == {"prefill_ms", "itl_ms", "decode_tok_s"}
    assert data["configs"]["a"]["max_batch_size"] == data["configs"]["b"]["max_batch_size"] == 2  # -cc: both arms
    assert data["model"] == "tiny-qwen3-moe" and data["verdict"].endswith(": ok")
    assert "decode tok/s B vs A" in capsys.readouterr().out


def test_verdict_is_inconclusive_when_the_noise_is_wider_than_the_red_line():
    quiet = [1000.0, 1001.0, 999.0, 1000.5, 999.5]
    noisy = [670.0, 1095.0, 800.0, 950.0, 720.0]  # the spread seen on a busy 2-core machine
    line, code, change, noise = verdict(quiet, noisy, red_line=3.0)
    assert code == EXIT_INCONCLUSIVE and "inconclusive" in line and "REGRESSION" not in line
    assert change < -3.0 and noise == spread_pct(noisy) > 3.0
    assert verdict(quiet, [t * 0.9 for t in quiet], 3.0)[1] == EXIT_REGRESSION  # quiet and 10% slower
    assert verdict(quiet, [t * 0.99 for t in quiet], 3.0)[1] == EXIT_OK
    assert verdict([1000.0], [1000.0], 3.0)[1] == EXIT_INCONCLUSIVE  # one sample: no noise measured


@pytest.mark.parametrize(
    "extra, message",
    [(["--b", '{"moe_backend": "fast"}'], "valid choices"),
     (["--b", "{}", "-cc.moe_backend=fast"], "valid choices"),
     (["--b", "{}", "-cc.pass_confg.x=1"], "valid sections of the config"),
     (["--b", "{}", "--model", "no/such/model"], "no such file or folder"),
     (["--b", "{}", "--repeats", "0"], "--repeats must be >= 1")],
)
def test_bench_validates_before_running(extra, message, capsys):
    assert cli_main(["bench", *extra]) == 2
    assert message in capsys.readouterr().err


def _sample(tok_s: float, measured: bool = True) -> dict:
    return {"prefill_ms": 10.0, "itl_ms": 1e3 / tok_s, "decode_tok_s": tok_s, "decode_measured": measured}


def test_unmeasured_samples_enter_no_aggregate():
    """A sample whose decode steps the noise swallowed carries a made-up rate (~1e10 tok/s): it must not move any
    median or spread, and the verdict is the one of the measured samples alone."""
    a = [[_sample(t) for t in (1000.0, 1001.0, 999.0)], [_sample(1000.5), _sample(1.5e10, measured=False)]]
    b = [[_sample(t) for t in (1000.0, 1000.2, 999.8)], [_sample(1.5e10, measured=False), _sample(999.9)]]
    s = summarize({"a": a, "b": b}, red_line=3.0)
    assert s["measured"] == {"a": (4, 5), "b": (4, 5)}
    assert s["medians"]["a"]["decode_tok_s"] == pytest.approx(1000.25)
    assert s["spread_pct"]["b"]["decode_tok_s"] < 1.0 and s["noise_pct"] < 1.0
    assert s["exit_code"] == EXIT_OK and s["verdict"].endswith(": ok") and abs(s["change_pct"]) < 0.1


def test_too_few_measured_samples_is_inconclusive():
    a = [[_sample(1000.0), _sample(1000.0), _sample(1000.0)]]
    b = [[_sample(1000.0), _sample(1.5e10, False), _sample(1.5e10, False)]]  # 1 of 3 measured: under half
    s = summarize({"a": a, "b": b}, red_line=3.0)
    assert s["exit_code"] == EXIT_INCONCLUSIVE
    assert "inconclusive: 1 of 3 samples measured in arm B" in s["verdict"] and "REGRESSION" not in s["verdict"]
    assert s["medians"]["b"]["decode_tok_s"] == 1000.0 and s["change_pct"] is None
    none = summarize({"a": a, "b": [[_sample(1.5e10, False)] * 3]}, red_line=3.0)
    assert none["exit_code"] == EXIT_INCONCLUSIVE and none["medians"]["b"]["decode_tok_s"] is None
    assert "0 of 3 samples measured in arm B" in none["verdict"]


def test_a_change_beyond_the_noise_is_a_verdict_whatever_the_red_line():
    """The issue's case: B 66.5% slower with 8.5% noise and a 3% red line is a REGRESSION, not "inconclusive"; B far
    faster beyond wide noise is ok; a change inside noise wider than the red line stays inconclusive."""
    a = [960.0, 990.0, 1000.0, 1075.0, 1100.0]  # spread (1075 - 990) / 1000 = 8.5%
    b = [t * 0.335 for t in a]
    line, code, change, noise = verdict(a, b, red_line=3.0)
    assert code == EXIT_REGRESSION and line.endswith(": REGRESSION"), line
    assert change == pytest.approx(-66.5) and noise == pytest.approx(8.5)
    assert verdict(a, [t * 1.5 for t in a], 3.0)[1] == EXIT_OK  # 50% faster, beyond the noise
    assert verdict(a, [t * 0.95 for t in a], 3.0)[1] == EXIT_INCONCLUSIVE  # 5% slower, inside 8.5% noise
    assert verdict(a, [t * 1.05 for t in a], 3.0)[1] == EXIT_INCONCLUSIVE  # 5% faster, inside it too


def _strict(text: str):
    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_bench_json_is_strict_json(tmp_path, monkeypatch, capsys):
    """One repeat per process and one run: every spread is unknown (inf in Python); the file holds null there,
    no Infinity, and any strict parser reads it. The arms' processes are stood in for (their stdout is what
    bench_arm prints)."""
    import subprocess
    import types

    from moefx.cli import bench

    samples = {"a": [_sample(1000.0)], "b": [_sample(400.0)]}
    samples["a"][0]["spread_pct"] = samples["b"][0]["spread_pct"] = None  # what bench_arm writes for inf

    def fake_run(cmd, **kwargs):
        config = json.loads(cmd[cmd.index("--config") + 1])
        arm = "b" if config["mode"] == "eager" else "a"
        return types.SimpleNamespace(returncode=0, stderr="", stdout=json.dumps({"samples": samples[arm]}))

    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "ab.json"
    code = cli_main(["bench", "--b", EAGER, "--runs", "1", "--repeats", "1", "--json", str(out)])
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text
    data = _strict(text)
    assert data["spread_pct"]["a"]["decode_tok_s"] is None and data["noise_pct"] is None
    assert code == EXIT_INCONCLUSIVE and data["exit_code"] == code
    assert "1 sample in arm A" in data["verdict"] and "swallowed" not in data["verdict"]  # all measured: too few
    capsys.readouterr()
    assert bench.strict_json({"x": [float("inf"), float("nan"), 1.5], "y": (2,)}) == {"x": [None, None, 1.5], "y": [2]}
