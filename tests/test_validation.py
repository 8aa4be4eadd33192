"""Bad input gets our clear ValueError (never a raw RuntimeError / IndexError), and the packed-documents bound."""

from __future__ import annotations

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from presets import preset_config
from decoding_helpers import _one_thread  # noqa: F401


def _model(name="tiny-kda-first"):
    torch.manual_seed(0)
    return KimiHybridForCausalLM(preset_config(name)).eval()


def test_input_errors_are_value_errors():
    m = _model()
    ids = torch.randint(3, 100, (1, 8))
    with torch.no_grad():
        with pytest.raises(ValueError, match="torch.long or torch.int32"):
            m(ids.to(torch.uint8))
        with pytest.raises(ValueError, match=r"labels holds ids in \[500, 500\] outside the vocabulary"):
            m(ids, labels=torch.full((1, 8), 500))
        with pytest.raises(ValueError, match=r"labels holds ids in \[-3, -3\]"):
            m(ids, labels=torch.full((1, 8), -3))
        with pytest.raises(ValueError, match="labels has shape"):
            m(ids, labels=torch.zeros(1, 5, dtype=torch.long))
        with pytest.raises(ValueError, match="labels must be an integer tensor"):
            m(ids, labels=torch.zeros(1, 8))
        with pytest.raises(ValueError, match=r"hidden=64"):
            m(inputs_embeds=torch.randn(1, 8, 65))
        with pytest.raises(ValueError, match="floating point"):
            m(inputs_embeds=torch.ones(1, 8, 64, dtype=torch.long))
        # ignored positions and in-range labels still train
        lab = ids.clone()
        lab[0, :3] = -100
        assert torch.isfinite(m(ids, labels=lab).loss)


@pytest.mark.parametrize("ones", [True, False])
def test_a_mask_longer_than_the_input_is_refused_with_or_without_zeros(ones):
    """An all-ones mask with more columns than input + cache is refused exactly like one holding zeros: without a
    cache, with a filled dynamic cache, and with a static cache (its host count, no device read)."""
    m = _model()
    ids = torch.randint(3, 100, (1, 8))
    mask = torch.ones(1, 10, dtype=torch.long)
    if not ones:
        mask[0, :2] = 0
    with torch.no_grad():
        with pytest.raises(ValueError, match="attention_mask has 10 columns"):
            m(ids, attention_mask=mask)
        c = KimiHybridCache(m.config)
        m(ids[:, :4], past_key_values=c)
        with pytest.raises(ValueError, match="attention_mask has 10 columns"):
            m(ids[:, 4:], attention_mask=mask, past_key_values=c)
        with pytest.raises(ValueError, match="attention_mask has 10 columns"):
            m(ids, attention_mask=mask, past_key_values=KimiHybridCache(m.config, max_cache_len=32))
        s = KimiHybridCache(m.config, max_cache_len=32)
        m(ids[:, :4], past_key_values=s)
        m(ids[:, 4:6], attention_mask=torch.ones(1, 6, dtype=torch.long), past_key_values=s)  # past + new: fine
        m(ids[:, 6:7], attention_mask=torch.ones(1, 1, dtype=torch.long), past_key_values=s)  # new only: fine
        with pytest.raises(ValueError, match="attention_mask has 10 columns"):
            m(ids[:, 7:], attention_mask=mask, past_key_values=s)


# measured worst on these presets: 4.8e-7 (logits of magnitude ~0.6); the user trial on the default model: 1.9e-6
PACKED_BOUND = 5e-6


@pytest.mark.parametrize("name", ["tiny-kda-first", "tiny-mla-first", "tiny-k3"])
def test_packed_documents_batch_composition_bound(name):
    """fp32 CPU: a packed document's logits move by at most PACKED_BOUND when the documents packed beside it change
    (before or after it, 1-40 tokens). Not bit-exact: CPU GEMMs (projections, and the experts, whose row counts
    follow the routing of the whole packed row) pick kernels by shape."""
    m = _model(name)
    worst = 0.0
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(3, m.config.vocab_size, (1, 16), generator=g)
        with torch.no_grad():
            alone = m(a).logits[0]
            for n in (1, 5, 40):
                b = torch.randint(3, m.config.vocab_size, (1, n), generator=g)
                before = m(torch.cat([b, a], 1), cu_seqlens=torch.tensor([0, n, n + 16])).logits[0, n:]
                after = m(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 16, n + 16])).logits[0, :16]
                worst = max(worst, (before - alone).abs().max().item(), (after - alone).abs().max().item())
    assert 0.0 <= worst <= PACKED_BOUND, worst


@pytest.mark.parametrize("extra", [2, -2])
def test_generate_refuses_a_mask_of_another_length_even_all_ones(extra):
    """generate checks the mask's length itself: transformers >= 5.24 drops an all-ones mask before the forward
    could see a wrong length (issue 25 item 12). A mask of the ids' shape generates as before."""
    m = _model()
    ids = torch.randint(3, m.config.vocab_size, (1, 8))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        m.generate(ids, attention_mask=torch.ones(1, 8 + extra, dtype=torch.long), max_new_tokens=2, do_sample=False)
    out = m.generate(ids, attention_mask=torch.ones(1, 8, dtype=torch.long), max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 10) and torch.equal(out[:, :8], ids)
