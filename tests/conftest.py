import os

import pytest
import torch

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/moefx/inductor"))
# Tests do not share engine compile-cache files across runs and worktrees; tests/test_compile_cache.py turns it on.
os.environ.setdefault("MOEFX_COMPILE_CACHE", "off")
# Without a GPU, Triton kernels run (and are tested) in Triton's interpreter. Must be set before any
# module that defines a @triton.jit kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_warn_once(monkeypatch):
    """Each test sees moefx's one-time warnings afresh (the env aliases' too), whatever ran before it."""
    import moefx.env
    import moefx.log

    monkeypatch.setattr(moefx.log, "_warned", set())
    monkeypatch.setattr(moefx.env, "_aliases_warned", set())


@pytest.fixture
def isolated_moe_tables(tmp_path, monkeypatch):
    """Point the user calibration folder at an empty temp dir and clear the MoE env knobs (and the table cache)."""
    from moefx.backends.calibration import invalidate

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for var in ("MOEFX_MOE_BACKEND", "MOEFX_USE_GEMV"):
        monkeypatch.delenv(var, raising=False)
    invalidate()
    yield
    invalidate()
