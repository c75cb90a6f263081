"""The bound probes' kernels (bench/probe_read.py, bench/probe_ceilings.py) compute what they claim, under the Triton
interpreter: a timing of a kernel that reads or multiplies wrongly would bound nothing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.parametrize("programs,block", [(3, 64), (5, 32)])
def test_read_kernel_reads_every_word_once(programs: int, block: int) -> None:
    import probe_read

    words = 1000  # not a multiple of programs * block: the last block is masked
    buf = torch.randint(-1000, 1000, (words,), dtype=torch.int32)
    out = torch.empty(programs, dtype=torch.int32)
    iters = -(-words // (programs * block))
    probe_read._read_kernel[(programs,)](buf, out, words, BLOCK=block, ITERS=iters)
    assert out.sum().item() == buf.sum().item()


def test_dense_mm_kernel_matches_torch() -> None:
    import probe_ceilings
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = 32, 16, 16
    a = torch.randn(96, 48)
    b = torch.randn(64, 48)
    c = torch.empty(96, 64, dtype=torch.bfloat16)
    descs = (TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]),
             TensorDescriptor.from_tensor(c, [bm, bn]))
    probe_ceilings._dense_mm_kernel[(3 * 4,)](*descs, 96, 64, 48, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=2)
    ref = a @ b.t()
    assert ((c.float() - ref).norm() / ref.norm()).item() < 1e-2
