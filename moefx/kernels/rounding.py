"""`round_as(x, DT)`: an fp32 value rounded to DT (round to nearest even) and back to fp32, as eager rounds each op.

A chain of casts `x.to(bf16).to(fp32)` says the same, but it is only a hint: the interpreter's bf16 downcast
truncates, and a compiled kernel's result depends on the compiler keeping the pair. The bf16 rounding here is
integer arithmetic on the bits, the same in the interpreter and on the GPU; fp16 keeps the cast (the interpreter
rounds it correctly).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_as(x, DT: tl.constexpr):
    if DT == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)  # two's-complement adds give the bits unsigned ones would
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x
