"""MoE expert backends behind one op, `moefx::moe_experts`, chosen per call by M."""
