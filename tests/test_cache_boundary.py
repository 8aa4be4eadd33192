"""The model reaches its cache only through the cache's methods, and a decode step reads nothing back to the host.

* a static check over the model file and the graph engine: no cache field or private helper named;
* a runtime check: a KimiHybridCache whose private / internal attributes raise when read from the model's code,
  through prefill, padded decode, recorded (rollback) decode, crop and generate;
* a decode step (one token on a filled cache, with and without a mask, dynamic / static / a user's DynamicCache)
  calls no host read (``Tensor.item`` / ``tolist`` / ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__``)
  from the model's, the cache's or compat code.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from transformers.cache_utils import DynamicCache, StaticCache

import kimi_hybrid.cache_kimi_hybrid as ckh
from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from presets import preset_config
from decoding_helpers import _one_thread, gen, logits_nocache, rand_ids  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, "modeling_kimi_hybrid")
MODEL_FILES = [os.path.join(BUNDLE, f"{name}_kimi_hybrid.py")
               for name in ("modeling", "kda_layer", "masks", "engine", "mla", "kda")]
# cache internals the model must not name (fields, private helpers, per-layer-type branching)
FORBIDDEN = [r"\.layers\[", r"recurrent_states", r"conv_states", r"\.records\b", r"\.recording\b",
             r"cache\.static\b", r"\bkey_mask\b", r"\.last_hidden\b", r"\._pos\b", r"\.latent\b",
             r"\bkda_store\b", r"\bkda_drop\b", r"\bkda_map_rows\b", r"\bkda_tensors\b", r"\bis_kda_layer\b",
             r"\blayer_tensors\b", r"\bKDARecord\b", r"from_user_cache", r"__class__\s*="]


def _code_lines(path):
    """Source lines without comments and docstrings (a crude strip: text inside triple quotes is dropped)."""
    src = open(path, encoding="utf-8").read()
    src = re.sub(r'"""(?:.|\n)*?"""', '""', src)
    return [re.sub(r"#.*", "", line) for line in src.splitlines()]


@pytest.mark.parametrize("path", MODEL_FILES, ids=os.path.basename)
def test_model_names_no_cache_internals(path):
    bad = [(i + 1, pat, line.strip()) for i, line in enumerate(_code_lines(path)) for pat in FORBIDDEN
           if re.search(pat, line)]
    assert not bad, f"{os.path.basename(path)} reaches into the cache: {bad}"


# -- runtime: a cache that refuses to be read from outside its own module -------------------------------------------

_OUTSIDE = {os.path.join(BUNDLE, "modeling_kimi_hybrid.py"), os.path.join(BUNDLE, "mla_kimi_hybrid.py"),
            os.path.join(BUNDLE, "kda_kimi_hybrid.py"), os.path.join(BUNDLE, "moe_kimi_hybrid.py")}
_INTERNAL = {"layers", "records", "recording", "static", "key_mask", "last_hidden", "fingerprint", "config"}


class _Guarded:
    """Mixed into a KimiHybridCache: reading a private or internal attribute from model code raises."""

    def __getattribute__(self, name):
        caller = sys._getframe(1).f_code.co_filename
        if os.path.abspath(caller) in _OUTSIDE and (name.startswith("_") and not name.startswith("__")
                                                   or name in _INTERNAL):
            raise AssertionError(f"model code read cache attribute {name!r} ({caller})")
        return object.__getattribute__(self, name)


def _guarded(config, max_cache_len=None):
    base = ckh.KimiHybridStaticCache if max_cache_len else ckh.KimiHybridDynamicCache
    kind = type("Guarded" + base.__name__, (_Guarded, base), {})
    return kind(config, max_cache_len) if max_cache_len else kind(config)


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
def test_model_uses_only_cache_methods_at_runtime(preset):
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(preset_config(preset)).eval()
    ids = rand_ids(2, 9, seed=3)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0
    full = logits_nocache(m, ids[:1])
    with torch.no_grad():
        for max_len in (None, 16):
            c = _guarded(m.config, max_len)
            m(ids[:, :6], attention_mask=mask[:, :6], past_key_values=c)
            for t in range(6, 9):
                m(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=c)
        c = _guarded(m.config)
        c.activate_past_recording()
        steps = [m(ids[:1, :6], past_key_values=c).logits]
        steps += [m(ids[:1, t:t + 1], past_key_values=c).logits for t in range(6, 9)]
        c.crop(-2)
        steps = steps[:2] + [m(ids[:1, t:t + 1], past_key_values=c).logits for t in range(7, 9)]
    assert (torch.cat(steps, 1) - full).abs().max().item() <= 1e-5
    out = gen(m, ids[:1, :5], max_new_tokens=3, past_key_values=_guarded(m.config))
    assert torch.equal(out, gen(m, ids[:1, :5], max_new_tokens=3))


# -- no host reads in a decode step ----------------------------------------------------------------------------------

_WATCHED = {os.path.join(BUNDLE, f) for f in ("modeling_kimi_hybrid.py", "cache_kimi_hybrid.py",
                                              "cache_view_kimi_hybrid.py", "compat_kimi_hybrid.py")}
_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def _count_host_reads(monkeypatch):
    calls = []
    for name in _READS:
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **k):
            caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
            if caller in _WATCHED:
                calls.append((_name, caller, sys._getframe(1).f_lineno))
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return calls


@pytest.mark.parametrize("kind", ["dynamic", "static", "DynamicCache", "StaticCache"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_decode_step_reads_nothing_to_the_host(monkeypatch, kind, with_mask):
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(preset_config("tiny-kda-first")).eval()
    ids = rand_ids(2, 8, seed=5)
    cache = {"dynamic": lambda: KimiHybridCache(m.config), "static": lambda: KimiHybridCache(m.config, 16),
             "DynamicCache": lambda: DynamicCache(config=m.config),
             "StaticCache": lambda: StaticCache(config=m.config, max_cache_len=16)}[kind]()
    mask = torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad():
        m(ids[:, :6], attention_mask=mask[:, :6] if with_mask else None, past_key_values=cache)
        m(ids[:, 6:7], attention_mask=mask[:, :7] if with_mask else None, past_key_values=cache)  # warm
        calls = _count_host_reads(monkeypatch)
        m(ids[:, 7:8], attention_mask=mask[:, :8] if with_mask else None, past_key_values=cache)
    monkeypatch.undo()
    if kind == "StaticCache":  # a user's StaticCache keeps its length only in a tensor: one read per forward
        assert len(calls) <= 1 and all(c[1].endswith("cache_view_kimi_hybrid.py") for c in calls), calls
    else:
        assert calls == [], calls


def test_fused_conv_weight_is_kept_and_rebuilt_when_a_kernel_changes():
    """The fused [3P, W] short-conv weight is built once for inference steps, rebuilt after an in-place write, a
    load_state_dict or a dtype change, and concatenated afresh (with its autograd graph) when training."""
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(preset_config("tiny-kda-first")).eval()
    attn = m.model.layers[0].self_attn
    P = attn.proj_dim

    def fused_ref():
        return torch.cat([attn.q_conv1d.weight, attn.k_conv1d.weight, attn.v_conv1d.weight], 0).squeeze(1)

    with torch.no_grad():
        w1 = attn.conv_weight()
        assert attn.conv_weight() is w1 and torch.equal(w1, fused_ref())
        attn.k_conv1d.weight.mul_(2)
        w2 = attn.conv_weight()
        assert w2 is not w1 and torch.equal(w2, fused_ref()) and torch.equal(w2[P:2 * P], 2 * w1[P:2 * P])
        sd = {k: v.clone() + 1 for k, v in attn.state_dict().items()}
        attn.load_state_dict(sd)
        w3 = attn.conv_weight()
        assert w3 is not w2 and torch.equal(w3, fused_ref())
    w4 = attn.conv_weight()  # grad enabled, trainable weights: a fresh concatenation with its graph
    assert w4.requires_grad and w4.grad_fn is not None and torch.equal(w4, fused_ref())
    attn.to(torch.float64)
    with torch.no_grad():
        assert attn.conv_weight().dtype == torch.float64
