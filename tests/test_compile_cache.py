"""Persistent compile artifacts (moefx/sampling/compile_cache.py): a new process loads them and compiles nothing,
a stale or corrupt file is named in one warning, deleted and rebuilt, never loaded.

The file-format checks swap torch's Mega-Cache calls for fakes (no compile). The process tests run a 1-layer tiny
Qwen3-MoE through `optimize` + `generate()` in subprocesses that share one cold compile; each has its own
TORCHINDUCTOR_CACHE_DIR where it must depend on the Mega-Cache file (the warm process), and reuses the cold one's
where only the rebuild is under test (a cheap recompile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from moefx.sampling import compile_cache as cc

ROOT = Path(__file__).resolve().parents[1]


# -- the file, without compiles ------------------------------------------------------------------------------


def _fake_mega_cache(monkeypatch, payload: bytes = b"artifact bytes") -> list[bytes]:
    loaded: list[bytes] = []

    def save():
        info = torch.compiler._cache.CacheInfo(defaultdict(list, {"inductor": ["a", "b"], "aot_autograd": ["c"]}))
        return payload, info

    def load(data):
        loaded.append(data)
        return torch.compiler._cache.CacheInfo(defaultdict(list, {"inductor": ["a", "b"], "aot_autograd": ["c"]}))

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return loaded


def _cache(tmp_path: Path, **stamp) -> cc.CompileCache:
    return cc.CompileCache(tmp_path / "m.bin", {"model": "m", "buckets": [1]},
                           {"format": cc.FORMAT_VERSION, "torch": "2.13", "moefx": "1", **stamp})


def test_sound_file_loads_and_a_nothing_new_request_does_not_rewrite(tmp_path, monkeypatch):
    loaded = _fake_mega_cache(monkeypatch)
    assert _cache(tmp_path).save(force=True) == 3
    again = _cache(tmp_path)
    assert again.load() == 3 and loaded == [b"artifact bytes"]
    before = again.path.stat().st_mtime_ns
    assert again.save() == 0 and again.path.stat().st_mtime_ns == before  # nothing compiled since the load


@pytest.mark.parametrize("damage", ["payload", "header", "magic", "truncated"])
def test_corrupt_file_is_deleted_with_one_warning_never_loaded(tmp_path, monkeypatch, caplog, damage):
    loaded = _fake_mega_cache(monkeypatch)
    first = _cache(tmp_path)
    first.save(force=True)
    data = bytearray(first.path.read_bytes())
    if damage == "payload":
        data[-1] ^= 0xFF
    elif damage == "header":
        data[len(cc.MAGIC)] = ord("#")  # the header is no JSON any more
    elif damage == "magic":
        data[0] ^= 0xFF
    else:
        data = data[:-4]
    first.path.write_bytes(bytes(data))
    second = _cache(tmp_path)
    assert second.load() == 0 and loaded == [] and not second.path.exists()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "corrupt" in warnings[0].getMessage()
    assert second.save() == 3 and second.path.exists()  # the first request after a rebuild writes it again


def test_changed_version_is_stale_and_torch_load_failure_is_corrupt(tmp_path, monkeypatch, caplog):
    loaded = _fake_mega_cache(monkeypatch)
    _cache(tmp_path).save(force=True)
    newer = _cache(tmp_path, moefx="2")
    assert newer.load() == 0 and loaded == [] and not newer.path.exists()
    assert "stale (moefx 1 -> 2)" in caplog.records[-1].getMessage()
    newer.save(force=True)

    def broken(data):
        raise RuntimeError("bad pickle")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", broken)
    again = _cache(tmp_path, moefx="2")
    assert again.load() == 0 and not again.path.exists()
    assert "torch could not load it: RuntimeError: bad pickle" in caplog.records[-1].getMessage()


def test_cache_folder_from_config_and_env(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cc.cache_folder(None, {}) == tmp_path / "moefx" / "compile"
    assert cc.cache_folder(None, {cc.ENV: "off"}) is None
    assert cc.cache_folder(None, {cc.ENV: "/x/y"}) == Path("/x/y")
    assert cc.cache_folder(True, {cc.ENV: "off"}) == tmp_path / "moefx" / "compile"  # the config key wins
    assert cc.cache_folder(False, {}) is None and cc.cache_folder("/z", {}) == Path("/z")
    with pytest.raises(ValueError, match="MOEFX_COMPILE_CACHE='maybe'"):
        cc.cache_folder(None, {cc.ENV: "maybe"})


# -- new processes -------------------------------------------------------------------------------------------

SCRIPT = r"""
import json, os, sys, time
import torch
import moefx
from torch._dynamo.utils import counters
from moefx.models import build_model, tiny_qwen3_moe_config
if os.environ.get("FAKE_MOEFX_VERSION"):
    moefx.__version__ = os.environ["FAKE_MOEFX_VERSION"]
