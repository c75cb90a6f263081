"""Persistent compile artifacts (moefx/engine/compile_cache/file.py): a new process loads them and compiles nothing,
a stale or corrupt file is named in one warning, deleted and rebuilt, never loaded.

The file-format checks swap torch's Mega-Cache calls for fakes (no compile). The process tests share one cold
compile, `moefx precompile` of a 1-layer tiny Qwen3-MoE; the processes after it run `optimize` + `generate()` on
the same model, with an empty TORCHINDUCTOR_CACHE_DIR where they must depend on the file alone (the warm process)
and with the cold one's where only the rebuild is under test (a cheap recompile).
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

from moefx.engine.compile_cache import file as cc

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
    monkeypatch.setattr(cc, "load_payload", load)
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

    monkeypatch.setattr(cc, "load_payload", broken)
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


def test_precompile_errors_are_one_line(monkeypatch, capsys):
    from moefx.cli import main

    if not torch.cuda.is_available():
        assert main(["precompile", "tiny-qwen3-moe", "--device", "cuda"]) == 2
        assert "no CUDA device is available" in capsys.readouterr().err
    monkeypatch.setenv(cc.ENV, "off")
    assert main(["precompile", "tiny-qwen3-moe", "--layers", "1", "--device", "cpu", "--mode", "compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("moefx precompile: error: nothing to precompile: the compile cache is off")
    monkeypatch.setenv(cc.ENV, "sometimes")
    assert main(["precompile", "tiny-qwen3-moe", "--layers", "1", "--device", "cpu"]) == 2
    assert "MOEFX_COMPILE_CACHE='sometimes' is invalid" in capsys.readouterr().err


def _logged_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("failure", ["folder is a file", "disk full", "folder vanished"])
def test_an_unusable_folder_costs_one_warning_never_the_result(tmp_path, monkeypatch, caplog, failure):
    _fake_mega_cache(monkeypatch)
    if failure == "folder is a file":
        (tmp_path / "cache").write_text("not a folder")
        cache = cc.CompileCache(tmp_path / "cache" / "m.bin", {"model": "m"}, {"format": cc.FORMAT_VERSION})
    else:
        cache = _cache(tmp_path / "cache")

        def broken(src, dst):
            if failure == "disk full":
                raise OSError(28, "No space left on device")
            os.remove(src)  # the folder went away between the write and the rename
            raise FileNotFoundError(2, "No such file or directory", str(src))

        monkeypatch.setattr(cc.os, "replace", broken)

    class Engine:
        def generate(self, *args, **kwargs):
            return "tokens"

    engine = Engine()
    cache.attach(engine)
    assert engine.generate() == "tokens" and engine.generate() == "tokens"  # the result survives every save
    assert cache.save(force=True) == 0 and cache.unwritable
    warned = _logged_warnings(caplog)
    assert len(warned) == 1 and "could not be written" in warned[0] and "keeps running" in warned[0], warned
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no half-written file left behind
    if failure == "folder is a file":
        assert "is not writable" in cache.write_problem()


def test_graph_dump_and_calibration_folders_that_cannot_be_written_warn_once(tmp_path, caplog, recwarn):
    from moefx.backends import calibration
    from moefx.config import CompilationConfig
    from moefx.passes import PassManager

    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = CompilationConfig.from_any({"pass_config": {"dump_graph_dir": str(blocker / "dumps")}})
    manager = PassManager(cfg, [])
    graph = torch.fx.symbolic_trace(lambda x: x + 1).graph
    manager(graph)
    manager(graph)  # the compile goes on; the dump is off after one warning
    warned = _logged_warnings(caplog)
    assert len(warned) == 1 and "MOEFX_DUMP_GRAPHS" in warned[0] and manager.dump_dir is None
    assert calibration.write_problem(blocker / "t.yaml").startswith(f"calibration table {str(blocker / 't.yaml')!r}")
    assert calibration.write_problem(tmp_path / "ok" / "t.yaml") is None


# -- new processes -------------------------------------------------------------------------------------------

# Two compiles with a save after each (as the engine saves after every request that compiled), then a process
# with an empty inductor folder that loads the file and compiles both again.
MERGE_SCRIPT = r"""
import json, sys, torch
from torch._dynamo.utils import counters
from moefx.engine.compile_cache.file import load_payload
def f(x): return (x.sin() * 2).sum()
def g(x): return (x.cos() + 3).mean()
x = torch.randn(8)
if sys.argv[1] == "save":
    torch.compile(f)(x)
    torch.compiler.save_cache_artifacts()
    torch.compile(g)(x)
    open(sys.argv[2], "wb").write(torch.compiler.save_cache_artifacts()[0])
