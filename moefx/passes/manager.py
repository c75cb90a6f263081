"""The moefx pass pipeline, and the inductor post-grad hook that runs its enabled passes in that order.

Its `uuid()` hashes the config, the plan's decisions (not the serving hints no pass reads, nor the text saying
why, which may quote this process's free memory: `Plan.fingerprint`), the enabled passes and their source files,
so inductor's FX graph cache never serves a graph that was built with other passes, another plan or another
version of a pass, and serves one whatever else the process did before it planned.
Each graph's compile report is stored with its cache entry (`moefx.reports`), so a cache hit still reports
what was fused and why other candidates were left alone. The pipeline's order is this file's text, so reordering it
changes every uuid too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from moefx.config import CompilationConfig
from moefx.env import get_setting
from moefx.log import get_logger
from moefx.passes import base as _base
from moefx.passes import fx as _fx
from moefx.passes.base import MoefxPass, PassContext, registry
from moefx.passes.dense_linears import DenseLinears
from moefx.passes.eliminate_noops import EliminateNoops
from moefx.passes.fp8_weight_only import Fp8WeightOnly
from moefx.passes.fuse_act_quant import FuseActQuant
from moefx.passes.fuse_moe_residual import FuseMoeResidual
from moefx.passes.fuse_moe_routing import FuseMoeRouting
from moefx.passes.fuse_norm_linear import FuseNormLinear
from moefx.passes.fuse_norm_quant import FuseNormQuant
from moefx.passes.fuse_qk_norm_rope import FuseQkNormRope
from moefx.passes.fuse_router_topk import FuseRouterTopk
from moefx.passes.fuse_sibling_linears import FuseSiblingLinears
from moefx.passes.last_token_logits import LastTokenLogits
from moefx.passes.rewrite_sampler_syncs import RewriteSamplerSyncs
from moefx.reports import CompileReport, new_report, store_with_cache_entry

log = get_logger("moefx.passes")

# Every moefx pass, in the order the enabled ones run.
PIPELINE: tuple[type[MoefxPass], ...] = (
    EliminateNoops,
    RewriteSamplerSyncs,
    LastTokenLogits,
    FuseMoeRouting,
    Fp8WeightOnly,  # before the quant fusions: the activation quants it leaves dead are not fused into a producer
    # the two quant fusions, in the order they are asked who made a quant's input (`QuantFusionPass.owner`)
    FuseNormQuant,
    FuseActQuant,
    FuseSiblingLinears,  # after the quant fusions, which rewrite the activation quant the FP8 linears read
    DenseLinears,  # after fuse_sibling_linears: what is still a plain linear here has no sibling
    FuseMoeResidual,  # after the linear fusions; reads only moefx::moe_experts
    FuseNormLinear,  # after fuse_sibling_linears and dense_linears, which write the dense_linear calls it reads
    FuseRouterTopk,  # after fuse_norm_linear, which writes the router calls it reads
    FuseQkNormRope,  # after the dense-linear passes, which give q/k/v as moefx::dense_linear outputs
)
PASS_REGISTRY: dict[str, type[MoefxPass]] = registry(PIPELINE)


class PassManager(CustomGraphPass):
    def __init__(self, config: CompilationConfig, enabled: list[str], plan: object | None = None) -> None:
        unknown = [n for n in enabled if n not in PASS_REGISTRY]
        if unknown:
            raise ValueError(f"unknown pass(es) {unknown}; registered passes: {sorted(PASS_REGISTRY)}")
        self.config = config
        self.plan = plan
        wanted = set(enabled)
        self.passes = [cls() for name, cls in PASS_REGISTRY.items() if name in wanted]
        dump = config.pass_config.dump_graph_dir or get_setting("MOEFX_DUMP_GRAPHS")
        self.dump_dir = Path(dump) if dump else None

    @property
    def enabled(self) -> list[str]:
        return [p.name for p in self.passes]

    def __call__(self, graph: torch.fx.Graph) -> None:
        decisions = self.plan.decisions() if hasattr(self.plan, "decisions") else []
        report = new_report(self.enabled, decisions)
        self._dump(graph, report.graph_index, "before")
        self.run_passes(graph, report)
        self._dump(graph, report.graph_index, "after")
        store_with_cache_entry(report)
        log.info("%s", report.summary())

    def run_passes(self, graph: torch.fx.Graph, report: CompileReport | None = None) -> CompileReport:
        """Run the enabled passes in order on `graph`, filling `report` (a detached one when None: nothing is
        added to `compile_reports()`)."""
        report = report if report is not None else CompileReport(graph_index=-1, passes=list(self.enabled))
        report.nodes_before = len(graph.nodes)
        reported: set[str] = set()
        for p in self.passes:
            ctx = PassContext(config=self.config, plan=self.plan, enabled=tuple(self.enabled))
            n = p.run(graph, ctx)
            report.matches[p.name] = n
            # Passes that look at the same candidates (the two quant fusions, the two dense-linear passes) reach
            # the same verdict on what neither takes: the report names each such candidate once.
            skipped = [reason for reason in ctx.skipped if reason not in reported]
            reported.update(skipped)
            if skipped:
                report.skipped[p.name] = skipped
                for reason in skipped:
                    log.debug("%s left a candidate alone: %s", p.name, reason)
            if ctx.notes:
                report.rewrites[p.name] = ctx.notes
            if n:
                log.debug("%s made %d rewrite(s) in graph %d", p.name, n, report.graph_index)
                graph.eliminate_dead_code()
        graph.lint()
        report.nodes_after = len(graph.nodes)
        return report

    def _dump(self, graph: torch.fx.Graph, index: int, stage: str) -> None:
        if self.dump_dir is None:
            return
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / f"graph{index:03d}_{stage}.txt").write_text(str(graph))
        except OSError as exc:  # a dump never costs the compile: say so once and stop dumping
            log.warning("graph dump folder %s (pass_config.dump_graph_dir / MOEFX_DUMP_GRAPHS) could not be "
                        "written (%s: %s); graphs are not dumped in this process", self.dump_dir,
                        type(exc).__name__, exc)
            self.dump_dir = None

    def uuid(self) -> str:
        digest = hashlib.sha256(self.config.compute_hash().encode())
        for shared in (__file__, _fx.__file__, _base.__file__):  # this file and the helpers every pass builds on
            digest.update(Path(shared).read_bytes())
        # Passes may read the plan (e.g. the model's quant scheme): a different plan is a different graph. Not its
        # serving hints, which no pass reads: without max_batch_size the capture cap comes from the free memory of
        # the process that plans, so two processes compiling the same graphs may differ there.
        if hasattr(self.plan, "fingerprint"):
            digest.update(self.plan.fingerprint(serving=False).encode())
        for p in self.passes:
            digest.update(p.name.encode())
            digest.update(p.source_digest().encode())
        return digest.hexdigest()
