"""Triton kernels behind the MoE backends. Each launcher also takes CPU tensors, so under
TRITON_INTERPRET=1 the kernels run (and are tested) without a GPU."""
