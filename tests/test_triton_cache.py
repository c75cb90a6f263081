"""moefx's Triton kernel entries travel in the compile-cache file: collected from one Triton cache folder (only
moefx's kernels and the launcher stubs), written into another, the group file's paths pointed at the new folder."""

from __future__ import annotations

import json

import pytest

from moefx.kernels import triton_cache

pytest.importorskip("triton")


def _entry(folder, key: str, name: str, extra: dict[str, bytes] | None = None) -> None:
    entry = folder / key
    entry.mkdir(parents=True)
    (entry / f"{name}.json").write_text(json.dumps({"name": name, "num_warps": 4}))
    (entry / f"{name}.cubin").write_bytes(b"\x7fELF" + name.encode())
    (entry / f"__grp__{name}.json").write_text(json.dumps(
        {"child_paths": {f"{name}.cubin": str(entry / f"{name}.cubin"), f"{name}.json": str(entry / f"{name}.json")}}))
    for file, data in (extra or {}).items():
        (entry / file).write_bytes(data)


def test_collect_then_restore_into_an_empty_folder(tmp_path, monkeypatch):
    saving, fresh = tmp_path / "saving", tmp_path / "fresh"
    _entry(saving, "k1", "_dense_gemv_kernel")
    _entry(saving, "k2", "triton_poi_fused_add_0")  # an inductor kernel: inductor's own artifacts carry it
    launcher = saving / "l1"
    launcher.mkdir()
    (launcher / "__triton_launcher.so").write_bytes(b"\x7fELF launcher")
    monkeypatch.setattr(triton_cache, "cache_dir", lambda: saving)
    entries = triton_cache.collect({"_dense_gemv_kernel"})
    assert set(entries) == {"k1", "l1"}
    assert set(entries["k1"]) == {"_dense_gemv_kernel.json", "_dense_gemv_kernel.cubin",
                                  "__grp___dense_gemv_kernel.json"}

    monkeypatch.setattr(triton_cache, "cache_dir", lambda: fresh)
    assert triton_cache.restore(entries) == 2
    assert triton_cache.restore(entries) == 0  # already there: nothing rewritten
    group = json.loads((fresh / "k1" / "__grp___dense_gemv_kernel.json").read_text())
    assert all(path.startswith(str(fresh / "k1")) for path in group["child_paths"].values())
    assert (fresh / "k1" / "_dense_gemv_kernel.cubin").read_bytes() == b"\x7fELF_dense_gemv_kernel"
    assert (fresh / "l1" / "__triton_launcher.so").is_file() and not (fresh / "k2").exists()


def test_limit_keeps_kernels_first_and_a_missing_folder_gives_nothing(tmp_path, monkeypatch):
    _entry(tmp_path, "k1", "_moe_kernel", {"big.bin": b"x" * 1000})
    launcher = tmp_path / "l1"
    launcher.mkdir()
    (launcher / "__triton_launcher.so").write_bytes(b"y" * 1000)
    monkeypatch.setattr(triton_cache, "cache_dir", lambda: tmp_path)
    assert set(triton_cache.collect({"_moe_kernel"}, limit=1500)) == {"k1"}
    monkeypatch.setattr(triton_cache, "cache_dir", lambda: tmp_path / "missing")
    assert triton_cache.collect({"_moe_kernel"}) == {}


def test_moefx_kernel_names_are_found_in_loaded_modules():
    import moefx.kernels.dense_gemm  # noqa: F401

    names = triton_cache.moefx_kernel_names()
    assert {"_dense_kernel", "round_as"} <= names
