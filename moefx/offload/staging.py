"""GPU prefill staging ring: routed experts are copied host -> GPU in tiles, computed there as tiles arrive.

Two slots of `tile_e` experts (ping-pong). On CUDA the copies run on their own stream: a slot's copy waits
for the event that says the compute on that slot finished, and its compute waits for the event that says
the copy landed, so copying tile t+1 overlaps computing tile t. Off CUDA the same bookkeeping runs with
plain synchronous copies, which is what CPU-only tests exercise.

Choosing the routed experts needs the router's output on the host: a sync that leaves the copy engine idle
while the GPU runs attention and the router. From the M at which uniform routing hits every expert (fewer
than half an expert expected unhit, `hits_every_expert`), a fully streamed call skips it: it copies every
expert in fixed tiles and each tile's compute masks, on the GPU, the pairs routed elsewhere (their weight is
0), so the next layer's copies are queued before this layer's attention has run. Experts copied without a
routed token are counted on the GPU (`unrouted_copies`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moefx.offload.cost import hits_every_expert
from moefx.offload.cpu_experts import ExpertStore, route

# compute(x_rows [P, H], ids [P, 1] local to the tile, weights [P, 1], w13 [n, 2I, H], w2 [n, H, I]) -> [P, H]
TileCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def plan_tiles(hit: list[int], counts: list[int], tile_e: int) -> list[tuple[list[int], int, int]]:
    """Split the hit experts (ascending) into tiles: (experts, first pair, end pair) in the expert-sorted order."""
    tiles = []
    pair = 0
    for i in range(0, len(hit), tile_e):
        experts = hit[i : i + tile_e]
        n_pairs = sum(counts[i : i + tile_e])
        tiles.append((experts, pair, pair + n_pairs))
        pair += n_pairs
    return tiles


def runs(experts: list[int]) -> list[tuple[int, int, int]]:
    """(slot index, first expert, length) for each run of consecutive expert ids: one copy per run."""
    out: list[tuple[int, int, int]] = []
    for j, e in enumerate(experts):
        if out and out[-1][1] + out[-1][2] == e:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, e, 1))
    return out


class StagingRing:
    def __init__(self, like: ExpertStore, tile_e: int, device: torch.device) -> None:
        self.tile_e = min(tile_e, like.num_experts)
        self.device = torch.device(device)
        self.slots = [self._alloc(like) for _ in range(2)]
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.ready = [torch.cuda.Event() for _ in range(2)]
            self.free = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0
        self.stats = {"calls": 0, "tiles": 0, "experts_copied": 0, "bytes_copied": 0, "calls_without_routing": 0}
        self._unrouted = torch.zeros((), dtype=torch.long, device=self.device)

    def _alloc(self, like: ExpertStore) -> list[torch.Tensor]:
        return [torch.empty((self.tile_e, *t.shape[1:]), dtype=t.dtype, device=self.device) for t in like.tensors()]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for slot in self.slots for t in slot)

    def _issue(self, store: ExpertStore, slot: int, experts: list[int]) -> None:
        dst = self.slots[slot]
        src = store.tensors()
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(self.free[slot])
                for j, e, n in runs(experts):
                    for d, s in zip(dst, src, strict=True):
                        d[j : j + n].copy_(s[e : e + n], non_blocking=True)
                self.ready[slot].record(self.copy_stream)
        else:
            for j, e, n in runs(experts):
                for d, s in zip(dst, src, strict=True):
                    d[j : j + n].copy_(s[e : e + n])
        self.stats["experts_copied"] += len(experts)
        self.stats["bytes_copied"] += len(experts) * store.expert_bytes

    def _weights(self, store: ExpertStore, slot: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.slots[slot]
        if not store.int8:
            return w[0][:n], w[1][:n]
        w13 = w[0][:n].to(dtype) * w[2][:n, :, None].to(dtype)
        w2 = w[1][:n].to(dtype) * w[3][:n, :, None].to(dtype)
        return w13, w2

    def start(
        self,
        store: ExpertStore,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        routed: tuple[torch.Tensor, list[int], list[int]] | None = None,
        experts: list[int] | None = None,
    ) -> dict | None:
        """Plan the tiles and issue the first two tiles' copies (asynchronous on CUDA); `finish` computes.

        `routed` is `route()` of the host copy of topk_ids when the caller has it (else this syncs once to learn
        which experts to copy); `experts` restricts the call to a subset of the hit experts (the rest is the
        caller's, e.g. computed on the CPU meanwhile). Only experts with routed tokens are ever copied.
        """
        order_host, hit, counts = routed if routed is not None else route(topk_ids.to("cpu"), store.num_experts)
        spans = {}
        pair = 0
        for e, c in zip(hit, counts, strict=True):
            spans[e] = (pair, c)
            pair += c
        chosen = hit if experts is None else sorted(experts)
        job = {"hidden": hidden, "tiles": [], "base": self.turn}
        if not chosen:
            return job
        sel = torch.cat([torch.arange(spans[e][0], spans[e][0] + spans[e][1]) for e in chosen])
        tiles = plan_tiles(chosen, [spans[e][1] for e in chosen], self.tile_e)
        local = torch.zeros(store.num_experts, dtype=torch.long)
        for tile_experts, _, _ in tiles:
            local[tile_experts] = torch.arange(len(tile_experts))
        k = topk_ids.shape[1]
        order = order_host[sel].to(hidden.device, non_blocking=True)
        job.update(
            tiles=tiles,
            tokens=order // k,
            local_ids=local.to(hidden.device, non_blocking=True)[topk_ids.reshape(-1)[order]],
            weights=topk_weights.reshape(-1)[order],
            store=store,
        )
        for t in range(min(2, len(tiles))):
            self._issue(store, (job["base"] + t) % 2, tiles[t][0])
        self.turn = job["base"] + len(tiles)
        return job

    def finish(self, job: dict, compute: TileCompute) -> torch.Tensor:
        """Compute every tile as it lands (waiting on its copy event); fp32 [M, H] partial expert sum."""
        hidden, tiles, base = job["hidden"], job["tiles"], job["base"]
        h = self.slots[0][1].shape[1]
        out = torch.zeros(hidden.shape[0], h, dtype=torch.float32, device=hidden.device)
        store = job.get("store")
        for t, (experts, lo, hi) in enumerate(tiles):
            slot = (base + t) % 2
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
            w13, w2 = self._weights(store, slot, len(experts), hidden.dtype)
            tok = job["tokens"][lo:hi]
            y = compute(hidden[tok], job["local_ids"][lo:hi, None], job["weights"][lo:hi, None], w13, w2)
            out.index_add_(0, tok, y.float())
            if self.cuda:
                self.free[slot].record(torch.cuda.current_stream(self.device))
            if t + 2 < len(tiles):
                self._issue(store, slot, tiles[t + 2][0])
        self.stats["calls"] += 1
        self.stats["tiles"] += len(tiles)
        return out

    def run(
        self,
        store: ExpertStore,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        compute: TileCompute,
    ) -> torch.Tensor:
        """Expert sum for hidden [M, H] on this ring's device, every routed expert streamed."""
        if self.cuda and hits_every_expert(hidden.shape[0], topk_ids.shape[1], store.num_experts):
            return self._run_every_expert(store, hidden, topk_ids, topk_weights, compute).to(hidden.dtype)
        return self.finish(self.start(store, hidden, topk_ids, topk_weights), compute).to(hidden.dtype)

    def _run_every_expert(
        self, store: ExpertStore, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        compute: TileCompute,
    ) -> torch.Tensor:
        """Every expert copied in fixed tiles, no routing sync; each tile computes all pairs with the pairs of
        other tiles' experts weighted 0 (sent to the tile's first expert)."""
        e = store.num_experts
        tiles = [list(range(a, min(a + self.tile_e, e))) for a in range(0, e, self.tile_e)]
        base = self.turn
        for t in range(min(2, len(tiles))):
            self._issue(store, (base + t) % 2, tiles[t])
        self.turn = base + len(tiles)
        hit = torch.zeros(e, dtype=torch.long, device=topk_ids.device).index_add_(
            0, topk_ids.reshape(-1), torch.ones_like(topk_ids.reshape(-1)))
        self._unrouted += (hit == 0).sum()
        out = torch.zeros(hidden.shape[0], self.slots[0][1].shape[1], dtype=torch.float32, device=hidden.device)
        for t, experts in enumerate(tiles):
            slot = (base + t) % 2
            local = topk_ids - experts[0]
            inside = (local >= 0) & (local < len(experts))
            ids = torch.where(inside, local, torch.zeros_like(local))
            weights = torch.where(inside, topk_weights, torch.zeros_like(topk_weights))
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
            w13, w2 = self._weights(store, slot, len(experts), hidden.dtype)
            out += compute(hidden, ids, weights, w13, w2).float()
            if self.cuda:
                self.free[slot].record(torch.cuda.current_stream(self.device))
            if t + 2 < len(tiles):
                self._issue(store, slot, tiles[t + 2])
        self.stats["calls"] += 1
        self.stats["calls_without_routing"] += 1
        self.stats["tiles"] += len(tiles)
        return out

    def unrouted_copies(self) -> int:
        """Experts copied by calls without routing that had no routed token (reads the GPU counter: a sync)."""
        return int(self._unrouted)

