"""Every input a user writes is checked where it enters: one line naming the file or key, the value and what is
valid; exit 2 from the CLI, ValueError from the API, never a traceback.

One table. A CLI row runs `moefx.cli.main` in this process (fast); the few SUBPROCESS rows run the real `moefx`
entry point to show the exit code and the clean stderr of a whole process. `{name}` in a row is a file of FILES
written under tmp_path (`{tmp}` is the folder itself).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FILES = {
    "bad_yaml": ("bad.yaml", "mode: [compile\n"),
    "bad_json": ("bad.json", '{"mode": "compile",}'),
    "tab_yaml": ("tab.yaml", "mode:\n\tcompile\n"),
    "list_yaml": ("list.yaml", "- mode\n- compile\n"),
    "budget_yaml": ("budget.yaml", "memory_budget: 2.0\n"),
    "txt_config": ("config.txt", "mode: compile\n"),
    "bad_model_json": ("model/config.json", '{"model_type": "qwen3_moe",'),
    "bad_rules": ("rules.yaml", "rules: [x\n"),
    "sections_yaml": ("sig.yaml", "model:\n  model_type: qwen3_moe\nexecutio:\n  mode: eager\n"),
    "a_file": ("a_file", "not a folder\n"),
}

TINY = "tiny-qwen3-moe"
BIG = "qwen3-30b-a3b"

# (id, argv or API call, environment, substrings of the one error line). Argument vectors are CLI rows.
ROWS = [
    # files a user writes: syntax errors name the file, the line and the column
    ("config-yaml-syntax", ["plan", TINY, "--config", "{bad_yaml}"], {},
     ["config file", "bad.yaml", "is not valid YAML", "line 2, column 1"]),
    ("config-yaml-tab", ["plan", TINY, "--config", "{tab_yaml}"], {}, ["tab.yaml", "is not valid YAML", "line 2"]),
    ("config-json-syntax", ["plan", TINY, "--config", "{bad_json}"], {},
     ["config file", "bad.json", "is not valid JSON", "line 1, column 20"]),
    ("plan-yaml-syntax", ["plan", "{bad_yaml}"], {}, ["model signature file", "bad.yaml", "is not valid YAML"]),
    ("model-json-syntax", ["plan", "{tmp}/model"], {}, ["model config", "config.json", "is not valid JSON"]),
    ("rule-file-syntax", ["plan", TINY, "-cc.rules=[{bad_rules}]"], {}, ["rule file", "rules.yaml", "not valid YAML"]),
    ("config-not-a-mapping", ["plan", TINY, "--config", "{list_yaml}"], {}, ["config must be a dict", "got list"]),
    ("config-wrong-suffix", ["plan", TINY, "--config", "{txt_config}"], {},
     ["config.txt", "must end in .json, .yaml or .yml"]),
    ("config-missing", ["plan", TINY, "--config", "{tmp}/nope.yaml"], {},
     ["config file", "nope.yaml", "does not exist"]),
    ("config-json-string", ["plan", TINY, "--config", '{{"mode": compile}}'], {}, ["config JSON string is invalid"]),
    ("plan-yaml-sections", ["plan", "{sections_yaml}"], {}, ["unknown sections ['executio']", "valid sections"]),
    ("calibration-missing", ["plan", TINY, "-cc.calibration=[{tmp}/none.yaml]"], {},
     ["calibration table", "none.yaml", "does not exist"]),
    # keys and values
    ("mode-choice", ["plan", TINY, "-cc.mode=fast"], {}, ["config key 'mode'", "'fast'", "'eager', 'compile'"]),
    ("backend-choice", ["plan", TINY, "-cc.moe_backend=grouped2"], {}, ["'moe_backend'", "did you mean 'grouped'"]),
    ("unknown-key", ["plan", TINY, "-cc.max_batch=4"], {}, ["unknown config key 'max_batch'", "valid keys"]),
    ("toggle-not-bool", ["plan", TINY, "-cc.pass_config.fuse_act_quant=maybe"], {},
     ["'pass_config.fuse_act_quant'", "true or false", "'maybe'"]),
    ("override-shape", ["plan", TINY, "-cc.mode"], {}, ["override 'mode'", "'dotted.key=value'"]),
    ("override-section", ["plan", TINY, "-cc.mode.x=1"], {}, ["'mode' is not a config section", "valid sections"]),
    # sizes, counts, fractions and byte amounts
    ("budget-fraction-looking", ["plan", TINY, "--config", "{budget_yaml}"], {},
     ["config key 'memory_budget' is 2.0", "fraction", "40GiB", "not read as 2 bytes"]),
    ("budget-env-two", ["plan", TINY], {"MOEFX_MEMORY_BUDGET": "2"},
     ["MOEFX_MEMORY_BUDGET='2'", "not read as 2 bytes"]),
    ("budget-env-percent", ["plan", TINY], {"MOEFX_MEMORY_BUDGET": "70"}, ["MOEFX_MEMORY_BUDGET='70'", "0.6"]),
    ("budget-env-unit", ["plan", TINY], {"MOEFX_MEMORY_BUDGET": "40XB"}, ["MOEFX_MEMORY_BUDGET='40XB'", "GiB"]),
    ("budget-negative", ["plan", TINY, "-cc.memory_budget=-1"], {}, ["'memory_budget'", "must be a number > 0"]),
    ("batch-cap-zero", ["plan", TINY, "-cc.max_batch_size=0"], {},
     ["'max_batch_size'", "integer >= 1 and <= 8192 or null"]),
    ("batch-cap-fraction", ["plan", TINY, "-cc.max_batch_size=1.5"], {}, ["'max_batch_size'", "integer", "1.5"]),
    ("plan-batch-cap", ["plan", TINY, "--max-batch-size", "-4"], {}, ["max_batch_size", "integer >= 1", "-4"]),
    ("plan-dtype", ["plan", TINY, "--dtype", "float8"], {}, ["dtype 'float8'", "'bfloat16', 'float16', 'float32'"]),
    ("plan-device", ["plan", TINY, "--device", "tpu"], {}, ["device 'tpu'", "'cpu', 'cuda'", "h100"]),
    ("passes-env", ["plan", TINY], {"MOEFX_PASSES": "fuse_everything=on"}, ["MOEFX_PASSES", "NAME=on|off"]),
    ("log-env", ["plan", TINY], {"MOEFX_LOG": "loud"}, ["MOEFX_LOG='loud'", "'debug', 'info'"]),
    ("cache-env", ["precompile", TINY, "--layers", "1", "--device", "cpu"], {"MOEFX_COMPILE_CACHE": "sometimes"},
     ["MOEFX_COMPILE_CACHE='sometimes'", "'off'"]),
    # parallel sizes that do not divide the model
    ("tp-not-dividing", ["plan", BIG, "--device", "h100", "--tp", "3"], {},
     ["tp_size 3 does not divide", "attention heads 32", "valid tp sizes", "[1, 2, 4, 8"]),
    ("ep-not-dividing", ["plan", BIG, "--device", "h100", "--ep", "3"], {},
     ["ep_size 3 does not divide", "128 experts", "valid ep sizes"]),
    ("tp-zero", ["plan", BIG, "--device", "h100", "--tp", "0"], {}, ["tp_size must be an integer >= 1", "0"]),
    # prompts, lengths and counts of the commands
    ("demo-empty-prompt", ["demo", "--prompt-len", "0"], {}, ["--prompt-len must be >= 1", "got 0"]),
    ("demo-past-positions", ["demo", "--prompt-len", "600"], {},
     ["prompt length 600", "max_position_embeddings 512", "valid: prompt length + max_new_tokens <= 512"]),
    ("demo-one-token", ["demo", "--new-tokens", "1"], {}, ["--new-tokens must be >= 2", "got 1"]),
    ("demo-no-batch", ["demo", "--batch", "0"], {}, ["--batch must be >= 1"]),
    ("demo-no-repeats", ["demo", "--repeats", "0"], {}, ["--repeats must be >= 1"]),
    ("precompile-lengths", ["precompile", TINY, "--prompt-lengths", "128,x"], {}, ["--prompt-lengths", "'128,x'"]),
    ("precompile-zero-batch", ["precompile", TINY, "--batch-sizes", "0"], {}, ["--batch-sizes", ">= 1", "'0'"]),
    ("precompile-layers", ["precompile", TINY, "--layers", "0"], {}, ["--layers must be between 1 and 2", "got 0"]),
    ("precompile-past-positions", ["precompile", TINY, "--layers", "1", "--device", "cpu", "--prompt-lengths", "600",
                                   "--cache-dir", "{tmp}/cache"], {},
     ["prompt length 600", "max_position_embeddings 512"]),
    ("precompile-unwritable", ["precompile", TINY, "--layers", "1", "--device", "cpu", "--cache-dir",
                               "{a_file}/cache"], {},
     ["compile cache folder", "a_file", "not writable", "--cache-dir"]),
    ("audit-top-p", ["audit-syncs", "--top-p", "1.5"], {}, ["--top-p must be in (0, 1]", "1.5"]),
    ("audit-temperature", ["audit-syncs", "--temperature", "0"], {}, ["--temperature must be > 0"]),
    ("audit-top-k", ["audit-syncs", "--top-k", "0"], {}, ["--top-k must be >= 1"]),
    ("bench-red-line", ["bench", "--b", "{{}}", "--red-line", "-1"], {}, ["--red-line", "> 0", "-1"]),
    ("bench-runs", ["bench", "--b", "{{}}", "--runs", "0"], {}, ["--runs must be >= 1"]),
    ("calibrate-reps", ["calibrate", "--model", TINY, "--reps", "0"], {}, ["--reps must be >= 1"]),
    ("calibrate-modes", ["calibrate", "--model", TINY, "--modes", "eager,fast"], {},
     ["--modes 'eager,fast'", "['fast']", "valid choices"]),
    ("calibrate-output", ["calibrate", "--model", TINY, "--quick", "--output", "{a_file}/t.yaml"], {},
     ["calibration table", "a_file", "cannot be written", "--output"]),
    # paths
    ("model-missing-path", ["plan", "{tmp}/nowhere/config.json"], {}, ["no such file or folder", "built-in names"]),
    ("model-empty-folder", ["plan", "{tmp}"], {}, ["holds no config.json"]),
    ("model-unknown-name", ["plan", "qwen9"], {}, ["unknown built-in model 'qwen9'", "valid names"]),
    ("fusions-target", ["explain-fusions", "{tmp}/nope.py"], {}, ["must look like FILE.py:FUNC"]),
]


def _api_rows(tmp: Path) -> dict[str, tuple]:
    """API rows: (callable, substrings of the ValueError)."""
    from moefx.config import CompilationConfig, parse_memory_budget
    from moefx.engine.request import check_prompt
    from moefx.models.catalog import catalog_config
    from moefx.models.tiny import tiny_qwen3_moe_config
    from moefx.signatures import ExecutionSignature, ModelSignature, load_rules, resolve

    big = ModelSignature.from_config(catalog_config(BIG))
    return {
        "api-from-any-yaml": (lambda: CompilationConfig.from_any(str(tmp / "bad.yaml")), ["bad.yaml", "line 2"]),
        "api-from-any-path": (lambda: CompilationConfig.from_any(tmp / "bad.json"), ["bad.json", "not valid JSON"]),
        "api-budget-two": (lambda: CompilationConfig.from_any({"memory_budget": 2.0}), ["memory_budget", "fraction"]),
        "api-budget-string": (lambda: parse_memory_budget("50"), ["50.0", "40GiB"]),
        "api-rules-file": (lambda: load_rules(tmp / "rules.yaml"), ["rule file", "rules.yaml", "line"]),
        "api-tp": (lambda: resolve(big, ExecutionSignature.preset("h100", tp_size=6)), ["tp_size 6", "valid tp"]),
        "api-ep": (lambda: resolve(big, ExecutionSignature.preset("h100", ep_size=5)), ["ep_size 5", "valid ep"]),
        "api-empty-prompt": (lambda: check_prompt(tiny_qwen3_moe_config(), 1, 0, 8), ["empty prompt", "at least 1"]),
        "api-past-positions": (lambda: check_prompt(tiny_qwen3_moe_config(), 2, 510, 8),
                               ["510 + max_new_tokens 8", "max_position_embeddings 512"]),
    }


API_IDS = ["api-from-any-yaml", "api-from-any-path", "api-budget-two", "api-budget-string", "api-rules-file",
           "api-tp", "api-ep", "api-empty-prompt", "api-past-positions"]


def write_files(tmp_path: Path, table: dict[str, tuple[str, str]]) -> dict[str, str]:
    """The table's files (key -> (name, text)) written under tmp_path: key -> path, and "tmp" -> the folder."""
    where = {"tmp": str(tmp_path)}
    for key, (name, text) in table.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        where[key] = str(path)
    return where


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    return write_files(tmp_path, FILES)


