"""Every decoding mode of ``generate`` and every cache operation, checked against recomputation without a cache.

Tiny random fp32 models on CPU, on both layer orders ("tiny-kda-first": KDA layer 0; "tiny-mla-first": MLA layer 0)
and the K3 variant ("tiny-k3": full-rank gates, lower-bounded decay, q low-rank MLA with output gate, latent MoE,
AttnRes); the torch.compile test runs on "tiny-mla-first" only. Tolerances: logits max abs diff <= 1e-5 (``ATOL``);
sums of a few log-probabilities (beam scores) <= 1e-4; gradients <= 1e-5 relative to their scale. Generated token
ids must be identical.

Covered: beam search (sequences == no-cache beam search, ``sequences_scores`` == no-cache log-probs of each
returned beam / length ** length_penalty), sampling with ``num_return_sequences`` (top_k=1 == greedy; every step's
logits == no-cache recompute of its own row; same seed with and without cache gives the same samples),
``batch_repeat_interleave`` / ``batch_select_indices``, multi-turn continuation from a returned cache, assisted decoding
with a draft model and prompt lookup (== greedy, rollbacks really happen), ``crop`` (replay == recompute, errors),
static cache (== dynamic; a ``torch.compile``-d decode step == eager, one graph, no recompiles), padding (left,
right, interior, chunked prefill of a padded batch) and packing (``position_ids`` restarts and ``cu_seqlens``, forward
and backward).
"""

from __future__ import annotations

import copy

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from transformers.cache_utils import LinearAttentionLayer

from decoding_helpers import PAD, _one_thread, gen, logits_nocache, rand_ids  # noqa: F401
from presets import preset_config

ATOL = 1e-5
ORDERS = ["tiny-kda-first", "tiny-mla-first"]
ALL = ORDERS + ["tiny-k3"]

_MODELS = {}


