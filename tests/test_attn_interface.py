"""transformers' attention interface: ``config._attn_implementation`` picks the MLA layers' attention.

"sdpa" (the default) runs the model's own SDPA / blockwise / latent paths; "eager" runs the eager function found in
``ALL_ATTENTION_FUNCTIONS`` (its default: ``mla_eager_attention_forward``); a name registered with
``transformers.AttentionInterface`` runs that function. CPU, fp32, tiny models; logits compared as max absolute
difference <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kimi_hybrid.modeling_kimi_hybrid as mk
from kimi_hybrid import KimiHybridForCausalLM
from kimi_hybrid.mla_kimi_hybrid import interface_mask
from decoding_helpers import max_abs_diff, rand_ids, tiny_random_model
from presets import preset_config

TOL = 1e-5
PRESETS = ["tiny-kda-first", "tiny-mla-first"]


def tiny(name, seed=0):
    return tiny_random_model(name, seed=seed)


ids_of = rand_ids
maxdiff = max_abs_diff


def n_mla(model):
    return model.config.layer_types.count("full_attention")


class Spy:
    """Wraps a function, counting calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.fn(*a, **kw)


@pytest.fixture
def spies(monkeypatch):
    """Spies on the module-level functions the MLA dispatch calls: the eager interface default, the SDPA
    (one-shot / blockwise) path and the absorbed latent decode."""
    s = {"eager": Spy(mk.mla_eager_attention_forward), "sdpa": Spy(mk._mla_attend_decompressed),
         "latent": Spy(mk._mla_attend_latent)}
    monkeypatch.setattr(mk, "mla_eager_attention_forward", s["eager"])
    monkeypatch.setattr(mk, "_mla_attend_decompressed", s["sdpa"])
    monkeypatch.setattr(mk, "_mla_attend_latent", s["latent"])
    return s


def run_scenarios(model):
    """Logits of: a plain batch, a left-padded batch, and (padded) a 5-token prefill in a cache, 4 more tokens
    (a short chunk: latent space), 17 more (longer than ``mla_absorb_max_q_len``: decompressed keys over the
    prefix) and one decode step."""
    assert model.config.mla_absorb_max_q_len == 16
    ids = ids_of(2, 27)
    mask = torch.ones(2, 27, dtype=torch.long)
    mask[1, :3] = 0
    outs = []
    with torch.no_grad():
        outs.append(model(ids[:, :7]).logits)
        outs.append(model(ids[:, :7], attention_mask=mask[:, :7]).logits)
        first = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True)
        cache = first.past_key_values
        outs.append(first.logits)
        for a, b in ((5, 9), (9, 26), (26, 27)):
            outs.append(model(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache, use_cache=True).logits)
    return outs


@pytest.mark.parametrize("preset", PRESETS)
def test_eager_matches_sdpa(preset, spies):
    model = tiny(preset)
    assert model.config._attn_implementation == "sdpa"
    ref = run_scenarios(model)
    assert spies["eager"].calls == 0 and spies["sdpa"].calls > 0
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    spies["sdpa"].calls = 0
    got = run_scenarios(model)
    # 4 decompressed forwards per MLA layer; the short chunk and the decode step stay in latent space (the same math)
    assert spies["eager"].calls == 4 * n_mla(model) and spies["sdpa"].calls == 0
    assert spies["latent"].calls == 2 * 2 * n_mla(model)
    for a, b in zip(ref, got):
        assert maxdiff(a, b) <= TOL


def test_set_attn_implementation_switches_the_path(spies):
    model = tiny("tiny-mla-first")
    assert type(model)._can_set_attn_implementation()
    ids = ids_of(1, 6)
    L = n_mla(model)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        model(ids)
        assert (spies["eager"].calls, spies["sdpa"].calls) == (L, 0)
        model.set_attn_implementation("sdpa")
        model(ids)
        assert (spies["eager"].calls, spies["sdpa"].calls) == (L, L)
        # decode under "eager": the absorbed latent path, as under "sdpa"
        model.set_attn_implementation("eager")
        cache = model(ids, use_cache=True).past_key_values
        model(ids_of(1, 1, seed=2), past_key_values=cache, use_cache=True)
        assert spies["latent"].calls == L and spies["eager"].calls == 2 * L
        # output_attentions under "sdpa" still returns the eager function's maps
        model.set_attn_implementation("sdpa")
        out = model(ids, output_attentions=True)
        assert spies["eager"].calls == 3 * L and len(out.attentions) == L and out.attentions[0].shape[-1] == 6


def test_unknown_and_flash_implementations_are_refused():
    model = tiny("tiny-kda-first")
    with pytest.raises(ValueError, match='Specified `attn_implementation="foo"` is not supported'):
        model.set_attn_implementation("foo")
    assert not getattr(model, "_supports_flash_attn", False) and not getattr(model, "_supports_flash_attn_2", False)
    assert not getattr(model, "_supports_flex_attn", False)
    for name in ("flash_attention_2", "flash_attention_3", "flex_attention"):
        with pytest.raises(ValueError, match=f'does not support attn_implementation="{name}".*flash attention'):
            model.set_attn_implementation(name)
        assert model.config._attn_implementation == "sdpa"
    cfg = preset_config("tiny-kda-first")
    cfg._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        KimiHybridForCausalLM(cfg)


@pytest.mark.parametrize("preset", PRESETS)
def test_registered_function_is_called_and_gives_sdpa_output(preset):
    calls = []

    def kh_test(module, query, key, value, attention_mask, **kwargs):
        calls.append((tuple(query.shape), tuple(key.shape), tuple(value.shape), attention_mask.dtype))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("kh_test", kh_test)
    try:
        model = tiny(preset)
        ref = run_scenarios(model)
        model.config._attn_implementation = "kh_test"
        got = run_scenarios(model)
    finally:
        transformers.AttentionInterface._global_mapping.pop("kh_test", None)
    # every MLA attention, the short chunk and the decode step included (6 forwards)
    assert len(calls) == 6 * n_mla(model)
    cfg = model.config
    qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    q_shape, k_shape, v_shape, mdtype = calls[-1]
    assert q_shape == (2, cfg.num_attention_heads, 1, qk) and k_shape == (2, cfg.num_attention_heads, 27, qk)
    assert v_shape == (2, cfg.num_attention_heads, 27, v) and mdtype == torch.float32
    for a, b in zip(ref, got):
        assert maxdiff(a, b) <= TOL


def test_interface_mask_format_and_errors():
    m = interface_mask(None, 2, 3, 5, torch.device("cpu"), torch.float32)
    assert m.shape == (1, 1, 3, 5) and m.dtype == torch.float32
    visible = m == 0
    want = torch.arange(5).view(1, 5) <= (torch.arange(3) + 2).view(3, 1)
    assert torch.equal(visible[0, 0], want) and bool((m[~visible] == torch.finfo(torch.float32).min).all())
    with pytest.raises(ValueError, match="bool"):
        interface_mask(torch.zeros(2, 1, 3, 5), 2, 3, 5, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="shape"):
        interface_mask(torch.ones(2, 1, 3, 4, dtype=torch.bool), 2, 3, 5, torch.device("cpu"), torch.float32)
