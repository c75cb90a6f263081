"""Expert offload: experts in host memory, computed on the CPU or streamed to the GPU."""
