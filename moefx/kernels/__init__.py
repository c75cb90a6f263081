"""Kernel utilities shared by the ops (`moefx.ops`) and the backends (`moefx.backends`): the per-key memos
(`memo.py`), Triton's availability (`availability.py`), the rounding helper the Triton kernels share
(`rounding.py`) and the compiled kernels' cache entries the engine's compile-cache file carries
(`triton_cache.py`). The bottom layer: nothing here imports another moefx package."""
