"""Tensor parallelism: where the sizes come from, a TP sharding helper, the vocab-parallel LM head, comm counts.

See docs/PARALLEL.md.
"""

from moefx.facts.parallel import ParallelInfo, detect_parallel
from moefx.parallel.comm import CommCounter, graph_collectives
from moefx.parallel.lm_head import VocabParallelLMHead, distributed_argmax, greedy_head, greedy_step
from moefx.parallel.shard import Sharding, model_tp_plan, shard_model

__all__ = [
    "CommCounter",
    "ParallelInfo",
    "Sharding",
    "VocabParallelLMHead",
    "detect_parallel",
    "distributed_argmax",
    "graph_collectives",
    "greedy_head",
    "greedy_step",
    "model_tp_plan",
    "shard_model",
]
