import dataclasses
import json
import subprocess
import sys

import pytest

from moefx.cli import split_config_overrides
from moefx.config import CompilationConfig, PassConfig


def test_from_any_accepts_every_form(tmp_path):
    data = {"pass_config": {"fuse_act_quant": True}, "moe_backend": "gemv", "max_batch_size": 8}
    json_path = tmp_path / "c.json"
    json_path.write_text(json.dumps(data))
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("pass_config:\n  fuse_act_quant: true\nmoe_backend: gemv\nmax_batch_size: 8\n")
    forms = [data, json.dumps(data), str(json_path), yaml_path, CompilationConfig.from_any(data)]
    hashes = {CompilationConfig.from_any(x).compute_hash() for x in forms}
    assert len(hashes) == 1
    cfg = CompilationConfig.from_any(str(yaml_path))
    assert cfg.pass_config.fuse_act_quant is True and cfg.moe_backend == "gemv" and cfg.max_batch_size == 8
    same = CompilationConfig.from_any(cfg)
    assert same is cfg


@pytest.mark.parametrize(
    "data, fragments",
    [
        ({"moe_backnd": "gemv"}, ["'moe_backnd'", "did you mean 'moe_backend'", "valid keys"]),
        ({"pass_config": {"fuse_act_qant": True}}, ["'pass_config.fuse_act_qant'", "did you mean 'fuse_act_quant'"]),
        ({"moe_backend": "gemm"}, ["'moe_backend'", "'gemm'", "valid choices", "'gemv'"]),
        ({"mode": "capturee"}, ["'mode'", "did you mean 'capture'"]),
        ({"offload": {"experts": "disk"}}, ["'offload.experts'", "'gpu'", "'cpu'", "'auto'"]),
        ({"max_batch_size": "8"}, ["'max_batch_size'", "integer"]),
        ({"max_batch_size": True}, ["'max_batch_size'", "integer"]),
        ({"pass_config": {"fuse_norm_quant": "yes"}}, ["'pass_config.fuse_norm_quant'", "true or false"]),
        ({"pass_config": []}, ["'pass_config'", "mapping"]),
        ({"rules": [1]}, ["'rules'", "list of strings"]),
        ({"max_batch_size": 0}, ["'max_batch_size'", ">= 1"]),
    ],
)
def test_bad_config_names_key_and_choices(data, fragments):
    with pytest.raises(ValueError) as err:
        CompilationConfig.from_any(data)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_bad_sources_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        CompilationConfig.from_any(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="must end in"):
        CompilationConfig.from_any("config.toml")
    with pytest.raises(ValueError, match="JSON string is invalid"):
        CompilationConfig.from_any("{not json")
    with pytest.raises(ValueError, match="got int"):
        CompilationConfig.from_any(3)


def _changed(value):
    if isinstance(value, bool):
        return not value
    if value is None:
        return True
    if isinstance(value, int):
        return value + 1
    if isinstance(value, list):
        return [*value, "extra.yaml"]
    return value


def test_hash_changes_with_every_field():
    base = CompilationConfig()
    seen = {base.compute_hash()}
    variants = []
    for f in dataclasses.fields(PassConfig):
        variants.append({"pass_config": {f.name: "/tmp/x" if f.name == "dump_graph_dir" else True}})
    for f in dataclasses.fields(CompilationConfig):
        if f.name in ("pass_config", "offload", "compile_cache"):
            continue
        value = getattr(base, f.name)
        new = {"moe_backend": "gemv", "dense_backend": "gemv", "mode": "eager", "prefill_token_budget": 4096,
               "prefill_capture_tokens": 2048, "max_batch_size": 8, "memory_budget": 0.5,
               "layer_regions": "prefill"}.get(
            f.name, _changed(value)
        )
        variants.append({f.name: new})
    variants.append({"offload": {"experts": "cpu"}})
    for v in variants:
        h = CompilationConfig.from_any(v).compute_hash()
        assert h not in seen, v
        seen.add(h)


def test_compile_cache_key_is_validated_and_not_hashed():
    base = CompilationConfig().compute_hash()
    for value in (True, False, "/tmp/moefx-cc"):
        cfg = CompilationConfig.from_any({"compile_cache": value})
        assert cfg.compile_cache == value and cfg.compute_hash() == base  # where artifacts live changes no compile
    for bad in (3, ["a"], ""):
        with pytest.raises(ValueError, match="compile_cache"):
            CompilationConfig.from_any({"compile_cache": bad})


def test_hash_follows_rule_file_content(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules: []\n")
    first = CompilationConfig.from_any({"rules": [str(rules)]}).compute_hash()
    rules.write_text("rules: [{match: {family: qwen3_moe}, enable: [fuse_act_quant]}]\n")
    assert CompilationConfig.from_any({"rules": [str(rules)]}).compute_hash() != first


def test_hash_is_stable_across_processes():
    data = {"pass_config": {"fuse_norm_quant": True}, "moe_backend": "grouped", "max_batch_size": 64}
    code = (
        "import json, sys; from moefx.config import CompilationConfig; "
        f"print(CompilationConfig.from_any(json.loads({json.dumps(json.dumps(data))})).compute_hash())"
    )
    outs = {subprocess.check_output([sys.executable, "-c", code], text=True).strip() for _ in range(2)}
    assert outs == {CompilationConfig.from_any(data).compute_hash()}


def test_dotted_overrides():
    argv, overrides = split_config_overrides(
        ["demo", "-cc.pass_config.fuse_act_quant=true", "--compilation-config.max_batch_size=32", "--device", "cpu"]
    )
    assert argv == ["demo", "--device", "cpu"]
    cfg = CompilationConfig().with_overrides(overrides)
    assert cfg.pass_config.fuse_act_quant is True and cfg.max_batch_size == 32
    with pytest.raises(ValueError, match="did you mean 'fuse_act_quant'"):
        CompilationConfig().with_overrides(["pass_config.fuse_act_quan=true"])
    with pytest.raises(ValueError, match="not a config section"):
        CompilationConfig().with_overrides(["mode.x=1"])
    with pytest.raises(ValueError, match="dotted.key=value"):
        CompilationConfig().with_overrides(["pass_config.fuse_act_quant"])
