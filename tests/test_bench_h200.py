"""The H200 benchmark's own machinery on CPU (``kimi_hybrid.kernels.bench_h200``), on its tiny rehearsal config: the
pieces that broke on the GPU or in the rehearsal (tiny config, decoder layers called with their signature, the best
decode time among timed variants only), the compiled-vs-eager decode check and the batch-composition helper."""

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from kimi_hybrid.kernels import bench_h200 as bench
from kimi_hybrid.engine_kimi_hybrid import to_static_cache


def test_tiny_rehearsal_config_builds_without_the_test_presets():
    cfg = bench.our_config(4, tiny=True)  # was KimiHybridConfig.from_preset("tiny-kda-first"): KeyError
    assert cfg.num_hidden_layers == 4 and cfg.layer_types.count("full_attention") == 1
    assert bench.our_config(27).num_hidden_layers == 27


def test_best_decode_time_ignores_entries_that_are_not_timings():
    res = {"B": 1, "graph": {"ms_per_step": 7.4}, "compiled_graph": {"ms_per_step": 5.2},
           "compiled_check": {"sensitivity_rel_err": 0.15}}  # the dict that made run B fail with KeyError
    assert bench.best_ms(res) == 5.2


def _tiny_static(dtype=torch.float32):
    cfg = bench.our_config(4, tiny=True)
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(cfg).eval().to(dtype)
    ids = torch.randint(3, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        dyn = KimiHybridCache(cfg)
        last = m(ids, past_key_values=dyn, use_cache=True).logits[:, -1]
    st = to_static_cache(dyn, 32)
    return m, st, last.argmax(-1, keepdim=True)


def test_decode_check_feeds_each_layer_its_own_input_and_cache_state():
    """With the 'compiled' layer being the eager layer itself, every per-layer error is 0 and the repeat is exact:
    the captured inputs (hidden state, mask, cache) reproduce each layer's step, and the cache is restored around
    every call (so the check can be read: a compiled layer that differs by more than rounding is a bug). The
    sensitivity probe moves the logits (one bf16-sized change at the embedding) by a small, nonzero amount here."""
    m, st, first = _tiny_static()
    snap = st.snapshot()
    pos = st.seen_tokens
    with torch.no_grad():
        eager = m(first, past_key_values=st, use_cache=True).logits[:, -1]
    st.restore(snap)
    out = bench.decode_check(m, st, snap, first, compiled_logits=eager, layers=(0, 1, 3), compile_fn=lambda l: l)
    assert out["compiled_vs_eager_rel_err"] == 0.0 and out["compiled_argmax_agree"]
    per = out["per_layer_compiled_vs_eager"]
    assert sorted(per) == ["layer0:linear_attention+dense", "layer1:linear_attention+moe",
                           "layer3:full_attention+moe"]
    for r in per.values():
        assert r["rel_err_output"] == 0.0 and r["rel_err_of_layer_update"] == 0.0 and r["eager_repeat_equal"]
    assert 0.0 < out["sensitivity_rel_err"] < 0.05
    assert st.seen_tokens == pos  # the cache is back where it was


def test_row_in_batches_tells_independent_rows_from_coupled_ones():
    g = torch.Generator().manual_seed(0)

    def mk():
        return (torch.randn(1, 5, generator=g), None)

    per_row = bench._row_in_batches(lambda x, _: x * 2 + 1, mk, mk)
    assert per_row["bit_exact"] and per_row["max_abs_diff"] == 0.0 and set(per_row["per_batch"]) == {
        "B2", "B3", "B5", "B9"}
    coupled = bench._row_in_batches(lambda x, _: x - x.mean(0, keepdim=True), mk, mk)
    assert not coupled["bit_exact"] and coupled["max_abs_diff"] > 1e-3
    assert coupled["row_out_max_abs"] == 0.0  # a batch of one minus its own mean


@pytest.mark.parametrize("layer_kind", [0, 3])
def test_layers_take_the_current_call_signature(layer_kind):
    """perlayer / parity call a decoder layer alone, as the model does (was ``layer(h, None, ctx)``)."""
    cfg = bench.our_config(4, tiny=True)
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (1, 16))
    calls, _ = bench.capture_layer_calls(m, lambda: m(ids, use_cache=False))
    a, kw, o = calls[layer_kind]
    with torch.no_grad():
        got = m.model.layers[layer_kind](a[0], attention_mask=None, past_key_values=None)[0]
    assert torch.equal(got, o)
