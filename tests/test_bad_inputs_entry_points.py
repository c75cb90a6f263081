"""More bad inputs at every entry point (CLI flag, `-cc`, config / rule / calibration / model file, `generate()`
arguments): each is one line naming the bad value and what is valid, exit 2 from the CLI, ValueError from the API,
before anything runs. The same table form as tests/test_bad_inputs.py, whose rows these do not repeat.

`{name}` in a row is a file of FILES written under tmp_path (`{tmp}` is the folder itself).
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.test_bad_inputs import _check_line, write_files

TINY = "tiny-qwen3-moe"
DUP = "mode: eager\nmode: compile\n"

FILES = {
    "dup_yaml": ("dup.yaml", DUP),
    "dup_nested": ("nested.yaml", "pass_config:\n  fuse_act_quant: true\n  fuse_act_quant: false\n"),
    "dup_json": ("dup.json", '{"mode": "eager", "mode": "compile"}'),
    "empty_yaml": ("empty.yaml", ""),
    "comment_yaml": ("comment.yaml", "# every key at its default\n"),
    "big_batch": ("big.yaml", "max_batch_size: 1000000000000\n"),
    "dup_rules": ("rules.yaml", "rules: []\nrules: []\n"),
    "empty_table": ("table.yaml", ""),
    "dup_model": ("dupmodel/config.json", '{"model_type": "qwen3_moe", "model_type": "mixtral"}'),
    "sig_dup": ("sig.yaml", "model:\n  model_type: qwen3_moe\nexecution:\n  mode: eager\n  mode: compile\n"),
    "sig_batch": ("sigbatch.yaml", "model:\n  model_type: qwen3_moe\nexecution:\n  max_batch_size: 100000\n"),
    "fusions_py": ("user.py", "def f(x):\n    return x * 2\n\n\ndef example_inputs():\n    return []\n"),
    "tables": ("tables/keep", ""),
}

# (id, argv, substrings of the one error line)
ROWS = [
    # a key given twice: YAML and JSON keep the last one silently
    ("config-dup-key", ["plan", TINY, "--config", "{dup_yaml}"],
     ["dup.yaml", "line 2, column 1", "'mode' is repeated"]),
    ("config-dup-nested", ["plan", TINY, "--config", "{dup_nested}"], ["nested.yaml", "line 3", "'fuse_act_quant'"]),
    ("config-dup-json", ["plan", TINY, "--config", "{dup_json}"], ["dup.json", "repeats the key 'mode'"]),
    ("config-dup-json-string", ["plan", TINY, "--config", '{{"mode": "eager", "mode": "eager"}}'],
     ["config JSON string repeats the key 'mode'", "each key once"]),
    ("override-dup-in-value", ["plan", TINY, "-cc.pass_config={{fuse_act_quant: true, fuse_act_quant: false}}"],
     ["override 'pass_config=", "'fuse_act_quant' is repeated"]),
    ("rule-file-dup", ["plan", TINY, "-cc.rules=[{dup_rules}]"], ["rule file", "rules.yaml", "'rules' is repeated"]),
    ("model-json-dup", ["plan", "{tmp}/dupmodel"], ["model config", "config.json", "repeats the key 'model_type'"]),
    ("plan-signature-dup", ["plan", "{sig_dup}"], ["model signature file", "sig.yaml", "'mode' is repeated"]),
    ("bench-config-dup", ["bench", "--b", "{dup_yaml}"], ["dup.yaml", "'mode' is repeated"]),
    ("demo-config-dup", ["demo", "--config", "{dup_yaml}"], ["dup.yaml", "'mode' is repeated"]),
    ("audit-config-dup", ["audit-syncs", "--config", "{dup_yaml}"], ["dup.yaml", "'mode' is repeated"]),
    ("precompile-config-dup", ["precompile", TINY, "--config", "{dup_yaml}"], ["dup.yaml", "'mode' is repeated"]),
    # empty files: a config file that sets nothing is not the same as no --config
    ("config-empty", ["plan", TINY, "--config", "{empty_yaml}"], ["config file", "empty.yaml", "is empty", "valid"]),
    ("config-comments-only", ["plan", TINY, "--config", "{comment_yaml}"], ["comment.yaml", "is empty"]),
    ("bench-config-empty", ["bench", "--a", "{empty_yaml}", "--b", "{{}}"], ["empty.yaml", "is empty"]),
    ("calibration-empty", ["plan", TINY, "-cc.calibration=[{empty_table}]"],
     ["calibration table", "table.yaml", "is empty", "'rows'"]),
    ("rule-file-empty", ["plan", TINY, "-cc.rules=[{empty_yaml}]"], ["rule file", "empty.yaml", "'rules' list"]),
    ("calibration-folder", ["plan", TINY, "-cc.calibration=[{tmp}/tables]"],
     ["calibration table", "tables", "is a folder", "table file"]),
    # bounds on sizes
    ("batch-cap-huge-cc", ["plan", TINY, "-cc.max_batch_size=1000000000000"],
     ["'max_batch_size'", "<= 8192", "1000000000000"]),
    ("batch-cap-huge-file", ["plan", TINY, "--config", "{big_batch}"], ["'max_batch_size'", "<= 8192"]),
    ("plan-batch-flag-huge", ["plan", TINY, "--max-batch-size", "100000"], ["max_batch_size must be <= 8192"]),
    ("plan-signature-batch", ["plan", "{sig_batch}"], ["max_batch_size must be <= 8192", "100000"]),
    ("precompile-batch-huge", ["precompile", TINY, "--max-batch-size", "100000"], ["'max_batch_size'", "<= 8192"]),
    ("prefill-budget-huge", ["plan", TINY, "-cc.prefill_token_budget=1000000000000000000000000000000"],
     ["'prefill_token_budget'", "<= 1048576", "tokens per prefill chunk"]),
    ("prefill-budget-float", ["plan", TINY, "-cc.prefill_token_budget=1.0e+30"],
     ["'prefill_token_budget'", "must be an integer", "1e+30"]),
    ("prefill-budget-zero", ["plan", TINY, "-cc.prefill_token_budget=0"], ["'prefill_token_budget'", ">= 1", "got 0"]),
    ("prefill-budget-bool", ["plan", TINY, "-cc.prefill_token_budget=true"], ["'prefill_token_budget'", "True"]),
    ("demo-batch-huge", ["demo", "--batch", "100000"], ["--batch must be <= 512", "100000"]),
    ("demo-batch-513", ["demo", "--batch", "513"], ["--batch must be <= 512", "513"]),
    # -cc on the commands that ignored it
    ("fusions-cc-unknown-key", ["explain-fusions", "{fusions_py}:f", "-cc.nokey=1"],
     ["unknown config key 'nokey'", "valid keys"]),
    ("fusions-cc-bad-toggle", ["explain-fusions", "{fusions_py}:f", "-cc.pass_config.fuse_act_quant=maybe"],
     ["'pass_config.fuse_act_quant'", "true or false"]),
    ("calibrate-cc-unknown-key", ["calibrate", "--model", TINY, "-cc.nokey=1"],
     ["calibrate reads no compilation config", "['nokey=1']", "valid: no -cc"]),
    ("calibrate-cc-valid-key", ["calibrate", "--model", TINY, "-cc.pass_config.fuse_act_quant=false"],
     ["calibrate reads no compilation config", "fuse_act_quant=false"]),
]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    return write_files(tmp_path, FILES)


@pytest.mark.parametrize("argv, needles", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_cli_input_is_one_line_and_exit_2(argv, needles, files, monkeypatch, capsys):
    from moefx.cli import main

    for name in ("moefx", "moefx.progress"):  # moefx's log handlers write to this test's captured stderr
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler:
                monkeypatch.setattr(handler, "stream", sys.stderr)
    monkeypatch.setenv("XDG_CONFIG_HOME", files["tmp"])  # nothing reaches the user's calibration folder
    monkeypatch.setenv("XDG_CACHE_HOME", files["tmp"])
    try:
        code = main([a.format(**files) for a in argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    _check_line(capsys.readouterr().err, needles)


@pytest.fixture(scope="module")
def optimized():
    import moefx
    from moefx.models import build_model, tiny_qwen3_moe_config

    model = build_model(tiny_qwen3_moe_config(), dtype=torch.float32)
    return moefx.optimize(model, config={"mode": "eager"})


def _api_rows(tmp: Path, model) -> dict[str, tuple]:
    """API rows: (callable, substrings of the ValueError)."""
    from moefx.backends.calibration import load_table
    from moefx.config import CompilationConfig
    from moefx.engine.request import check_input_ids
    from moefx.sampling.sampler import SamplingParams
    from moefx.signatures import ExecutionSignature, load_rules

    def gen(ids, **kw):
        return lambda: model.generate(ids, max_new_tokens=2, do_sample=False, **kw)

    vocab = model.config.vocab_size
    return {
        "api-generate-id-at-vocab": (gen(torch.full((1, 4), vocab)), [f"token id {vocab}", f"vocab_size {vocab}"]),
        "api-generate-id-negative": (gen(torch.tensor([[3, -1, 4]])), ["token id -1", "0 <= id <"]),
        "api-generate-float-ids": (gen(torch.ones(2, 3)), ["integer token ids", "float32", "input_ids.long()"]),
        "api-generate-bool-ids": (gen(torch.ones(1, 3, dtype=torch.bool)), ["integer token ids", "bool"]),
        "api-generate-keyword-ids": (lambda: model.generate(input_ids=torch.full((1, 2), 10**6), max_new_tokens=2),
                                     ["token id 1000000"]),
        "api-generate-sampling-ids": (gen(torch.full((1, 2), vocab + 5), temperature=0.7),
                                      [f"token id {vocab + 5}"]),
        "api-engine-id-at-vocab": (lambda: model.moefx_generate.engine.generate(
            torch.full((1, 3), vocab), 2, SamplingParams(temperature=0)), [f"token id {vocab}"]),
        "api-check-int32-ids": (lambda: check_input_ids(model.config, torch.full((1, 2), vocab, dtype=torch.int32)),
                                [f"token id {vocab}"]),
        "api-batch-cap-huge": (lambda: CompilationConfig.from_any({"max_batch_size": 10**12}),
                               ["'max_batch_size'", "<= 8192"]),
        "api-prefill-budget-huge": (lambda: CompilationConfig.from_any({"prefill_token_budget": 2**21}),
                                    ["'prefill_token_budget'", "2097152"]),
        "api-execution-batch-huge": (lambda: ExecutionSignature(max_batch_size=10**6), ["<= 8192", "1000000"]),
        "api-rules-dup": (lambda: load_rules(tmp / "rules.yaml"), ["rule file", "'rules' is repeated"]),
        "api-table-empty": (lambda: load_table(tmp / "table.yaml"), ["calibration table", "is empty"]),
        "api-table-folder": (lambda: load_table(tmp / "tables"), ["is a folder"]),
        "api-from-any-dup": (lambda: CompilationConfig.from_any(tmp / "dup.yaml"), ["dup.yaml", "'mode' is repeated"]),
        "api-from-any-empty": (lambda: CompilationConfig.from_any(str(tmp / "empty.yaml")), ["empty.yaml", "empty"]),
    }


API_IDS = ["api-generate-id-at-vocab", "api-generate-id-negative", "api-generate-float-ids", "api-generate-bool-ids",
           "api-generate-keyword-ids", "api-generate-sampling-ids", "api-engine-id-at-vocab", "api-check-int32-ids",
           "api-batch-cap-huge", "api-prefill-budget-huge", "api-execution-batch-huge", "api-rules-dup",
           "api-table-empty", "api-table-folder", "api-from-any-dup", "api-from-any-empty"]


@pytest.mark.parametrize("row", API_IDS)
def test_bad_api_input_is_a_value_error_naming_it(row, files, optimized):
    call, needles = _api_rows(Path(files["tmp"]), optimized)[row]
    requests = optimized.moefx_generate.engine.stats.requests
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and all(n in message for n in needles), message
    assert optimized.moefx_generate.engine.stats.requests == requests  # refused before the engine ran anything


def test_the_table_is_big_enough():
    assert len(ROWS) + len(API_IDS) >= 30 and len(set(API_IDS)) == len(API_IDS)
    assert len({r[0] for r in ROWS}) == len(ROWS)


def test_a_user_calibration_folder_that_is_a_file_is_said_once(tmp_path, monkeypatch):
    """The user table folder's path holds a file: one warning naming it, and the shipped tables still decide."""
    import moefx.log
    from moefx.backends import calibration

    (tmp_path / "moefx").mkdir()
    (tmp_path / "moefx" / "calibration").write_text("not a folder\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr(moefx.log, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = calibration.table_paths()
        calibration.table_paths()
    said = [str(w.message) for w in caught if "is not a folder" in str(w.message)]
    assert len(said) == 1 and str(tmp_path / "moefx" / "calibration") in said[0], said
    assert paths and all(p.parent == calibration.PACKAGE_TABLES for p in paths)


def test_generate_takes_good_ids_after_refusing_bad_ones(optimized):
    """The check refuses and changes nothing: the next good request runs on the engine."""
    with pytest.raises(ValueError):
        optimized.generate(torch.full((1, 2), optimized.config.vocab_size), max_new_tokens=2, do_sample=False)
    out = optimized.generate(torch.tensor([[0, optimized.config.vocab_size - 1]]), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 4)
