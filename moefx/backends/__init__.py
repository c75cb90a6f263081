"""MoE expert backends behind one op, `moefx::moe_experts`, chosen per call by M."""

from moefx.backends import cpu, gemv, grouped, reference, routing, torch_grouped  # noqa: F401
from moefx.backends.dense import dense_linear
from moefx.backends.op import available_backends, moe_experts
from moefx.backends.registry import BACKENDS, MoEBackend, MoeCall, register_backend

__all__ = ["BACKENDS", "MoEBackend", "MoeCall", "available_backends", "dense_linear", "moe_experts", "register_backend"]
