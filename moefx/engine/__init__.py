"""moefx's request engine: transformers' `generate()` on a static KV cache, compiled steps and CUDA graphs."""
