"""``KimiHybridCache`` as a transformers cache: per-layer classes on transformers' cache layer API, ``Cache.__init__``
honoured, ``early_initialization`` / ``offload`` / ``prefetch``, caches of other classes refused (never silently
replaced), and a memory report that counts the storage actually held (a conv window must not pin its prefill input).

Tiny random fp32 models on CPU ("tiny-kda-first", "tiny-mla-first": 4 layers, KDA H=4 K=16 conv W=4, MLA latent
32 + 8). Logits are compared with max abs diff <= 1e-5 against one full forward without a cache; bytes exactly.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import (Cache, CacheLayerMixin, DynamicCache, DynamicLayer, LinearAttentionLayer,
                                      StaticCache, StaticLayer)

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from kimi_hybrid.cache_kimi_hybrid import (DynamicMLALayer, KimiHybridDynamicCache, KimiHybridStaticCache,
                                           StaticMLALayer, kda_store, layer_tensors)

from presets import preset_config
from decoding_helpers import _one_thread, gen, logits_nocache, rand_ids  # noqa: F401

ATOL = 1e-5
ORDERS = ["tiny-kda-first", "tiny-mla-first"]
_MODELS = {}


def get_model(preset: str) -> KimiHybridForCausalLM:
    if preset not in _MODELS:
        torch.manual_seed(0)
        _MODELS[preset] = KimiHybridForCausalLM(preset_config(preset)).eval()
    return _MODELS[preset]


def _dims(cfg):
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    return H, K, cfg.linear_conv_kernel_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim


def _decode_matches_full(m, cache, ids, split, mask=None):
    """Prefill ``ids[:, :split]`` into ``cache``, then feed the rest one token at a time; max abs diff of every
    logit against one full forward without a cache."""
    full = logits_nocache(m, ids, mask)
    with torch.no_grad():
        outs = [m(ids[:, :split], past_key_values=cache,
                  attention_mask=None if mask is None else mask[:, :split]).logits]
        for t in range(split, ids.shape[1]):
            outs.append(m(ids[:, t:t + 1], past_key_values=cache,
                          attention_mask=None if mask is None else mask[:, :t + 1]).logits)
    return (torch.cat(outs, 1) - full).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# layer classes and Cache.__init__
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ORDERS)
@pytest.mark.parametrize("static", [False, True])
def test_layers_are_transformers_cache_layers(preset, static, monkeypatch):
    m = get_model(preset)
    calls = []
    real_init = Cache.__init__

    def spy(self, *args, **kwargs):
        calls.append(kwargs)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Cache, "__init__", spy)
    c = KimiHybridCache(m.config, max_cache_len=12 if static else None)
    assert len(calls) == 1 and len(calls[0]["layers"]) == 4, "Cache.__init__ must be called with the layers"
    assert c.layer_class_to_replicate is None and c.offloading is False
    # the containers are transformers' own: a DynamicCache, or a StaticCache (never both)
    assert isinstance(c, KimiHybridCache) and type(c) is (KimiHybridStaticCache if static else KimiHybridDynamicCache)
    assert isinstance(c, StaticCache) == static and isinstance(c, DynamicCache) == (not static)
    for t, layer in zip(m.config.layer_types, c.layers):
        if t == "linear_attention":  # exactly transformers' class, as its cache checks require
            assert type(layer) is LinearAttentionLayer and not layer.supports_early_init
            assert layer.number_of_states == 1 and layer.conv_kernel_size[0] == m.config.linear_conv_kernel_size
        else:
            assert isinstance(layer, CacheLayerMixin)
            assert isinstance(layer, StaticLayer if static else DynamicLayer)
            assert type(layer) is (StaticMLALayer if static else DynamicMLALayer)
    assert c.is_linear == [t == "linear_attention" for t in m.config.layer_types]
    assert c.is_compileable == static
    assert all(layer.is_compileable == (static or t == "linear_attention")
               for t, layer in zip(m.config.layer_types, c.layers))


@pytest.mark.parametrize("preset", ORDERS)
def test_transformers_state_getters_and_layer_lengths(preset):
    m = get_model(preset)
    H, K, W, Dl = _dims(m.config)
    ids = rand_ids(2, 7, seed=40)
    c = KimiHybridCache(m.config)
    kda = [i for i, t in enumerate(m.config.layer_types) if t == "linear_attention"]
    mla = [i for i, t in enumerate(m.config.layer_types) if t == "full_attention"]
    assert c.get_conv_state(kda[0]) is None and c.get_recurrent_state(kda[0]) is None
    with torch.no_grad():
        m(ids, past_key_values=c)
    for i in kda:
        conv, state = c.get_conv_state(i), c.get_recurrent_state(i)
        assert conv is c.layers[i].conv_states[0] and conv.shape == (2, 3 * H * K, W)
        assert state is c.layers[i].recurrent_states[0] and state.shape == (2, H, K, K) and state.dtype == torch.float32
        assert c.layers[i].has_previous_state[0]
    r = m.config.kv_lora_rank
    for i in mla:  # transformers' MLA layout: keys = c_kv [B, 1, T, r], values = k_pe [B, 1, T, rope], views
        layer = c.layers[i]
        assert layer.get_seq_length() == 7 and layer.latent.shape == (2, 7, Dl)
        assert layer.keys.shape == (2, 1, 7, r) and layer.values.shape == (2, 1, 7, Dl - r)
        assert torch.equal(torch.cat([layer.keys, layer.values], -1)[:, 0], layer.latent)
        assert layer.keys.untyped_storage().data_ptr() == layer.latent.untyped_storage().data_ptr()
        assert layer.get_mask_sizes(1) == (8, 0)
        with pytest.raises(AttributeError, match="assign `latent`"):
            layer.keys = torch.zeros(2, 1, 7, r)
    with pytest.raises(ValueError, match="not a KDA layer"):
        c.get_conv_state(mla[0])
    c.reset()
    assert c.get_seq_length() == 0 and c.get_recurrent_state(kda[0]) is None


@pytest.mark.parametrize("preset", ORDERS)
def test_layer_batch_operations_equal_recomputation(preset):
    """Beam reorder through transformers' layer API (each layer's own reorder_cache), select / repeat through
    the container: rows then decode as recomputed."""
    m = get_model(preset)
    ids = rand_ids(3, 6, seed=41)
    nxt = rand_ids(3, 1, seed=42)
    c = KimiHybridCache(m.config)
    with torch.no_grad():
        m(ids, past_key_values=c)
    before = [{k: v.clone() for k, v in layer_tensors(layer).items()} for layer in c.layers]
    for layer in c.layers:  # layer-level operations, as a transformers container would call them
        layer.reorder_cache(torch.tensor([2, 0, 1]))
    for b, layer in zip(before, c.layers):
        for k, v in layer_tensors(layer).items():
            assert torch.equal(v, b[k][[2, 0, 1]])
    c.key_mask = c.key_mask[[2, 0, 1]]
    c.last_hidden = c.last_hidden[[2, 0, 1]]
    perm = ids[[2, 0, 1]]
    with torch.no_grad():
        got = m(nxt, past_key_values=c).logits
    ref = logits_nocache(m, torch.cat([perm, nxt], 1))[:, -1:]
    assert (got - ref).abs().max().item() <= ATOL
    # select + repeat through the container
    d = KimiHybridCache(m.config)
    with torch.no_grad():
        m(ids, past_key_values=d)
    d.batch_select_indices(torch.tensor([1, 2]))
    d.batch_repeat_interleave(2)
    rows = ids[[1, 1, 2, 2]]
    nxt4 = rand_ids(4, 1, seed=43)
    with torch.no_grad():
        got = m(nxt4, past_key_values=d).logits
    ref = logits_nocache(m, torch.cat([rows, nxt4], 1))[:, -1:]
    assert (got - ref).abs().max().item() <= ATOL


# ---------------------------------------------------------------------------------------------------------------
# early_initialization / offload / prefetch
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ORDERS)
def test_early_initialization_static_keeps_addresses(preset):
    m = get_model(preset)
    H, K, W, Dl = _dims(m.config)
    c = KimiHybridCache(m.config, max_cache_len=12)
    # transformers' signature (generate passes its per-head K/V shape; our widths come from the config)
    c.early_initialization(batch_size=2, num_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    ptrs = []
    for layer in c.layers:
        for name, t in layer_tensors(layer).items():
            want = {"conv_state": (2, 3 * H * K, W), "recurrent_state": (2, H, K, K), "latent": (2, 12, Dl)}
            assert tuple(t.shape) == want[name] and not t.any()
            ptrs.append(t.data_ptr())
    assert len(ptrs) == 4 + m.config.layer_types.count("linear_attention") and c.get_seq_length() == 0
    ids = rand_ids(2, 9, seed=44)
    assert _decode_matches_full(m, c, ids, 5) <= ATOL
    assert [t.data_ptr() for layer in c.layers for t in layer_tensors(layer).values()] == ptrs
    with pytest.raises(ValueError, match="holds batch 2 but the input has batch 3"):
        c.early_initialization(batch_size=3, num_heads=1, head_dim=8, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("preset", ORDERS)
def test_early_initialization_dynamic(preset):
    m = get_model(preset)
    c = KimiHybridCache(m.config)
    c.early_initialization(batch_size=2, num_heads=1, head_dim=8, dtype=torch.float32, device="cpu")
    assert c.batch_size == 2 and c.get_seq_length() == 0
    assert all(layer.is_initialized and layer.get_seq_length() == 0 for layer in c.layers
               if isinstance(layer, DynamicMLALayer))
    assert _decode_matches_full(m, c, rand_ids(2, 8, seed=45), 5) <= ATOL
    with pytest.raises(ValueError, match="already holds 8 tokens"):
        c.early_initialization(batch_size=2, num_heads=1, head_dim=8, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("preset", ORDERS)
def test_offload_prefetch_dynamic_and_refused_static(preset):
    m = get_model(preset)
    ids = rand_ids(2, 9, seed=46)
    # an offloading cache decodes as a plain one
    assert _decode_matches_full(m, KimiHybridCache(m.config, offloading=True), ids, 6) <= ATOL
    c = KimiHybridCache(m.config)
    with torch.no_grad():
        m(ids[:, :6], past_key_values=c)
    before = [{k: v.clone() for k, v in layer_tensors(layer).items()} for layer in c.layers]
    for i in range(len(c)):
        c.offload(i)
        assert all(t.device.type == "cpu" for t in layer_tensors(c.layers[i]).values())
        c.prefetch(i)
    for b, layer in zip(before, c.layers):
        assert all(torch.equal(v, b[k]) for k, v in layer_tensors(layer).items())
    with torch.no_grad():
        got = m(ids[:, 6:], past_key_values=c).logits
    assert (got - logits_nocache(m, ids)[:, 6:]).abs().max().item() <= ATOL
    s = KimiHybridCache(m.config, max_cache_len=12, batch_size=2)
    for fn in (s.offload, s.prefetch):
        with pytest.raises(ValueError, match="fixed addresses"):
            fn(0)
    with pytest.raises(ValueError, match="fixed addresses"):
        KimiHybridCache(m.config, max_cache_len=12, offloading=True)


# ---------------------------------------------------------------------------------------------------------------
# a transformers cache passed in: a DynamicCache(config=...) / StaticCache(config=...), empty or filled, is used as
# it is (same object, same class) through transformers' cache API; anything it cannot serve is refused; never
# silently replaced
# ---------------------------------------------------------------------------------------------------------------

def _transformers_caches(cfg, max_len=16):
    return {"DynamicCache(config)": DynamicCache(config=cfg),
            "StaticCache": StaticCache(config=cfg, max_cache_len=max_len)}


def _refused_caches(cfg):
    from transformers.cache_utils import EncoderDecoderCache

    foreign = DynamicCache(config=cfg)  # per-head K/V of another model in an MLA layer
    mla = cfg.layer_types.index("full_attention")
    foreign.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), mla)
    return {"DynamicCache()": DynamicCache(), "foreign DynamicCache": foreign,
            "EncoderDecoderCache": EncoderDecoderCache(DynamicCache(), DynamicCache())}


@pytest.mark.parametrize("preset", ORDERS)
def test_transformers_cache_used_as_is(preset):
    """The caller's DynamicCache / StaticCache object is filled as it is (same object, same class, transformers'
    own layers), and the caller's next calls with it (one token at a time, then a chunk) continue from it: logits
    equal one full forward without a cache (fp32, <= 1e-5)."""
    m = get_model(preset)
    ids = rand_ids(2, 12, seed=47)
    full = logits_nocache(m, ids)
    for name, cache in _transformers_caches(m.config).items():
        kind, layer_kinds = type(cache), [type(layer) for layer in cache.layers]
        with torch.no_grad():
            out = m(ids[:, :6], past_key_values=cache, use_cache=True)
            assert out.past_key_values is cache and type(cache) is kind, name
            assert [type(layer) for layer in cache.layers] == layer_kinds, name
            assert int(cache.get_seq_length()) == 6
            nxt = [m(ids[:, t:t + 1], past_key_values=cache).logits for t in range(6, 9)]
            nxt.append(m(ids[:, 9:], past_key_values=cache).logits)  # a filled cache continued by a chunk
        got = torch.cat([out.logits] + nxt, 1)
        assert (got - full).abs().max().item() <= ATOL, name
        assert int(cache.get_seq_length()) == 12 and type(cache) is kind
        for i, t in enumerate(m.config.layer_types):
            layer = cache.layers[i]
            if t == "linear_attention":
                assert type(layer) is LinearAttentionLayer and layer.recurrent_states[0].dtype == torch.float32
            else:  # the MLA latent: keys = c_kv [B, 1, T, r], values = k_pe [B, 1, T, rope]
                assert layer.keys.shape[1] == 1 and layer.keys.shape[-1] == m.config.kv_lora_rank
                assert layer.values.shape[-1] == m.config.qk_rope_head_dim


@pytest.mark.parametrize("preset", ORDERS)
def test_transformers_cache_left_padded_with_full_mask(preset):
    """A transformers cache keeps no padding history: with the whole mask passed on every call (transformers'
    convention) a left-padded batch continues exactly as a KimiHybridCache does."""
    m = get_model(preset)
    ids = rand_ids(2, 9, seed=50)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        ours, plain = KimiHybridCache(m.config), DynamicCache(config=m.config)
        a = [m(ids[:, :6], attention_mask=mask[:, :6], past_key_values=ours).logits]
        b = [m(ids[:, :6], attention_mask=mask[:, :6], past_key_values=plain).logits]
        for t in range(6, 9):
            a.append(m(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=ours).logits)
            b.append(m(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=plain).logits)
    a, b = torch.cat(a, 1), torch.cat(b, 1)
    real = mask.bool()
    assert (a - b)[real].abs().max().item() <= ATOL
    with pytest.raises(ValueError, match="holds only padding"):
        pad = torch.tensor([[1, 1], [0, 0]])
        m(ids[:, :2], attention_mask=torch.cat([mask, pad], 1), past_key_values=plain)


@pytest.mark.parametrize("preset", ORDERS)
def test_transformers_cache_through_generate(preset):
    m = get_model(preset)
    ids = rand_ids(1, 5, seed=48)
    seq = ids
    for _ in range(4):
        seq = torch.cat([seq, logits_nocache(m, seq)[:, -1:].argmax(-1)], 1)
    for name, cache in _transformers_caches(m.config).items():
        kind = type(cache)
        out = gen(m, ids, max_new_tokens=4, past_key_values=cache, return_dict_in_generate=True)
        assert out.past_key_values is cache and type(cache) is kind, name
        assert torch.equal(out.sequences, seq), name
        assert int(cache.get_seq_length()) == seq.shape[1] - 1
    # without a cache, generate builds its own (a KimiHybridCache, a DynamicCache) and it equals recomputation
    out = gen(m, ids, max_new_tokens=4, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, KimiHybridCache) and isinstance(out.past_key_values, DynamicCache)
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1
    assert torch.equal(out.sequences, seq)


@pytest.mark.parametrize("preset", ORDERS)
def test_other_caches_refused(preset):
    m = get_model(preset)
    ids = rand_ids(1, 5, seed=47)
    for name, cache in _refused_caches(m.config).items():
        with pytest.raises(ValueError, match=r"(?s)KimiHybridCache\(model\.config\).*leave it None"):
            with torch.no_grad():
                m(ids, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="KimiHybridCache"):
            gen(m, ids, max_new_tokens=3, past_key_values=cache)
    with pytest.raises(ValueError, match="needs config= to build them"):
        m(ids, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match="filled by another model"):
        m(ids, past_key_values=_refused_caches(m.config)["foreign DynamicCache"])
    recording = DynamicCache(config=m.config)
    for layer in recording.layers:
        if isinstance(layer, LinearAttentionLayer):
            layer.activate_past_recording()
    with pytest.raises(ValueError, match="records its past for rollback"):
        m(ids, past_key_values=recording)
    with pytest.raises(ValueError, match="legacy tuple"):
        m(ids, past_key_values=((torch.zeros(1),),))


@pytest.mark.parametrize("preset", ORDERS)
def test_caller_cache_is_filled_in_place_and_valid_next_call(preset):
    m = get_model(preset)
    ids = rand_ids(2, 10, seed=49)
    c = KimiHybridCache(m.config)
    with torch.no_grad():
        out = m(ids[:, :6], past_key_values=c, use_cache=True)
        assert out.past_key_values is c and c.get_seq_length() == 6
        nxt = m(ids[:, 6:], past_key_values=c).logits
    assert (nxt - logits_nocache(m, ids)[:, 6:]).abs().max().item() <= ATOL
    other = preset_config(preset, kv_lora_rank=16)
    with pytest.raises(ValueError, match="kv_lora_rank: cache has 16, model has 32"):
        m(ids, past_key_values=KimiHybridCache(other))


# ---------------------------------------------------------------------------------------------------------------
# memory: the report counts the storage held, and the conv window holds only itself
# ---------------------------------------------------------------------------------------------------------------

def _storage(t):
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("preset", ORDERS)
def test_memory_report_equals_storage_after_long_prefill(preset):
    """A 1,024-token prefill on the torch conv path: each KDA conv window is its own [1, 3P, W] tensor (3,072 B
    here), not a view keeping the [1, 3P, W+1024] prefill input (789,504 B) alive; the report equals the storages
    held. Also after one decode step (whose window comes from a [B, 3P, W] concatenation)."""
    m = get_model(preset)
    H, K, W, Dl = _dims(m.config)
    ids = rand_ids(1, 1024, seed=50)
    with torch.no_grad():
        c = m(ids, past_key_values=KimiHybridCache(m.config), use_cache=True, logits_to_keep=1).past_key_values
        for step in range(2):
            kda = [layer for layer in c.layers if isinstance(layer, LinearAttentionLayer)]
            conv_bytes = 3 * H * K * W * 4
            assert conv_bytes == 3072
            for layer in kda:
                assert _storage(layer.conv_states[0]) == conv_bytes, f"step {step}: conv window pins its input"
                assert _storage(layer.recurrent_states[0]) == H * K * K * 4
            rep = c.memory_report()
            assert rep["kda_conv_bytes"] == len(kda) * conv_bytes
            assert rep["kda_bytes"] == rep["kda_bytes_constant"]
            storages = {}
            tensors = [t for layer in c.layers for t in layer_tensors(layer).values()] + [c.key_mask, c.last_hidden]
            for t in tensors:
                storages[t.untyped_storage().data_ptr()] = _storage(t)
            assert rep["total_bytes"] == sum(storages.values())
            assert rep["mla_bytes"] == rep["mla_bytes_per_token"] * (1024 + step)
            m(rand_ids(1, 1, seed=51 + step), past_key_values=c)


def test_memory_report_counts_a_pinned_view_whole():
    """Whatever gets stored, the report counts the storage behind it: a view written straight into transformers'
    state dict is reported with its whole buffer; one assigned through the layer is copied first."""
    cfg = preset_config("tiny-kda-first")
    H, K, W, _ = _dims(cfg)
    c = KimiHybridCache(cfg)
    big = torch.randn(1, 3 * H * K, 100)
    layer = c.layers[0]
    kda_store(layer, conv_state=big[..., -W:])  # through the writer: copied into the layer's own buffer
    assert _storage(layer.conv_states[0]) == 3 * H * K * W * 4
    assert torch.equal(layer.conv_states[0], big[..., -W:])
    c.key_mask = torch.ones(1, 100, dtype=torch.bool)
    assert c.memory_report()["kda_conv_bytes"] == 3 * H * K * W * 4
    c.layers[1].conv_states[0] = big[..., -W:]  # behind the writer's back: still counted whole
    c.layers[2].conv_states[0] = big[..., -W:]  # the same storage again: counted once
    rep = c.memory_report()
    assert rep["kda_conv_bytes"] == 3 * H * K * W * 4 + _storage(big) == 3072 + 76_800


# ---------------------------------------------------------------------------------------------------------------
# on a GPU (skipped without one): offloading really moves the latents, and the FLA paths own their windows too
# ---------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_model(preset):
    import copy

    return copy.deepcopy(get_model(preset)).cuda()


@cuda
@pytest.mark.parametrize("preset", ORDERS)
def test_cuda_offloading_moves_latents_and_decodes_as_plain(preset):
    m = _cuda_model(preset)
    ids = rand_ids(2, 12, seed=60).cuda()
    plain, off = KimiHybridCache(m.config), KimiHybridCache(m.config, offloading=True)
    outs = {}
    with torch.no_grad():
        for name, c in (("plain", plain), ("off", off)):
            o = [m(ids[:, :6], past_key_values=c).logits]
            for t in range(6, 12):
                o.append(m(ids[:, t:t + 1], past_key_values=c).logits)
            outs[name] = torch.cat(o, 1)
    # same kernels on the same inputs: the offloaded cache changes only where the latents wait
    assert (outs["off"] - outs["plain"]).abs().max().item() <= 1e-6
    for i, layer in enumerate(off.layers):
        if isinstance(layer, DynamicMLALayer):
            assert layer.latent.device.type == "cpu" and layer.device.type == "cuda"
            off.prefetch(i)
            assert layer.latent.device.type == "cuda"
            assert torch.equal(layer.latent, plain.layers[i].latent)
            off.offload(i)
            assert layer.latent.device.type == "cpu"
        else:
            assert layer.conv_states[0].is_cuda and layer.recurrent_states[0].is_cuda


@cuda
@pytest.mark.parametrize("preset", ORDERS)
def test_cuda_memory_report_equals_storage_after_long_prefill(preset):
    """The CPU test's check on CUDA, where the conv and KDA kernels are FLA's when it is installed."""
    m = _cuda_model(preset)
    H, K, W, Dl = _dims(m.config)
    with torch.no_grad():
        c = KimiHybridCache(m.config)
        m(rand_ids(1, 1024, seed=61).cuda(), past_key_values=c, use_cache=True, logits_to_keep=1)
        m(rand_ids(1, 1, seed=62).cuda(), past_key_values=c)
    for layer in c.layers:
        for t in layer_tensors(layer).values():
            assert t.is_cuda and _storage(t) == t.numel() * t.element_size()
    rep = c.memory_report()
    tensors = [t for layer in c.layers for t in layer_tensors(layer).values()] + [c.key_mask, c.last_hidden]
    assert rep["total_bytes"] == sum({t.untyped_storage().data_ptr(): _storage(t) for t in tensors}.values())
    assert rep["kda_bytes"] == rep["kda_bytes_constant"] and rep["mla_bytes"] == rep["mla_bytes_per_token"] * 1025


@pytest.mark.parametrize("preset", ORDERS)
def test_static_generation_feeds_a_fixed_shape_mask(preset, monkeypatch):
    """With a static cache the key-padding history lives in the cache, so generate's growing 2-D mask is cut to the
    new tokens' columns (a contiguous [B, new] tensor: a compiled decode step sees the same shape and strides at
    every step and never recompiles); greedy output with left padding equals the dynamic cache's, whose forward
    gets the whole mask."""
    m = get_model(preset)
    ids = rand_ids(2, 7, seed=64)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    seen = []
    real = type(m).forward

    def spy(self, *args, **kwargs):
        am = kwargs.get("attention_mask")
        seen.append(None if am is None else (tuple(am.shape), am.is_contiguous()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(m), "forward", spy)
    b = gen(m, ids, attention_mask=mask, max_new_tokens=5, cache_implementation="static")
    assert seen[0] == ((2, 7), True) and seen[1:] == [((2, 1), True)] * 4, seen
    seen.clear()
    a = gen(m, ids, attention_mask=mask, max_new_tokens=5)
    assert [s[0] for s in seen] == [(2, 7 + i) for i in range(5)], seen
    assert torch.equal(a, b)


def test_cache_of_a_model_with_another_hidden_size_refused(tmp_path):
    """The fingerprint holds every cached width, ``last_hidden``'s too: a cache written by a model of another
    hidden size is refused by the forward and by ``load`` (before: accepted, then a shape error deep in the
    forward or a silently loaded file)."""
    m = get_model("tiny-kda-first")
    other = KimiHybridForCausalLM(preset_config("tiny-kda-first", hidden_size=96)).eval()
    ids = rand_ids(2, 6, seed=70)
    c = KimiHybridCache(other.config)
    with torch.no_grad():
        other(ids, past_key_values=c)
    with pytest.raises(ValueError, match="hidden_size: cache has 96, model has 64"):
        m(ids[:, -1:], past_key_values=c)
    path = str(tmp_path / "c.safetensors")
    c.save(path)
    with pytest.raises(ValueError, match="hidden_size: cache has 96, model has 64"):
        KimiHybridCache.load(path, m.config)