def get_model(preset: str, seed: int = 0, **overrides) -> KimiHybridForCausalLM:
    key = (preset, seed, repr(sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(seed)
        cfg = preset_config(preset, **overrides)
        _MODELS[key] = KimiHybridForCausalLM(cfg).eval()
    return _MODELS[key]


def left_pad(rows):
    """List of 1-D id tensors -> (ids [B, T], mask [B, T]) left padded."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------
# basics
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ALL)
def test_chunked_prefill_and_decode_equal_full_forward(preset):
    m = get_model(preset)
    ids = rand_ids(2, 11)
    full = logits_nocache(m, ids)
    c = KimiHybridCache(m.config)
    with torch.no_grad():
        parts = [m(ids[:, :4], past_key_values=c).logits, m(ids[:, 4:8], past_key_values=c).logits]
        parts += [m(ids[:, t:t + 1], past_key_values=c).logits for t in range(8, 11)]
    assert c.get_seq_length() == 11
    assert (torch.cat(parts, 1) - full).abs().max() <= ATOL


# ---------------------------------------------------------------------------------------------------------------
# 1. beam search, sampling with num_return_sequences, batch reshaping, multi-turn
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ALL)
def test_beam_search_sequences_and_scores_match_nocache(preset):
    m = get_model(preset)
    prompts = [rand_ids(7, seed=2), rand_ids(5, seed=3)]
    ids, mask = left_pad(prompts)
    nb, lp, new = 3, 1.3, 6
    kw = dict(num_beams=nb, num_return_sequences=nb, max_new_tokens=new, length_penalty=lp, attention_mask=mask)
    out = gen(m, ids, output_scores=True, return_dict_in_generate=True, **kw)
    ref = gen(m, ids, use_cache=False, **kw)
    assert torch.equal(out.sequences, ref), "beam search with the cache != beam search recomputing everything"
    eos = m.config.eos_token_id
    T0 = ids.shape[1]
    for i, seq in enumerate(out.sequences):
        prompt = prompts[i // nb]
        gen_tok = seq[T0:]
        stop = (gen_tok == eos).nonzero()
        n = int(stop[0]) + 1 if len(stop) else len(gen_tok)
        full = torch.cat([prompt, gen_tok[:n]]).unsqueeze(0)
        logp = logits_nocache(m, full)[0].log_softmax(-1)
        P = len(prompt)
        total = sum(float(logp[P - 1 + t, full[0, P + t]]) for t in range(n))
        assert abs(total / n ** lp - float(out.sequences_scores[i])) <= 1e-4, (i, total / n ** lp)


@pytest.mark.parametrize("preset", ALL)
def test_sampling_num_return_sequences(preset):
    m = get_model(preset)
    ids = rand_ids(2, 6, seed=4)
    nrs, new = 3, 5
    # top_k=1 sampling is greedy, on every returned row
    greedy = gen(m, ids, max_new_tokens=new)
    topk1 = gen(m, ids, do_sample=True, top_k=1, num_return_sequences=nrs, max_new_tokens=new)
    assert torch.equal(topk1, greedy.repeat_interleave(nrs, 0))
    # real sampling: each step's logits are the no-cache logits of that row's own prefix, the sampled token is in
    # the top-k of them, and the same seed without a cache samples the same tokens
    kw = dict(do_sample=True, top_k=20, temperature=0.9, num_return_sequences=nrs, max_new_tokens=new)
    torch.manual_seed(123)
    out = gen(m, ids, output_logits=True, return_dict_in_generate=True, **kw)
    torch.manual_seed(123)
    ref = gen(m, ids, use_cache=False, **kw)
    assert torch.equal(out.sequences, ref)
    step_logits = torch.stack(out.logits, 1)  # [B*nrs, new, V]
    re = logits_nocache(m, out.sequences)[:, ids.shape[1] - 1:-1]
    assert (step_logits - re).abs().max() <= ATOL
    assert torch.equal(out.sequences[:, :ids.shape[1]], ids.repeat_interleave(nrs, 0))
    chosen = out.sequences[:, ids.shape[1]:]
    kth = step_logits.topk(20, -1).values[..., -1]
    assert (step_logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1) >= kth).all()


@pytest.mark.parametrize("preset", ALL)
def test_batch_repeat_interleave_and_select_indices(preset):
    m = get_model(preset)
    ids = rand_ids(2, 6, seed=5)
    c = KimiHybridCache(m.config)
    with torch.no_grad():
        m(ids, past_key_values=c)
        c.batch_repeat_interleave(2)
        assert c.batch_size == 4
        rows = ids.repeat_interleave(2, 0)
        nxt = rand_ids(4, 1, seed=6)
        lo = m(nxt, past_key_values=c).logits[:, -1]
        rows = torch.cat([rows, nxt], 1)
        assert (lo - logits_nocache(m, rows)[:, -1]).abs().max() <= ATOL
        c.batch_select_indices(torch.tensor([3, 0]))
        assert c.batch_size == 2
        rows = rows[[3, 0]]
        nxt = rand_ids(2, 2, seed=7)
        lo = m(nxt, past_key_values=c).logits
        rows = torch.cat([rows, nxt], 1)
        assert (lo - logits_nocache(m, rows)[:, -2:]).abs().max() <= ATOL


@pytest.mark.parametrize("preset", ALL)
def test_multi_turn_continuation_equals_one_shot(preset):
    m = get_model(preset)
    ids, mask = left_pad([rand_ids(6, seed=8), rand_ids(4, seed=9)])
    turn1 = gen(m, ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True)
    user = rand_ids(2, 3, seed=10)
    ids2 = torch.cat([turn1.sequences, user], 1)
    mask2 = torch.cat([mask, torch.ones(2, ids2.shape[1] - mask.shape[1], dtype=torch.long)], 1)
    cache = turn1.past_key_values
    assert isinstance(cache, KimiHybridCache) and cache.get_seq_length() == turn1.sequences.shape[1] - 1
    cont = gen(m, ids2, attention_mask=mask2, past_key_values=cache, max_new_tokens=5)
    one_shot = gen(m, ids2, attention_mask=mask2, max_new_tokens=5)
    assert torch.equal(cont, one_shot)


# ---------------------------------------------------------------------------------------------------------------
# 2. assisted decoding (draft model, prompt lookup) and crop
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def crop_log(monkeypatch):
    """Record every crop(n) call made on any KimiHybridCache: list of (cache id, n, length before)."""
    log = []
    orig = KimiHybridCache.crop

    def crop(self, n):
        log.append((id(self), n, self.seen_tokens))
        return orig(self, n)

    monkeypatch.setattr(KimiHybridCache, "crop", crop)
    return log


@pytest.mark.parametrize("preset", ALL)
def test_assisted_decoding_with_draft_model_equals_greedy(preset, crop_log):
    m = get_model(preset)
    assert m._is_stateful is False
    ids = rand_ids(1, 6, seed=11)
    greedy = gen(m, ids, max_new_tokens=14)
    # a draft with other weights (frequent rejections: rollbacks of the main and of the draft cache) and a
    # 2-layer draft of the other layer order (same vocab)
    other = "tiny-mla-first" if preset == "tiny-kda-first" else "tiny-kda-first"
    # a draft with the main weights accepts every candidate (crop(0), records chained over long verifications)
    drafts = [get_model(preset, seed=1), get_model(other, seed=2, num_hidden_layers=2,
                                                   layer_types=preset_config(other).layer_types[:2],
                                                   mlp_layer_types=["dense", "sparse"]), copy.deepcopy(m)]
    for j, draft in enumerate(drafts):
        # transformers reads these from the draft's generation_config: 4 drafted tokens every round, whatever the
        # (low) confidence of a random model
        draft.generation_config.num_assistant_tokens = 4
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = 0.0
        calls = []
        hook = draft.register_forward_hook(lambda *a: calls.append(1))
        crop_log.clear()
        try:
            out = gen(m, ids, max_new_tokens=14, assistant_model=draft)
        finally:
            hook.remove()
        assert torch.equal(out, greedy), j
        assert calls, "the draft model never ran: assisted decoding did not take place"
        if j == 2:
            assert crop_log and all(n == 0 for _, n, _ in crop_log[::2]), "the main model rejected its own drafts"
        else:
            assert any(n < -1 for _, n, _ in crop_log), "no multi-token rollback happened"


@pytest.mark.parametrize("preset", ALL)
def test_prompt_lookup_equals_greedy(preset, crop_log):
    m = get_model(preset)
    base = rand_ids(5, seed=12)
    ids = torch.cat([base, base, base[:3]]).unsqueeze(0)  # repetitive: lookups find candidates
    greedy = gen(m, ids, max_new_tokens=12)
    out = gen(m, ids, max_new_tokens=12, prompt_lookup_num_tokens=3)
    assert torch.equal(out, greedy)
    assert any(n < 0 for _, n, _ in crop_log), "prompt lookup proposed nothing that was rolled back"


def _kda_states(cache):
    return [(l.conv_states[0].clone(), l.recurrent_states[0].clone()) for l in cache.layers
            if isinstance(l, LinearAttentionLayer)]


@pytest.mark.parametrize("preset", ALL)
def test_crop_replays_to_the_recomputed_state(preset):
    m = get_model(preset)
    ids = rand_ids(1, 16, seed=13)
    c = KimiHybridCache(m.config)
    c.activate_past_recording()
    with torch.no_grad():
        m(ids[:, :10], past_key_values=c)
        for t in range(10, 15):
            m(ids[:, t:t + 1], past_key_values=c)
        c.crop(-4)  # back over 4 single-token forwards -> 11 tokens
        assert c.get_seq_length() == 11
        ref = KimiHybridCache(m.config)
        m(ids[:, :11], past_key_values=ref)
        for (a, b), (x, y) in zip(_kda_states(c), _kda_states(ref)):
            assert (a - x).abs().max() <= ATOL and (b - y).abs().max() <= ATOL
        lo = m(ids[:, 11:13], past_key_values=c).logits
        assert (lo - logits_nocache(m, ids[:, :13])[:, 11:13]).abs().max() <= ATOL
        c.crop(7)  # positive: keep the first 7 (inside the record: the prefill of 10 is recorded)
        lo = m(ids[:, 7:9], past_key_values=c).logits
        assert (lo - logits_nocache(m, ids[:, :9])[:, 7:9]).abs().max() <= ATOL


@pytest.mark.parametrize("preset", ALL)
def test_crop_window_bounded_and_errors(preset):
    R = 3
    m = get_model(preset, kda_record_max_tokens=R)
    ids = rand_ids(1, 20, seed=14)
    c = KimiHybridCache(m.config)
    with torch.no_grad():
        m(ids[:, :8], past_key_values=c)
        with pytest.raises(ValueError, match="activate_past_recording"):
            c.crop(-1)  # nothing recorded
        c.crop(0)  # a no-op, always allowed
        with pytest.raises(ValueError, match="cannot crop 9 tokens from a cache holding 8"):
            c.crop(-9)
        with pytest.raises(ValueError, match="holds only 8"):
            c.crop(12)
        c.activate_past_recording()
        for t in range(8, 20):  # 12 single-token steps: the record's anchor moves (window between R and 2R)
            m(ids[:, t:t + 1], past_key_values=c)
            rec = [r for r in c.records if r is not None][0]
            assert min(R, t + 1 - 8) <= rec.end - rec.anchor <= 2 * R and rec.end == t + 1
        # the documented memory bound of the records (fp32 model, batch 1)
        H, K = m.config.linear_attn_config["num_heads"], m.config.linear_attn_config["head_dim"]
        P, W, n_kda = H * K, m.config.linear_attn_config["short_conv_kernel_size"], c.is_linear.count(True)
        bound = n_kda * (H * K * K * 4 + 3 * P * W * 4 + 2 * R * (7 * P * 4 + H * 4 + 1))
        assert 0 < c.memory_report()["rollback_bytes"] <= bound
        with pytest.raises(ValueError, match="recorded window"):
            c.crop(-(2 * R + 1))
        assert c.get_seq_length() == 20  # a refused crop changes nothing
        c.crop(-R)
        lo = m(ids[:, 17:18], past_key_values=c).logits
        assert (lo - logits_nocache(m, ids[:, :18])[:, -1:]).abs().max() <= ATOL
        # a padded forward is recorded too (pads never touch the state): roll back over interior pads
        am = torch.tensor([[1] * 18 + [0, 1, 0, 1]])
        x = torch.cat([ids[:, 18:20], ids[:, 18:20]], 1)
        m(x, attention_mask=am, past_key_values=c)
        c.crop(-2)  # keep [pad, real]
        lo = m(ids[:, 3:4], attention_mask=torch.cat([am[:, :20], torch.ones(1, 1, dtype=torch.long)], 1),
               past_key_values=c).logits
        ref = logits_nocache(m, torch.cat([ids[:, :18], ids[:, 19:20], ids[:, 3:4]], 1))
        assert (lo - ref[:, -1:]).abs().max() <= ATOL
        # packed forwards cannot use a cache at all (see the packing test); a non-recorded forward drops the record
        c.deactivate_past_recording()
        m(ids[:, 5:6], past_key_values=c)
        with pytest.raises(ValueError, match="no tokens are recorded"):
            c.crop(-1)
        assert not c.is_recording_past() and c.memory_report()["rollback_bytes"] == 0


# ---------------------------------------------------------------------------------------------------------------
# 3. static cache
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ALL)
def test_static_cache_equals_dynamic(preset):
    m = get_model(preset)
    ids, mask = left_pad([rand_ids(7, seed=15), rand_ids(4, seed=16)])
    dyn = gen(m, ids, attention_mask=mask, max_new_tokens=6)
    static = KimiHybridCache(m.config, max_cache_len=16)
    out = gen(m, ids, attention_mask=mask, max_new_tokens=6, past_key_values=static)
    assert torch.equal(out, dyn)
    assert static.is_compileable and static.get_seq_length() == ids.shape[1] + 5
    assert static.layers[-1].latent.shape[1] == 16
    out2 = gen(m, ids, attention_mask=mask, max_new_tokens=6, cache_implementation="static")
    assert torch.equal(out2, dyn)
    # beam search reorders the static buffers in place
    kw = dict(attention_mask=mask, max_new_tokens=4, num_beams=2, num_return_sequences=2)
    assert torch.equal(gen(m, ids, cache_implementation="static", **kw), gen(m, ids, **kw))
    # logits of a static prefill + decode == no-cache recompute
    c = KimiHybridCache(m.config, max_cache_len=12)
    with torch.no_grad():
        a = m(ids, attention_mask=mask, past_key_values=c).logits
        nxt = rand_ids(2, 1, seed=17)
        mask1 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        b = m(nxt, attention_mask=mask1, past_key_values=c).logits
    ref = logits_nocache(m, torch.cat([ids, nxt], 1), mask1)
    real = mask1.bool()
    got = torch.cat([a, b], 1)
    assert (got - ref)[real].abs().max() <= ATOL
    with pytest.raises(ValueError, match="max_cache_len=12"):
        with torch.no_grad():
            m(rand_ids(2, 5), past_key_values=c)


def test_static_decode_step_compiles_and_matches_eager():
    """A decode step of the static cache under torch.compile (inductor, fullgraph) == eager; one graph for every
    step (no Python int that changes per step). Dense MLPs: the MoE's data-dependent expert loop is not this
    test's subject (it graph-breaks by design on CPU)."""
    m = get_model("tiny-mla-first", mlp_layer_types=["dense"] * 4, first_k_dense_replace=4)
    ids = rand_ids(2, 5, seed=18)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0

    def run(step, n=3):
        c = KimiHybridCache(m.config, max_cache_len=12)
        am = mask.clone()
        out = []
        with torch.no_grad():
            tok = m(ids, attention_mask=am, past_key_values=c).logits[:, -1:].argmax(-1)
            for _ in range(n):
                am = torch.cat([am, torch.ones(2, 1, dtype=torch.long)], 1)
                lo = step(tok, am, c)
                out.append(lo)
                tok = lo.argmax(-1)
        return torch.cat(out, 1)

    # a fixed-shape mask for the compiled step: the static cache keeps the history of the padding itself
    def eager_step(tok, am, c):
        return m(tok, attention_mask=am[:, -1:].contiguous(), past_key_values=c).logits

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(m, fullgraph=True)

    def comp_step(tok, am, c):
        return compiled(tok, attention_mask=am[:, -1:].contiguous(), past_key_values=c).logits

    eager = run(eager_step)
    comp = run(comp_step)
    assert (eager - comp).abs().max() <= ATOL
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------
# 4. padding and packing
# ---------------------------------------------------------------------------------------------------------------

def _padded_batch():
    """Three rows with left, right and interior padding; returns (ids, mask, rows alone)."""
    rows = [rand_ids(6, seed=20), rand_ids(5, seed=21), rand_ids(7, seed=22)]
    T = 9
    masks = [[0, 0, 0, 1, 1, 1, 1, 1, 1],  # left
             [1, 1, 1, 1, 1, 0, 0, 0, 0],  # right
             [1, 1, 0, 1, 1, 0, 1, 1, 1]]  # interior
    ids = torch.full((3, T), PAD, dtype=torch.long)
    mask = torch.tensor(masks)
    for i, r in enumerate(rows):
        ids[i, mask[i].bool()] = r
    return ids, mask, rows


@pytest.mark.parametrize("preset", ALL)
def test_padded_batch_equals_rows_alone(preset):
    m = get_model(preset)
    ids, mask, rows = _padded_batch()
    lo = logits_nocache(m, ids, mask)
    for i, r in enumerate(rows):
        alone = logits_nocache(m, r.unsqueeze(0))[0]
        assert (lo[i][mask[i].bool()] - alone).abs().max() <= ATOL, i


@pytest.mark.parametrize("preset", ALL)
def test_chunked_prefill_of_padded_batch_and_generation(preset):
    m = get_model(preset)
    ids, mask, rows = _padded_batch()
    c = KimiHybridCache(m.config)
    got = []
    with torch.no_grad():
        for a, b in ((0, 2), (2, 6), (6, 9)):  # pieces cut through the pads
            got.append(m(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=c).logits)
        nxt = rand_ids(3, 1, seed=23)
        mask1 = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        got.append(m(nxt, attention_mask=mask1, past_key_values=c).logits)
    got = torch.cat(got, 1)
    for i, r in enumerate(rows):
        alone = logits_nocache(m, torch.cat([r, nxt[i]]).unsqueeze(0))[0]
        assert (got[i][mask1[i].bool()] - alone).abs().max() <= ATOL, i
    # generated tokens: padded batch == each row alone (and the batch without any mask for later steps)
    out = gen(m, ids, attention_mask=mask, max_new_tokens=5)
    # transformers' own chunked prefill (its last piece is all padding for the right-padded row)
    assert torch.equal(gen(m, ids, attention_mask=mask, max_new_tokens=5, prefill_chunk_size=4), out)
    for i, r in enumerate(rows):
        alone = gen(m, r.unsqueeze(0), max_new_tokens=5)[0, len(r):]  # (shorter if it stopped at EOS)
        assert torch.equal(out[i, ids.shape[1]:ids.shape[1] + len(alone)], alone), i


@pytest.mark.parametrize("preset", ALL)
def test_packed_forward_and_backward_equal_separate(preset):
    m = copy.deepcopy(get_model(preset)).train()
    docs = [rand_ids(5, seed=24), rand_ids(7, seed=25)]
    packed = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    cu = torch.tensor([0, 5, 12])
    sep = [m(d.unsqueeze(0), use_cache=False).logits[0] for d in docs]
    for kw in ({"position_ids": pos}, {"cu_seqlens": cu}):
        lo = m(packed, use_cache=False, **kw).logits[0]
        assert (lo - torch.cat(sep)).abs().max() <= ATOL, kw
    # packing with a cache is refused (no consistent state of several documents), default use_cache just skips it
    out = m(packed, position_ids=pos)
    assert out.past_key_values is None
    with pytest.raises(ValueError, match="packed"):
        m(packed, position_ids=pos, past_key_values=KimiHybridCache(m.config))

    # backward: a loss on document 2 only gets the same gradients packed as alone; doc-1 embeddings get none
    def grads(ids, **kw):
        m.zero_grad(set_to_none=True)
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        lo = m(inputs_embeds=emb, use_cache=False, **kw).logits[0]
        (lo[-len(docs[1]):].float().pow(2).mean()).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, emb.grad[0]

    g_alone, _ = grads(docs[1].unsqueeze(0))
    for kw in ({"position_ids": pos}, {"cu_seqlens": cu}):
        g_packed, emb_grad = grads(packed, **kw)
        assert emb_grad[:len(docs[0])].abs().max() == 0, "doc-2 loss leaked into doc-1 tokens"
        for n, g in g_alone.items():
            gp = g_packed.get(n, torch.zeros_like(g))
            scale = g.abs().max().clamp_min(1e-6)
            assert ((gp - g).abs().max() / scale) <= 1e-5, (kw.keys(), n)
        extra = [n for n in g_packed if n not in g_alone and g_packed[n].abs().max() > 0]
        assert not extra, extra
