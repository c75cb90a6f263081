"""optimize(offload experts=cpu) on transformers MoE models: same logits as the unoffloaded model (fp32)."""

import copy

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM

import moefx
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.offload.transform import OffloadedExperts, experts_modules

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)


def _qwen3():
    return build_model(tiny_qwen3_moe_config(), seed=0)


def _mixtral():
    torch.manual_seed(1)
    cfg = MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)
    return MixtralForCausalLM(cfg).eval()


def _deepseek_v3():
    torch.manual_seed(2)
    cfg = DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    )
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.fixture(autouse=True)
def rate_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


@pytest.mark.parametrize("build", [_qwen3, _mixtral, _deepseek_v3], ids=["qwen3_moe", "mixtral", "deepseek_v3"])
def test_offloaded_logits_match(build):
    model = build()
    n_experts = len(experts_modules(model))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    model = moefx.optimize(model, config={"offload": {"experts": "cpu"}, "mode": "eager"})
    offloaded = [m for _, m in model.named_modules() if isinstance(getattr(m, "moefx_offload", None), OffloadedExperts)]
    assert n_experts > 0 and len(offloaded) == n_experts
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n, _ in model.named_parameters())
    with torch.no_grad():
        out, want = model(ids).logits, ref(ids).logits
        step, want_step = model(ids[:, :1]).logits, ref(ids[:, :1]).logits  # decode-sized call
    assert ((out - want).norm() / want.norm()).item() <= 1e-5
    assert ((step - want_step).norm() / want_step.norm()).item() <= 1e-5
    explain = model.moefx_plan.explain()
    assert "offload experts = cpu  [user config]" in explain and "isa=" in explain and "numa_nodes=" in explain
    assert "offload prefill streaming to GPU" in explain
    if build is _deepseek_v3:  # its MoE block was re-wired to queue shared experts before the host waits
        assert "1 MoE blocks queue their shared experts" in "\n".join(model.moefx_plan.provenance)


def test_env_turns_offload_on(monkeypatch):
    monkeypatch.setenv("MOEFX_OFFLOAD_EXPERTS", "cpu")
    model = moefx.optimize(_qwen3(), config={"mode": "eager"})
    assert "offload experts = cpu  [env MOEFX_OFFLOAD_EXPERTS]" in model.moefx_plan.explain()
    assert sum(hasattr(m, "moefx_offload") for m in model.modules()) == 2 and not experts_modules(model)


def test_auto_on_cpu_keeps_experts():
    model = moefx.optimize(_qwen3(), config={"offload": {"experts": "auto"}, "mode": "eager"})
    assert "offload experts = with the model on cpu (not offloaded)  [auto: runs on cpu" in model.moefx_plan.explain()
    assert len(experts_modules(model)) == 2


def test_int8_offload_generates_close(monkeypatch):
    monkeypatch.setenv("MOEFX_OFFLOAD_INT8", "1")
    monkeypatch.setenv("MOEFX_OFFLOAD_INT8_VNNI_MIN_TOKENS", "8")
    model = _qwen3()
    ref = copy.deepcopy(model)
    model = moefx.optimize(model, config={"offload": {"experts": "cpu"}, "mode": "eager"})
    assert "offload int8 = int8 activations from M >= 8" in model.moefx_plan.explain()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, want = model(ids).logits, ref(ids).logits
    assert ((out - want).norm() / want.norm()).item() <= 5e-2  # int8 weights and activations: stated bound


def test_unsupported_experts_left_alone():
    model = _qwen3()
    for _, mod in experts_modules(model):
        mod.act_fn = torch.nn.GELU()
    model = moefx.optimize(model, config={"offload": {"experts": "cpu"}, "mode": "eager"})
    assert "activation GELU is not SiLU" in "\n".join(model.moefx_plan.provenance)
    assert len(experts_modules(model)) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host store, copy stream and GPU split need CUDA")
