"""The H200 benchmark's own machinery on CPU (``kimi_hybrid.kernels.bench_h200``), on its tiny rehearsal config: the
pieces that broke on the GPU or in the rehearsal (tiny config, decoder layers called with their signature, the best
decode time among timed variants only), the compiled-vs-eager decode check, the batch-composition helper, the
section registry and its budget, the ``generate`` section and the record's summary."""

import json
import time

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from kimi_hybrid.kernels import bench_h200 as bench

from kimi_hybrid.engine_kimi_hybrid import to_static_cache  # noqa: E402


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


GENERATE_FIELDS = ("generate_b1_4k_ms", "generate_b1_128k_ms", "generate_b32_4k_ms", "generate_sample_b1_4k_ms",
                   "generate_beam4_4k_ms", "generate_eager_b1_4k_ms", "generate_first_call_overhead_s",
                   "native_generate_b1_4k_ms")


@pytest.fixture(scope="module")
def tiny_record(tmp_path_factory):
    """One --tiny rehearsal of the sections that run on CPU (setup, decode, generate, perlayer, census, parity)."""
    out = tmp_path_factory.mktemp("bench") / "tiny.json"
    R = bench.main(["--tiny", "--out", str(out), "--sections", "setup,decode,generate,perlayer,census,parity"])
    return R, json.loads(out.read_text())


def test_registry_lists_every_section_in_run_order():
    assert list(bench.SECTIONS) == ["setup", "mlaprobe", "cold", "prefill", "long", "decode", "generate", "decode2",
                                    "perlayer", "census", "parity", "fp32"]
    assert bench.SECTIONS["census"].needs == ("cuda",) and bench.SECTIONS["parity"].needs == ("native",)
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "setup,nosuch"])


def test_tiny_rehearsal_writes_the_generate_summary(tiny_record):
    R, on_disk = tiny_record
    s = on_disk["summary"]
    assert on_disk["errors"] == [] and s["errors"] == 0
    for f in GENERATE_FIELDS:
        assert isinstance(s[f], float), f
    assert s["generate_b1_4k_ms"] > 0 and s["native_generate_b1_4k_ms"] > 0 and s["decode_b1_4k_ms"] > 0
    for case in on_disk["ours"]["generate"].values():  # per token = (t(n+1) - t(1)) / n
        assert case["ms_per_token"] == pytest.approx((case["n_plus_1_s"] - case["one_s"]) / case["new_tokens"] * 1e3,
                                                     abs=2e-3)
    assert on_disk["ours"]["generate"]["B1_T64"]["new_tokens"] == 4
    cmp = on_disk["generate_comparison"]["B1_T64"]
    assert cmp["graph_step_from"] == "decode section" and cmp["graph_step_ms"] == s["decode_b1_4k_ms"]
    assert s["generate_eager_mode"] in ("cuda_graphs=False", ) or s["generate_eager_mode"].startswith("plain call")


def test_tiny_rehearsal_records_why_a_section_did_not_run(tiny_record):
    _, on_disk = tiny_record
    if not torch.cuda.is_available():
        assert on_disk["skipped"]["census"] == "needs cuda"
    assert "prefill" not in on_disk["section_s"]  # not chosen: neither run nor listed as skipped
    assert "prefill" not in on_disk["skipped"]
    assert on_disk["summary"]["layers"] == 4 and on_disk["setup"]["plan"]["mla_at_0based"] == [3]


def test_tiny_rehearsal_per_layer_table_and_merge(tiny_record, tmp_path):
    _, on_disk = tiny_record
    per = on_disk["ours"]["prefill_per_layer"]
    assert per["T"] == 512
    other = {**on_disk, "ours": {"generate": {"B1_T64_beam4": None, "B4_T64": {"ms_per_token": 1.5}}}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(on_disk))
    b.write_text(json.dumps(other))
    M = bench.merge_results([str(a), str(b)], str(tmp_path / "m.json"))
    assert M["summary"]["generate_b32_4k_ms"] == on_disk["summary"]["generate_b32_4k_ms"]  # the first file wins
    assert M["summary"]["generate_beam4_4k_ms"] == on_disk["summary"]["generate_beam4_4k_ms"]


def test_layer_work_table_has_one_row_per_layer():
    cfg = bench.our_config(4, tiny=True)
    per = {"layer0:linear_attention+dense": 0.002, "layer1:linear_attention+moe": 0.003,
           "layer3:full_attention+moe": 0.004}
    t = bench.layer_work_table(cfg, 512, per, rate=1e12)
    assert [r["layer"] for r in t["per_layer_vs_work"]] == list(per)
    work = bench.layer_work(cfg, 512)
    row = t["per_layer_vs_work"][2]
    assert row["work_ms"] == round(work["mla_moe_flop"] / 1e12 * 1e3, 2)
    assert t["table"]["KDA+MoE"]["measured_ms_median"] == 3.0


def test_generate_section_skips_what_the_budget_does_not_hold(tmp_path, monkeypatch):
    """With 18 s left only the cases estimated at <= 18 s run; each other one is recorded as skipped, with why."""
    args = bench.parse_args(["--tiny", "--out", str(tmp_path / "g.json"), "--sections", "generate"])
    b = bench.Bench(args, 4, time.perf_counter())
    monkeypatch.setattr(b, "left", lambda: 18.0)
    bench.generate_section(b)
    ran = set(b.R["ours"]["generate"]) | {f"native {k}" for k in b.R["native"]["generate"]}
    assert ran == {"B1_T64_eager", "B1_T64_sample", "native B1_T64"}
    assert b.R["skipped"]["generate ours B1_T64"] == "18 s left < 25 s estimated"
    assert set(b.R["skipped"]) == {"generate ours B1_T64", "generate ours B1_T64_beam4", "generate ours B4_T64",
                                   "generate ours B1_T256"}
    assert b.R["errors"] == [] and b.R["summary"]["generate_b1_4k_ms"] is None