model = build_model(tiny_qwen3_moe_config(num_hidden_layers=1), seed=3)
model = moefx.optimize(model, config={"mode": "compile"})
ids = torch.randint(1, 200, (1, 6), generator=torch.Generator().manual_seed(0))
start = time.perf_counter()
out = model.generate(ids, max_new_tokens=3, do_sample=False)
cache = model.moefx_generate.engine.compile_cache
print(json.dumps({"tokens": out.tolist(), "seconds": time.perf_counter() - start,
                  "fx_miss": counters["inductor"]["fxgraph_cache_miss"], "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
                  "aot_miss": counters["aot_autograd"]["autograd_cache_miss"], "loaded": cache.loaded,
                  "saved": cache.saved, "path": str(cache.path)}))
"""


def _run(tmp: Path, inductor: str, **env: str) -> tuple[dict, str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp / "xdg"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp / inductor), **env}
    full.pop("MOEFX_COMPILE_CACHE", None)
    full.pop("MOEFX_LOG", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=full, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "compile cache" in line and "WARNING" in line]


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile_cache")
    result, stderr = _run(tmp, "inductor-cold")
    return tmp, result, stderr


@pytest.mark.compile
@pytest.mark.slow
def test_new_process_compiles_nothing_and_gives_the_same_tokens(cold):
    tmp, first, stderr = cold
    assert first["fx_miss"] >= 3 and first["loaded"] == 0 and first["saved"] >= 3 and Path(first["path"]).is_file()
    assert "moefx: compiling prefill" in stderr and "moefx: saved compile cache" in stderr  # progress by default
    before = Path(first["path"]).stat().st_mtime_ns
    # Inductor's own cache folder is empty: every hit comes from the file.
    warm, warm_err = _run(tmp, "inductor-warm")
    assert warm["tokens"] == first["tokens"]
    assert warm["fx_miss"] == 0 and warm["aot_miss"] == 0 and warm["fx_hit"] >= 3 and warm["loaded"] >= 3
    assert "moefx: loaded compile cache" in warm_err and "(from the compile cache)" in warm_err
    assert Path(first["path"]).stat().st_mtime_ns == before  # nothing new, nothing rewritten
    quiet, quiet_err = _run(tmp, "inductor-warm", MOEFX_LOG="warning")
    assert quiet["tokens"] == first["tokens"] and "moefx: " not in quiet_err


@pytest.mark.compile
@pytest.mark.slow
def test_corrupt_file_and_changed_version_each_rebuild_once_with_one_warning(cold):
    tmp, first, _ = cold
    path = Path(first["path"])
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    rebuilt, stderr = _run(tmp, "inductor-cold")
    assert rebuilt["tokens"] == first["tokens"] and rebuilt["loaded"] == 0 and rebuilt["saved"] >= 3
    assert len(_warnings(stderr)) == 1 and "is corrupt (payload checksum mismatch)" in stderr
    newer, stderr = _run(tmp, "inductor-cold", FAKE_MOEFX_VERSION="99.0")
    assert newer["tokens"] == first["tokens"] and newer["loaded"] == 0 and newer["saved"] >= 3
    warnings = _warnings(stderr)
    assert len(warnings) == 1 and "stale (moefx" in warnings[0] and "-> 99.0)" in warnings[0]
    header = json.loads(path.read_bytes()[len(b"moefx-compile-cache\n"):].split(b"\n", 1)[0])
    assert header["stamp"]["moefx"] == "99.0"
    again, stderr = _run(tmp, "inductor-cold", FAKE_MOEFX_VERSION="99.0")  # rebuilt once: loads from now on
    assert again["loaded"] >= 3 and not _warnings(stderr) and again["tokens"] == first["tokens"]
