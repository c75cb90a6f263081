"""The router shapes the Triton routing kernel (`moe_routing.py`) takes, importable without Triton: the routing op
and the `fuse_moe_routing` pass ask before they use it, the dense kernel's ROUTE epilogue before it routes."""

from __future__ import annotations

MAX_KERNEL_EXPERTS = 4096  # one program holds a row of E scores in registers


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kernel_supports(num_experts: int, n_group: int = 1) -> str | None:
    """None when the Triton kernel takes this routing shape, else why not (any top_k is taken)."""
    if num_experts > MAX_KERNEL_EXPERTS:
        return f"E={num_experts} exceeds the kernel's {MAX_KERNEL_EXPERTS}"
    if n_group > 1 and not (_pow2(n_group) and _pow2(num_experts // n_group)):
        return f"n_group={n_group} with {num_experts // n_group} experts per group: the kernel needs powers of two"
    return None
