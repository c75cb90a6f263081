"""moefx's decode loop for transformers causal LMs: static cache, compiled step, no host sync per token.

Each step is two compiled graphs: the model forward (one new token per sequence, `logits_to_keep=1`)
and the sampler with the EOS bookkeeping. Neither reads anything back to the host. The only host
read is the "all finished?" flag, copied asynchronously into pinned memory and read one step late
(the extra token is dropped), so the host keeps queueing work while the GPU runs.

`cuda_graphs=True` instead captures the eager forward in a CUDA graph once per batch size (no compile):
each step is one replay, so no Python runs per layer. Offloaded experts take part as host-function nodes
(`moefx.offload.stream_host`). A forward that cannot be captured runs eagerly for that batch size, with a
warning saying why.
"""

from __future__ import annotations

from typing import Any

import torch

from moefx.log import warn_once
from moefx.sampling.sampler import SamplingParams, sample


def _step_tokens(
    logits: torch.Tensor, finished: torch.Tensor, params: SamplingParams, eos: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nxt = sample(logits[:, -1, :], params)
    nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
    finished = finished | (nxt == eos)
    return nxt, finished, finished.all()


def _uncapturable_cache(cache: Any) -> str | None:
    """Why replaying a captured forward could go wrong with this cache (None: every layer keeps its state on
    the device, like transformers' StaticLayer; sliding-window layers keep a host-side length)."""
    kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", None) or []})
    if kinds != ["StaticLayer"]:
        return f"cache layers {kinds or 'unknown'} (only StaticLayer keeps all its state on the device)"
    return None


class DecodeLoop:
    """Generate with `model` (a transformers causal LM) using a StaticCache of `max_len` positions.

    `compile_kwargs` go to `torch.compile` for both graphs (e.g. `{"backend": moefx.backend(cfg)}`);
    None runs eagerly. `cuda_graphs=True` (eager forward only, CUDA inputs) replays a captured forward per
    batch size.
    """

    def __init__(self, model: Any, max_len: int, compile_kwargs: dict[str, Any] | None = None,
                 cuda_graphs: bool = False) -> None:
        from transformers import StaticCache

        if cuda_graphs and compile_kwargs is not None:
            raise ValueError("DecodeLoop: 'cuda_graphs' captures the eager forward; with 'compile_kwargs' use the "
                             "moefx backend's mode='capture' instead")
        self.model, self.max_len = model, max_len
        self._cache_cls = StaticCache
        self._caches: dict[int, Any] = {}
        self.compiled = compile_kwargs is not None
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[tuple[int, int], tuple | None] = {}  # (batch, cache id) -> captured step, None = eager
        kw = compile_kwargs or {}
        self.forward = torch.compile(self._forward, **kw) if self.compiled else self._forward
        self.pick = torch.compile(_step_tokens, **kw) if self.compiled else _step_tokens

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(
            input_ids=tokens, position_ids=positions, cache_position=positions[0], past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        )
        return out.logits

    def _graph_forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step by graph replay (captured on first use for this batch size and cache)."""
        key = (tokens.shape[0], id(cache))
        if key not in self._graphs:
            self._graphs[key] = self._capture(tokens, positions, cache)
        step = self._graphs[key]
        if step is None:
            return self._forward(tokens, positions, cache)
        graph, static_tokens, static_positions, logits = step
        static_tokens.copy_(tokens)
        static_positions.copy_(positions)
        graph.replay()
        return logits

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Any) -> tuple | None:
        """Capture the forward for these shapes. The warm-up runs use a cache of their own: a static cache layer
        advances its write position on the device at every forward, so warming up on the real one would shift
        every later write."""
        why = _uncapturable_cache(cache)
        if why is not None:
            warn_once(f"DecodeLoop: batch {tokens.shape[0]} runs eagerly: {why}")
            return None
        static_tokens, static_positions = tokens.clone(), positions.clone()
        side = torch.cuda.Stream(tokens.device)
        side.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(side):
            scratch = self._cache_cls(config=self.model.config, max_cache_len=self.max_len)
            for _ in range(2):
                self._forward(static_tokens, static_positions, scratch)
            del scratch
        torch.cuda.current_stream(tokens.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                logits = self._forward(static_tokens, static_positions, cache)
        except RuntimeError as exc:
            warn_once(f"DecodeLoop: batch {tokens.shape[0]} runs eagerly, its forward cannot be captured: {exc}")
            return None
        return graph, static_tokens, static_positions, logits

    def cache_for(self, batch: int) -> Any:
        """One StaticCache per batch size, reset between calls: compiled graphs keep its static addresses."""
        cache = self._caches.get(batch)
        if cache is None:
            cache = self._caches[batch] = self._cache_cls(config=self.model.config, max_cache_len=self.max_len)
        elif cache.is_initialized:
            cache.reset()
        return cache

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
    ) -> torch.Tensor:
        """Prompt + new tokens [B, T + n]; rows that hit EOS are padded, like transformers' generate()."""
        batch, prompt = input_ids.shape
        if prompt + max_new_tokens > self.max_len:
            raise ValueError(f"prompt {prompt} + max_new_tokens {max_new_tokens} exceeds max_len {self.max_len}")
        device = input_ids.device
        cache = self.cache_for(batch)
        positions = torch.arange(prompt, device=device).expand(batch, prompt)
        logits = self.model(
            input_ids=input_ids, position_ids=positions, cache_position=positions[0], past_key_values=cache,
            use_cache=True, logits_to_keep=1,
        ).logits
        eos = -1 if eos_token_id is None else eos_token_id
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        pinned = device.type == "cuda"
        flags = [torch.zeros((), dtype=torch.bool, pin_memory=pinned) for _ in range(2)]
        events = [torch.cuda.Event() if pinned else None for _ in range(2)]
        out: list[torch.Tensor] = []
        position = torch.full((batch, 1), prompt, dtype=torch.long, device=device)
        graphs = self.compiled and device.type == "cuda"
        forward = self._graph_forward if self.cuda_graphs and device.type == "cuda" else self.forward
        for step in range(max_new_tokens):
            if step > 0:
                if graphs:  # a new step: CUDA-graph outputs of the previous one may be overwritten
                    torch.compiler.cudagraph_mark_step_begin()
                logits = forward(out[-1][:, None], position, cache)
                position = position + 1
            nxt, finished, done = self.pick(logits, finished, params, eos, pad_token_id)
            if self.compiled:
                nxt, finished = nxt.clone(), finished.clone()
            out.append(nxt)
            if eos_token_id is None:
                continue
            slot = step % 2
            flags[slot].copy_(done, non_blocking=pinned)
            if pinned:
                events[slot].record()
            if step > 0:
                prev = (step - 1) % 2
                if pinned:
                    events[prev].synchronize()
                if bool(flags[prev]):
                    out.pop()  # read one step late: this token came after every row had finished
                    break
        return torch.cat([input_ids, torch.stack(out, dim=1)], dim=1)