@pytest.mark.parametrize("pin", [None, "0", "1"], ids=["cost_model_split", "cpu_only", "all_streamed"])
def test_offloaded_on_gpu_matches(monkeypatch, pin):
    if pin is not None:
        monkeypatch.setenv("MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS", pin)
    model = _qwen3().cuda()
    ref = copy.deepcopy(model)
    model = moefx.optimize(model, config={"offload": {"experts": "cpu"}, "mode": "eager"})
    store = next(m.moefx_offload.store for m in model.modules() if hasattr(m, "moefx_offload"))
    assert store.w13.device.type == "cpu" and store.w13.is_pinned()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        for call in (ids, ids[:, :1]):
            out, want = model(call).logits, ref(call).logits
            assert ((out - want).norm() / want.norm()).item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host functions on a CUDA stream need a GPU")
@pytest.mark.parametrize("build", [_qwen3, _mixtral, _deepseek_v3], ids=["qwen3_moe", "mixtral", "deepseek_v3"])
def test_decode_calls_are_queued_on_the_stream(monkeypatch, build):
    """Decode-size calls go through the stream host (no sync per layer) and give the unoffloaded logits."""
    from moefx.offload.stream_host import StreamHost

    monkeypatch.setenv("MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS", "0")  # CPU only: tiny experts may split calls
    queued = []
    real = StreamHost.__call__
    monkeypatch.setattr(StreamHost, "__call__", lambda self, *a: queued.append(1) or real(self, *a))
    model = build().cuda()
    ref = copy.deepcopy(model)
    model = moefx.optimize(model, config={"offload": {"experts": "cpu"}, "mode": "eager"})
    assert "queued on the GPU stream" in model.moefx_plan.explain()
    ids = torch.randint(0, 128, (2, 1), generator=torch.Generator().manual_seed(4)).cuda()
    queued.clear()
    with torch.no_grad():
        out, want = model(ids).logits, ref(ids).logits
    assert len(queued) == len(experts_modules(ref))
    assert ((out - want).norm() / want.norm()).item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_offloaded_decode_replays_from_cuda_graphs():
    """DecodeLoop(cuda_graphs=True) on an offloaded bf16 model gives the eager loop's tokens; a batch too large
    for the stream host cannot be captured, says so, and runs eagerly."""
    from moefx.engine.engine import DecodeLoop
    from moefx.offload.transform import DECODE_POOL_MAX_TOKENS
    from moefx.sampling.sampler import SamplingParams

    model = build_model(tiny_qwen3_moe_config(), seed=0, dtype=torch.bfloat16, device="cuda")
    model = moefx.optimize(model, config={"offload": {"experts": "cpu"}, "mode": "eager"})
    # Where the CPU/GPU split starts is measured at optimize (`measure_split_start`), so on a busy machine it can
    # start at M = 1, and a split call syncs (nothing is captured). This test is about the queued calls: every
    # decode size runs on the CPU alone, as where the split does not pay.
    runtime = next(m.moefx_offload.rt for m in model.modules() if hasattr(m, "moefx_offload"))
    runtime.split_min_tokens = DECODE_POOL_MAX_TOKENS + 1
    greedy = SamplingParams(temperature=0)
    for batch in (1, 4, DECODE_POOL_MAX_TOKENS + 8):
        ids = torch.randint(1, 256, (batch, 6), generator=torch.Generator().manual_seed(batch)).cuda()
        want = DecodeLoop(model, 32).generate(ids, 8, greedy)
        graphs = DecodeLoop(model, 32, cuda_graphs=True)
        assert torch.equal(graphs.generate(ids, 8, greedy), want)
        assert (graphs.stats.captures == 0) == (batch > DECODE_POOL_MAX_TOKENS), graphs.stats


def test_offloaded_experts_trace_as_one_op_without_graph_breaks():
    """The experts call is the opaque op `moefx::offloaded_experts`: a MoE block compiles as one graph
    (fullgraph raises on any break) and computes what the eager offloaded block computes."""
    model = moefx.optimize(_qwen3(), config={"offload": {"experts": "cpu"}, "mode": "eager"})
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    seen = []

    def backend(gm, _inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    compiled = torch.compile(block, backend=backend, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(x), block(x)
    assert any("offloaded_experts" in t for t in seen)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