def _check_line(err: str, needles: list[str]) -> None:
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("moefx") and "error:" in line, err
    missing = [n for n in needles if n not in line]
    assert not missing, f"{missing} not in {line!r}"


@pytest.mark.parametrize("argv, env, needles", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_cli_input_is_one_line_and_exit_2(argv, env, needles, files, monkeypatch, capsys):
    from moefx.cli import main

    for name in ("moefx", "moefx.progress"):  # moefx's log handlers write to this test's captured stderr
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler:  # (not pytest's capture handlers)
                monkeypatch.setattr(handler, "stream", sys.stderr)
    monkeypatch.setenv("XDG_CONFIG_HOME", files["tmp"])  # nothing reaches the user's calibration folder
    monkeypatch.setenv("XDG_CACHE_HOME", files["tmp"])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        code = main([a.format(**files) for a in argv])
    except SystemExit as exc:  # argparse's own checks (types, choices) exit from inside parse_args
        code = exc.code
    assert code == 2
    _check_line(capsys.readouterr().err, needles)


@pytest.mark.parametrize("row", API_IDS)
def test_bad_api_input_is_a_value_error_naming_it(row, files):
    call, needles = _api_rows(Path(files["tmp"]))[row]
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_the_table_is_big_enough():
    assert len(ROWS) + len(API_IDS) >= 30 + 10  # 30 of our own beyond the ones the issue lists


SUBPROCESS = [
    (["plan", TINY, "--config", "{bad_yaml}"], {}, ["bad.yaml", "is not valid YAML"]),
    (["plan", TINY], {"MOEFX_MEMORY_BUDGET": "2"}, ["MOEFX_MEMORY_BUDGET='2'"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("argv, env, needles", SUBPROCESS, ids=["yaml-file", "budget-env"])
def test_bad_input_in_a_real_process(argv, env, needles, files):
    proc = subprocess.run([sys.executable, "-m", "moefx.cli", *(a.format(**files) for a in argv)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": files["tmp"], **env})
    assert proc.returncode == 2
    _check_line(proc.stderr, needles)
