"""moefx's request engine: transformers' `generate()` on a static KV cache, compiled steps and CUDA graphs.

Read top-down:
- `engine.py`: `DecodeLoop`, one request's lifecycle as named phases (admit, slot, prefill, decode, finish);
- `request.py`: what a request asks for, and the stop flag read one step late;
- `steps.py`: the compiled functions (the model forward, the sampler step) and how they compile;
- `slots.py` and `memory.py`: the static caches a request runs in, and the one memory budget they share;
- `prefill.py`: the prompt padded to its bucket (the buckets themselves: `PREFILL_BUCKETS` in `moefx/config.py`);
- `graphs.py`: the graph pool and the one capture routine of the decode step and the prefill;
- `hf_generate.py`: `model.generate()` routed to the engine, and transformers' own loop with a deferred stop check;
- `forward.py`: `model(...)` routed to the padded prefill where the call fits, else to the compiled forward;
- `install.py`: the `engine` model transform that puts it all on a model (`INSTALL_STEPS`, in order);
- `compile_cache/`: compiles kept across processes; `layers/`: decoder layers compiled once, whatever the depth.
"""
