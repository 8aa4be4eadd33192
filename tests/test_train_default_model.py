"""Fast CPU tests of the training helpers in examples/train_default_model.py and the arms of
examples/ablation_ratio.py (no training run: that is a GPU job)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from presets import preset_config

import train_default_model as tdm  # examples/ is on the test path (pyproject's pytest pythonpath)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return tdm.KimiHybridTokenizer.from_pretrained(str(ROOT / "models" / "kimi-hybrid-stdlib"))


def test_stdlib_config_matches_tokenizer(tokenizer):
    cfg = tdm.stdlib_config(tokenizer)
    assert cfg.vocab_size == len(tokenizer) == 8448
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert cfg.layer_types == [tdm.KDA, tdm.KDA, tdm.KDA, tdm.MLA] * 2
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 7
    with torch.device("meta"):
        n = sum(p.numel() for p in tdm.KimiHybridForCausalLM(cfg).parameters())
    assert 10e6 <= n <= 30e6 and n * 2 < 30e6  # bf16 folder under 30 MB


def test_lr_schedule():
    peak, warm, total = 1e-3, 10, 110
    assert tdm.lr_at(0, total, peak, warm, 0.1) == pytest.approx(peak / warm)
    assert tdm.lr_at(warm - 1, total, peak, warm, 0.1) == pytest.approx(peak)
    assert tdm.lr_at(warm, total, peak, warm, 0.1) == pytest.approx(peak)
    assert tdm.lr_at(60, total, peak, warm, 0.1) == pytest.approx(peak * (0.1 + 0.9 * 0.5))
    assert tdm.lr_at(total, total, peak, warm, 0.1) == pytest.approx(0.1 * peak)


def test_batches_are_seeded_and_windows_cover_the_split():
    ids = torch.arange(10_000)
    a = tdm.sample_batch(ids, 64, 4, torch.Generator().manual_seed(1))
    b = tdm.sample_batch(ids, 64, 4, torch.Generator().manual_seed(1))
    assert a.shape == (4, 65) and torch.equal(a, b)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 64, dtype=a.dtype))  # contiguous windows
    w = tdm.eval_windows(ids, 1000)
    assert w.shape == (10, 1000) and torch.equal(w.reshape(-1), ids)
    assert tdm.eval_windows(ids, 1000, max_windows=3).shape == (3, 1000)


def test_bias_balancer_moves_towards_equal_load(tokenizer):
    cfg = preset_config("tiny-kda-first")
    torch.manual_seed(0)
    model = tdm.KimiHybridForCausalLM(cfg).train()
    bal = tdm.BiasBalancer(model, rate=0.5)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (2, 16)), use_cache=False)
    counts = [c.clone() for c in bal.counts]
    ratio = bal.update()
    assert ratio >= 1.0
    for router, c in zip(bal.routers, counts):
        want = 0.5 * torch.sign(c.mean() - c)
        assert torch.equal(router.e_score_correction_bias.data, want)
    bal.remove()


def test_evaluate_matches_model_loss(tokenizer):
    cfg = preset_config("tiny-mla-first")
    torch.manual_seed(0)
    model = tdm.KimiHybridForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3 * 32,))
    ev = tdm.evaluate(model, ids, 32, 2, torch.device("cpu"), None)
    with torch.no_grad():
        ref = model(input_ids=ids.view(3, 32), labels=ids.view(3, 32)).loss
    assert ev["tokens"] == 3 * 31 and ev["loss"] == pytest.approx(float(ref), rel=1e-5)
    assert ev["ppl"] == pytest.approx(math.exp(ev["loss"]))


def test_ablation_arms_have_equal_budget(tokenizer):
    import ablation_ratio as abl
    arms = abl.arms(tokenizer)
    h, m = arms["hybrid_3to1"], arms["all_mla"]
    assert h.layer_types.count(tdm.MLA) == 2 and m.layer_types.count(tdm.MLA) == 8
    nh, nm = abl._n_params(h), abl._n_params(m)
    assert abs(nh - nm) / nh < 0.01
