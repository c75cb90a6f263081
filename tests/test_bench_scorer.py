"""bench/scorer.py: the fp32 scorer of generated sequences (what bench/e2e.py reports per arm as the fp32 argmax
share and the largest gap), on the tiny model on the CPU."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

import moefx
from moefx.backends.registry import dequant_block
from moefx.models import build_model, tiny_qwen3_moe_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package

from bench.scorer import Fp32Scorer, fp8_block_weights, score_logits


def _model():
    cfg = tiny_qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, head_dim=32)
    model = build_model(cfg, seed=0, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    return model


def _eager_fp32(model):
    ref = copy.deepcopy(model).float()
    ref.set_attn_implementation("eager")
    ref.set_experts_implementation("eager")
    return ref


def test_score_logits_counts_argmax_steps_and_the_largest_gap_in_std():
    logits = torch.tensor([[[0.0, 1.0, 3.0, 0.0], [2.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0]]])
    chosen = torch.tensor([[2, 1, 0]])  # the argmax; a tie with it (counts); 4 below the best
    s = score_logits(logits, chosen)
    assert s.steps == 3 and s.argmax_share == pytest.approx(2 / 3)
    assert s.max_gap_std == pytest.approx(4.0 / logits[0, 2].std().item())
    with pytest.raises(ValueError, match=r"differ in \[B, n\]"):
        score_logits(logits, chosen[:, :2])


def test_scorer_is_the_fp32_forward_one_layer_at_a_time_and_leaves_the_model_alone():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    seq = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    scorer = Fp32Scorer(model)
    loaded = []
    for layer in scorer.layers:  # while a layer runs, its weights are fp32 and no other layer's are loaded
        layer.register_forward_pre_hook(lambda mod, args: loaded.append(
            [None if p.is_meta else p.dtype for p in (next(lay.parameters()) for lay in scorer.layers)]))
    logits = scorer.logits(seq, 10)
    with torch.no_grad():
        ref = _eager_fp32(model)(seq[:, :-1]).logits[:, -6:]
    assert logits.dtype == torch.float32 and logits.shape == (2, 6, 256)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert loaded == [[torch.float32, None], [None, torch.float32]]
    assert all(p.is_meta for p in scorer.model.parameters())  # dropped after the forward
    assert all(torch.equal(p, before[n]) and p.dtype == torch.bfloat16 for n, p in model.named_parameters())
    s = scorer.score(seq, 10)
    assert s.steps == 12 and s.argmax_share >= 0.9 and s.max_gap_std < 0.1  # bf16 greedy against its fp32 forward
    wrong = seq.clone()
    wrong[:, 10:] = (ref.argmax(-1) + 1) % 256  # never the argmax
    bad = scorer.score(wrong, 10)
    assert bad.argmax_share == 0.0 and bad.max_gap_std > 0.1


def test_scorer_of_an_fp8_model_reads_its_dequantized_weights():
    model = _model()
    scorer = Fp32Scorer(model)  # the tree of the model before quantization
    ref = _eager_fp32(model)
    moefx.quantize(model, "fp8_block128")
    scorer.fetch = fp8_block_weights(model, (128, 128))
    sd = model.state_dict()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if sd[name].dtype == torch.float8_e4m3fn:
                p.copy_(dequant_block(sd[name], sd[f"{name}_scale_inv"], (128, 128)))
    seq = torch.randint(1, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(seq[:, :-1]).logits[:, -4:]
    torch.testing.assert_close(scorer.logits(seq, 10), expected, rtol=1e-5, atol=1e-5)
    scorer.fetch = None
    with pytest.raises(ValueError, match="the scorer has no weights"):
        scorer.logits(seq, 10)
    assert all(p.is_meta for p in scorer.model.parameters())