else:
    info = load_payload(open(sys.argv[2], "rb").read())
    torch.compile(f)(x)
    torch.compile(g)(x)
    print(json.dumps({"inductor": len(info.artifacts["inductor"]), "miss": counters["inductor"]["fxgraph_cache_miss"]}))
"""


@pytest.mark.compile
def test_a_file_saved_twice_loads_both_saves(tmp_path):
    """torch's own loader keeps the last save's chunk of each artifact kind; `load_payload` keeps them all."""
    payload = tmp_path / "payload.bin"
    for step, folder in (("save", "inductor-a"), ("load", "inductor-b")):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / folder)}
        proc = subprocess.run([sys.executable, "-c", MERGE_SCRIPT, step, str(payload)], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"inductor": 2, "miss": 0}


# What a serving process does: the tiny model (as `moefx precompile tiny-qwen3-moe --layers 1` builds it),
# transformers' own tokens first (uncompiled), then optimize + generate() on the engine, at batch 1 and 2 (each
# compiles apart: dynamo specializes size 1), so the file holds more than one save.
SCRIPT = r"""
import json, os
import torch
import moefx
from torch._dynamo.utils import counters
from moefx.models.spec import build_model_from_spec
if os.environ.get("FAKE_MOEFX_VERSION"):
    moefx.__version__ = os.environ["FAKE_MOEFX_VERSION"]
if os.environ.get("PADDED"):  # the padded prefill, which only a CUDA engine that captures takes, on this CPU engine,
    import moefx.engine.engine as engine_module  # its layer bodies writing the prompt into the cache

    _init = engine_module.DecodeLoop.__init__

    def _padded_init(self, *a, **k):  # the layer bodies write the prompt: `write_in_layers`, the default
        _init(self, *a, **{**k, "prefill_capture_tokens": int(os.environ["PADDED"])})

    engine_module.DecodeLoop.__init__ = _padded_init
model, _ = build_model_from_spec("tiny-qwen3-moe", int(os.environ.get("LAYERS", "1")), torch.device("cpu"),
                                torch.float32)
prompts = [torch.randint(1, 200, (batch, 6), generator=torch.Generator().manual_seed(batch)) for batch in (1, 2)]
kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
stock = [model.generate(ids, **kwargs).tolist() for ids in prompts]
if os.environ.get("HF_STATIC"):  # transformers' static-cache compile first, as a server running other compiled code
    from transformers import CompileConfig
    hf_compile = CompileConfig()
    hf_compile._compile_all_devices = True  # transformers compiles on CUDA only unless told
    model.generate(prompts[0], cache_implementation="static", compile_config=hf_compile, **kwargs)
model = moefx.optimize(model, config={"mode": "compile", "layer_regions": os.environ.get("REGIONS", "auto")})
out = [model.generate(ids, **kwargs).tolist() for ids in prompts]
forward = None
if os.environ.get("FORWARD"):  # the forward's fast path (model.moefx_forward): its own compiled step
    with torch.no_grad():
        forward = model(prompts[1]).logits[:, -1].tolist()
cache = model.moefx_generate.engine.compile_cache
print(json.dumps({"tokens": out, "stock": stock, "forward": forward,
                  "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                  "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
                  "aot_miss": counters["aot_autograd"]["autograd_cache_miss"], "loaded": cache.loaded,
                  "saved": cache.saved, "path": str(cache.path), "traced": counters["stats"]["unique_graphs"],
                  "compiles": model.moefx_generate.engine.stats.compiles,
                  "traces_loaded": (lambda aot: aot.loaded() if aot else 0)(model.moefx_generate.engine.aot_steps)}))
