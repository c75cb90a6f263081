import os

import torch

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/moefx/inductor"))
# Without a GPU, Triton kernels run (and are tested) in Triton's interpreter. Must be set before any
# module that defines a @triton.jit kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
