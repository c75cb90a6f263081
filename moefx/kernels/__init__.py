"""Kernel utilities shared by the ops (`moefx.ops`) and the backends (`moefx.backends`): the per-key memos
(`memo.py`), Triton's availability (`availability.py`) and the rounding helper the Triton kernels share
(`rounding.py`). The bottom layer: nothing here imports another moefx package."""