"""


def _env(tmp: Path, inductor: str, **env: str) -> dict[str, str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp / "xdg"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp / inductor), **env}
    for var in ("MOEFX_COMPILE_CACHE", "MOEFX_LOG"):
        if var not in env:
            full.pop(var, None)
    return full


def _run(tmp: Path, inductor: str, **env: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=_env(tmp, inductor, **env),
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == result["stock"]  # fp32: the compiled engine gives transformers' tokens
    return result, proc.stderr


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "compile cache" in line and "WARNING" in line]


@pytest.fixture(scope="module")
def precompiled(tmp_path_factory):
    """`moefx precompile` in a cold process: the one full compile of this module."""
    tmp = tmp_path_factory.mktemp("compile_cache")
    cmd = [sys.executable, "-m", "moefx.cli", "precompile", "tiny-qwen3-moe", "--layers", "1", "--device", "cpu",
           "--mode", "compile", "--batch-sizes", "1,2", "--prompt-lengths", "6", "--new-tokens", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp, "inductor-cold"), capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list((tmp / "xdg" / "moefx" / "compile").glob("*.bin"))
    return tmp, files, proc


@pytest.mark.compile
@pytest.mark.slow
def test_precompile_then_a_new_process_compiles_nothing_and_gives_the_same_tokens(precompiled):
    tmp, files, proc = precompiled
    assert len(files) == 1 and f"artifacts in {files[0]}" in proc.stdout and "precompiled tiny-qwen3-moe" in proc.stdout
    assert "moefx: compiling prefill" in proc.stderr and "moefx: saved compile cache" in proc.stderr
    before = files[0].stat().st_mtime_ns
    # Inductor's own cache folder is empty: everything comes from the file. Its saved traces run the prefill,
    # the decode step and the sampler at both batch sizes with no dynamo trace and no backend call.
    warm, warm_err = _run(tmp, "inductor-warm")
    assert warm["path"] == str(files[0])
    assert warm["fx_miss"] == 0 and warm["aot_miss"] == 0 and warm["loaded"] >= 3
    assert warm["traced"] == 0 and warm["compiles"] == {} and warm["traces_loaded"] >= 3, warm
    assert "moefx: loaded compile cache" in warm_err and "moefx: compiling" not in warm_err
    assert files[0].stat().st_mtime_ns == before  # nothing new, nothing rewritten
    quiet, quiet_err = _run(tmp, "inductor-warm", MOEFX_LOG="warning")
    assert quiet["fx_miss"] == 0 and "moefx: " not in quiet_err


@pytest.mark.compile
@pytest.mark.slow
def test_corrupt_file_and_changed_version_each_rebuild_once_with_one_warning(precompiled):
    tmp, files, _ = precompiled
    path = files[0]
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    # The cold process's inductor folder: the rebuild itself is cheap, the file is what is under test.
    rebuilt, stderr = _run(tmp, "inductor-cold")
    assert rebuilt["loaded"] == 0 and rebuilt["saved"] >= 3
    assert len(_warnings(stderr)) == 1 and "is corrupt (payload checksum mismatch)" in stderr
    newer, stderr = _run(tmp, "inductor-cold", FAKE_MOEFX_VERSION="99.0")
    assert newer["loaded"] == 0 and newer["saved"] >= 3
    warnings = _warnings(stderr)
    assert len(warnings) == 1 and "stale (moefx" in warnings[0] and "-> 99.0)" in warnings[0]
    header = json.loads(path.read_bytes()[len(cc.MAGIC):].split(b"\n", 1)[0])
    assert header["stamp"]["moefx"] == "99.0"
    again, stderr = _run(tmp, "inductor-cold", FAKE_MOEFX_VERSION="99.0")  # rebuilt once: loads from now on
    assert again["loaded"] >= 3 and not _warnings(stderr)


@pytest.mark.compile
@pytest.mark.slow
def test_layer_frames_a_new_process_traces_nothing(tmp_path):
    """The layer-call form torch < 2.12 takes (the GPU machine's 2.11): the steps, the forward's fast path and the
    layer bodies the frame ops call are all loaded, whatever dispatch keys the loaded steps give the bodies' inputs.
    scripts/test.sh's torch 2.11 stage runs it there, where the saved traces need enable_aot_compile."""
    cold, _ = _run(tmp_path, "inductor-cold", REGIONS="frames", LAYERS="2", FORWARD="1")
    assert cold["compiles"]["layer[decode]"] >= 1 and cold["traced"] >= 6
    assert any(name.startswith("forward[padded") for name in cold["compiles"]), cold["compiles"]
    warm, warm_err = _run(tmp_path, "inductor-warm", REGIONS="frames", LAYERS="2", FORWARD="1")
    assert warm["traced"] == 0 and warm["compiles"] == {} and warm["traces_loaded"] == cold["traced"], warm
    assert warm["fx_miss"] == 0 and warm["aot_miss"] == 0, warm
    torch.testing.assert_close(torch.tensor(warm["forward"]), torch.tensor(cold["forward"]), rtol=1e-5, atol=1e-5)
    assert "moefx: compiling" not in warm_err and "saved trace" not in warm_err


@pytest.mark.compile
@pytest.mark.slow
def test_layer_frames_padded_prefill_a_new_process_traces_nothing(tmp_path):
    """The padded prefill over the frames' buffered cache (its layer bodies write the prompt into the cache,
    `moefx::layer_stack_prefill_into`): saved with the other steps and loaded by a new process that traces nothing,
    with the cold process's tokens (transformers' own, `_run`)."""
    cold, _ = _run(tmp_path, "inductor-cold", REGIONS="frames", LAYERS="2", PADDED="64")
    assert cold["compiles"].get("prefill[padded, in layers]") and cold["compiles"].get("layer[prefill_into]"), \
        cold["compiles"]
    warm, warm_err = _run(tmp_path, "inductor-warm", REGIONS="frames", LAYERS="2", PADDED="64")
    assert warm["traced"] == 0 and warm["compiles"] == {} and warm["traces_loaded"] == cold["traced"], warm
    assert warm["fx_miss"] == 0 and warm["aot_miss"] == 0 and warm["tokens"] == cold["tokens"], warm
    assert "moefx: compiling" not in warm_err


# torch 2.11 (the GPU machine's) has torch._dynamo.aot_compile but torch.compile's result has no aot_compile: the
# same here by wrapping what torch.compile returns in a plain function.
NO_AOT = r"""
import torch
_compile = torch.compile
torch.compile = lambda *a, **k: (lambda c: c if isinstance(c, torch.nn.Module) else (lambda *x, **y: c(*x, **y)))(
    _compile(*a, **k))
"""


@pytest.mark.compile
def test_without_aot_compile_one_line_says_traces_are_off_and_tokens_are_eagers(tmp_path):
    proc = subprocess.run([sys.executable, "-c", NO_AOT + SCRIPT], cwd=ROOT, env=_env(tmp_path, "inductor"),
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == result["stock"] and result["traces_loaded"] == 0
    lines = [line for line in proc.stderr.splitlines() if "warning" in line.lower() and "trace" in line]
    assert len(lines) == 1 and "saved traces are off" in lines[0] and "has no aot_compile" in lines[0], lines


# The README path on CUDA plans its capture cap from the free memory the process reads (lower where transformers'
# static-cache compile ran first) and quotes that reading in the plan's text; the CPU plans no cap, so the same text
# gets the reading here.
READING = r"""
import os, sys
import moefx.planner.resolve
_resolve = sys.modules["moefx.planner.resolve"]  # the package's `resolve` is the function
_hints = _resolve.serving_hints
def _quoting(*args, **kwargs):
    values, sources = _hints(*args, **kwargs)
    sources["capture_sizes"] += f" (cap from {os.environ['FREE_GIB']} GiB free on this device)"
    return values, sources
_resolve.serving_hints = _quoting
"""


@pytest.mark.compile
@pytest.mark.slow
def test_a_new_machine_hits_whatever_the_saving_process_compiled_and_read_first(tmp_path):
    """The issue's protocol on the CPU, through the Mega-Cache alone (no aot_compile, as on torch 2.11): the saving
    process runs transformers' static-cache compile first and plans with less free memory; a new process with an
    empty inductor folder loads the file, compiles nothing and gives the saving process's tokens."""
    runs = []
    for inductor, free, hf in (("inductor-save", "20.2", "1"), ("inductor-new", "20.3", "")):
        env = _env(tmp_path, inductor, FREE_GIB=free, HF_STATIC=hf)
        proc = subprocess.run([sys.executable, "-c", NO_AOT + READING + SCRIPT], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr))
    (saved, _), (new, new_err) = runs
    assert saved["fx_miss"] > 0 and saved["tokens"] == saved["stock"]
    assert new["path"] == saved["path"] and new["loaded"] >= 3, new
    assert new["fx_miss"] == 0 and new["aot_miss"] == 0 and new["tokens"] == saved["tokens"], new
    assert not _warnings(new_err), _warnings(new_err)
