"""Blockwise MLA over a cached prefix (``mla_kimi_hybrid.attend_decompressed``): keys decompressed one block at a time,
partial outputs merged by log-sum-exp, against a reference that decompresses every key and runs one dense softmax.
CPU, fp32 unless stated; metric max |a - b| (tolerance 1e-5: fp32 rounding of a reordered sum) or, in bf16,
||a - b|| / ||ref|| against the fp32 reference (tolerance 2e-2)."""

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from kimi_hybrid import mla_kimi_hybrid as mla
from presets import preset_config

H, R, NOPE, ROPE, DV = 3, 16, 8, 4, 6
SCALE = (NOPE + ROPE) ** -0.5


def _proj(dtype=torch.float32):
    torch.manual_seed(1)
    p = torch.nn.Linear(R, H * (NOPE + DV), bias=False).to(dtype)
    p.requires_grad_(False)
    return p


def _reference(q, latent, proj, mask):
    """Dense fp64 attention over all decompressed keys; ``mask`` bool [B|1, 1, T, S]."""
    k, v = mla.decompress_kv(latent.double(), lambda c: proj(c.to(proj.weight.dtype)).double(), H, R, NOPE, DV)
    s = torch.einsum("bthd,bshd->bhts", q.double(), k) * SCALE
    s = s.masked_fill(~mask, float("-inf"))
    p = s.softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhts,bshd->bthd", p, v.double())


def _bottom_right(T, S):
    return (torch.arange(S).view(1, S) <= torch.arange(T).view(T, 1) + (S - T)).view(1, 1, T, S)


def _run(q, latent, proj, mask, key_block):
    with torch.no_grad():
        return mla.attend_decompressed(q, latent, proj, mask, num_heads=H, kv_lora_rank=R, nope=NOPE, v_dim=DV,
                                       scaling=SCALE, key_block=key_block)


@pytest.mark.parametrize("T,S,key_block", [(7, 23, 5), (1, 19, 4), (5, 5, 2), (13, 40, 64), (9, 31, 3)])
@pytest.mark.parametrize("kind", ["causal_bias", "none"])
def test_chunked_causal_equals_dense(T, S, key_block, kind):
    """Chunked prefill (bottom-right causal): prefix blocks, the piece's own keys in blocks (square causal + full)."""
    torch.manual_seed(T * 100 + S)
    B = 2
    q, latent, proj = torch.randn(B, T, H, NOPE + ROPE), torch.randn(B, S, R + ROPE), _proj()
    mask = causal_lower_right(T, S) if kind == "causal_bias" else None
    got = _run(q, latent, proj, mask, key_block)
    ref = _reference(q, latent, proj, _bottom_right(T, S))
    assert got.shape == (B, T, H, DV)
    assert (got.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("key_block", [3, 8, 100])
def test_dense_mask_padding_and_segments(key_block):
    """A bool mask (left padding in one row, two packed documents in the other, a static-cache tail nobody sees):
    blocks of keys no query sees are skipped, the rest merged."""
    torch.manual_seed(key_block)
    B, T, S = 2, 6, 29  # 20 cached + 6 new + 3 unused rows of a static cache
    q, latent, proj = torch.randn(B, T, H, NOPE + ROPE), torch.randn(B, S, R + ROPE), _proj()
    mask = _bottom_right(T, S - 3).expand(B, 1, T, S - 3).clone()
    mask = torch.cat([mask, torch.zeros(B, 1, T, 3, dtype=torch.bool)], -1)
    mask[0, :, :, :5] = False  # row 0: five pads at the left
    mask[1, :, 3:, :23] = False  # row 1: queries 3.. start a new document at key 23
    got = _run(q, latent, proj, mask, key_block)
    ref = _reference(q, latent, proj, mask)
    assert (got.double() - ref).abs().max().item() < 1e-5


def test_row_without_keys_in_a_block_and_overall():
    """Rows that see nothing in a block contribute lse = -inf there (no NaN); a row that sees no key at all is 0."""
    torch.manual_seed(0)
    T, S = 3, 12
    q, latent, proj = torch.randn(1, T, H, NOPE + ROPE), torch.randn(1, S, R + ROPE), _proj()
    mask = torch.zeros(1, 1, T, S, dtype=torch.bool)
    mask[0, 0, 0, 10] = True  # row 0 sees one key, in the last block
    mask[0, 0, 1, :] = True
    got = _run(q, latent, proj, mask, 4)
    ref = _reference(q, latent, proj, mask)
    assert torch.isfinite(got).all()
    assert (got[:, :2].double() - ref[:, :2]).abs().max().item() < 1e-5
    assert got[:, 2].abs().max().item() == 0.0


def test_merge_partials_matches_one_softmax():
    torch.manual_seed(3)
    s = torch.randn(2, 3, 5, 17)
    v = torch.randn(2, 3, 17, 4)
    ref = s.softmax(-1) @ v
    acc_o, acc_l = torch.zeros(2, 3, 5, 4), torch.full((2, 3, 5), float("-inf"))
    for a, b in ((0, 6), (6, 7), (7, 17)):
        blk = s[..., a:b]
        mla.merge_partials(acc_o, acc_l, blk.softmax(-1) @ v[:, :, a:b], blk.logsumexp(-1))
    assert (acc_o - ref).abs().max().item() < 1e-6
    assert (acc_l - s.logsumexp(-1)).abs().max().item() < 1e-6


def test_bf16_blockwise_close_to_fp32_reference():
    torch.manual_seed(4)
    T, S = 16, 70
    q, latent = torch.randn(1, T, H, NOPE + ROPE), torch.randn(1, S, R + ROPE)
    proj = _proj()
    got = _run(q.bfloat16(), latent.bfloat16(), _proj(torch.bfloat16), causal_lower_right(T, S), 9)
    ref = _reference(q, latent, proj, _bottom_right(T, S))
    assert got.dtype == torch.bfloat16
    assert ((got.double() - ref).norm() / ref.norm()).item() < 2e-2


def test_gradients_take_the_one_shot_path():
    """With gradients recorded the call is one SDPA over all keys (autograd through it): equal to the blockwise
    inference result, and its gradient equals the dense reference's."""
    torch.manual_seed(5)
    T, S = 4, 15
    q, latent, proj = torch.randn(1, T, H, NOPE + ROPE), torch.randn(1, S, R + ROPE), _proj()
    blockwise = _run(q, latent, proj, causal_lower_right(T, S), 4)
    qg = q.clone().requires_grad_(True)
    out = mla.attend_decompressed(qg, latent, proj, causal_lower_right(T, S), num_heads=H, kv_lora_rank=R, nope=NOPE,
                                  v_dim=DV, scaling=SCALE, key_block=4)
    assert (out.detach() - blockwise).abs().max().item() < 1e-5
    out.square().sum().backward()
    qr = q.double().requires_grad_(True)
    _reference(qr, latent, proj, _bottom_right(T, S)).square().sum().backward()
    assert (qg.grad.double() - qr.grad).abs().max().item() < 1e-5


def test_bad_mask_dtype_is_named():
    q, latent, proj = torch.randn(1, 2, H, NOPE + ROPE), torch.randn(1, 9, R + ROPE), _proj()
    with pytest.raises(ValueError, match="bool tensor"):
        _run(q, latent, proj, torch.zeros(1, 1, 2, 9), 4)


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
def test_model_chunked_prefill_with_small_key_blocks(preset, monkeypatch):
    """A padded batch prefilled through a cache in pieces of 5 with 16-token key blocks (forced) gives the logits of
    the one-shot forward (fp32, max |diff| < 1e-4: the models' own layers around the attention add rounding)."""
    cfg = preset_config(preset)
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(cfg).eval()
    B, T = 2, 41
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    am = torch.ones(B, T, dtype=torch.long)
    am[1, :3] = 0
    with torch.no_grad():
        full = m(ids, attention_mask=am, use_cache=False).logits  # one SDPA call per layer (41 keys < a block)
        full_nomask = m(ids, use_cache=False).logits
        monkeypatch.setattr(mla, "KV_BLOCK_BYTES", 1)  # -> the 16-token floor
        for mask in (am, None):
            cache = KimiHybridCache(cfg)
            outs = []
            for s in range(0, T, 5):
                kw = {"attention_mask": mask[:, :s + 5]} if mask is not None else {}
                outs.append(m(ids[:, s:s + 5], past_key_values=cache, use_cache=True, **kw).logits)
            got = torch.cat(outs, 1)
            if mask is None:
                assert (got - full_nomask).abs().max().item() < 1e-4
            else:
                assert (got[0] - full[0]).abs().max().item() < 1e-4
                assert (got[1, 3:] - full[1, 3:]).abs().max().item() < 1e-4


def test_fused_kernel_selection_and_fallback(monkeypatch):
    """The fused-kernel choice (run here on CPU with stand-in kernels): a candidate that fails the start-up check is
    skipped, a base-2 log-sum-exp is recognised and rescaled, a kernel that raises on a larger block hands that block
    to the next candidate and is dropped after three such failures; the result still equals the dense reference."""
    import math

    def bad(q, k, v, scale, causal):  # wrong output: fails the check
        o, lse = mla._math_block(q, k, v, scale, causal, None)
        return o * 1.5, lse

    def big_fail(q, k, v, scale, causal):  # right, but raises on blocks of more than 150 keys
        if k.shape[2] > 150:
            raise RuntimeError("stand-in: no kernel for this size")
        return mla._math_block(q, k, v, scale, causal, None)

    def log2(q, k, v, scale, causal):  # right, log-sum-exp in base 2
        o, lse = mla._math_block(q, k, v, scale, causal, None)
        return o, lse / math.log(2)

    monkeypatch.setattr(mla, "_fused_device", lambda t: True)
    monkeypatch.setattr(mla, "_FUSED", {"bad": bad, "big_fail": big_fail, "log2": log2})
    monkeypatch.setattr(mla, "FUSED_ORDER", ("bad", "big_fail", "log2"))
    for name in ("_CHOSEN", "_CHECK_LOG", "_FAILED", "_FAIL_COUNT"):
        monkeypatch.setattr(mla, name, {})
    torch.manual_seed(6)
    T, S = 30, 600  # prefix blocks 170, 170, 170, 60: big_fail raises three times, then is dropped
    q, latent, proj = torch.randn(1, T, H, NOPE + ROPE), torch.randn(1, S, R + ROPE), _proj()
    got = _run(q, latent, proj, causal_lower_right(T, S), 170)
    ref = _reference(q, latent, proj, _bottom_right(T, S))
    assert (got.double() - ref).abs().max().item() < 1e-5
    key = ("cpu", torch.float32, NOPE + ROPE, DV)
    assert mla._CHECK_LOG[key]["bad"]["ok"] is False
    assert mla._FAIL_COUNT[key] == {"big_fail": 3} and mla._FAILED[key] == {"big_fail"}
    assert len(mla._CHECK_LOG[key]["runtime_failures"]) == 3
    assert mla._CHOSEN[key] == ("log2", math.log(2))


def test_causal_bias_takes_the_unmasked_block_path(monkeypatch):
    """A bottom-right CausalBias (chunked prefill) is never materialised: every block is called without a mask (the
    prefix blocks full, the new tokens' own block square causal), which is what lets CUDA run fused kernels."""
    calls = []
    real = mla.block_attention_lse

    def spy(q, k, v, scale, causal=False, mask=None):
        calls.append((k.shape[2], causal, mask is None))
        return real(q, k, v, scale, causal=causal, mask=mask)

    monkeypatch.setattr(mla, "block_attention_lse", spy)
    torch.manual_seed(7)
    T, S = 6, 40
    q, latent, proj = torch.randn(1, T, H, NOPE + ROPE), torch.randn(1, S, R + ROPE), _proj()
    got = _run(q, latent, proj, causal_lower_right(T, S), 16)
    assert calls == [(16, False, True), (16, False, True), (2, False, True), (6, True, True)]
    assert (got.double() - _reference(q, latent, proj, _bottom_right(T, S))).abs().max().item() < 1e-5


@pytest.mark.parametrize("mask_kind", ["none", "all_ones"])
def test_model_chunked_prefill_takes_the_unmasked_block_path_at_every_piece(mask_kind, monkeypatch):
    """The long-context route end to end (what ``bench_h200``'s 1M run does: ``model(piece, past_key_values=cache)``
    piece after piece, without a mask or with an all-ones one as ``generate`` passes): the first piece is one SDPA
    call, every later piece of every MLA layer goes key block by key block with no mask (prefix blocks full, the
    piece's own block square causal), nothing is materialised into a dense mask, and the logits equal the one-shot
    forward. (Before the CausalBias fix, pieces 2.. went to the dense-mask route: this test fails there.)"""
    from torch.nn.attention.bias import CausalBias

    cfg = preset_config("tiny-kda-first")
    n_mla = cfg.layer_types.count("full_attention")
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(cfg).eval()
    B, T, P = 2, 96, 32  # pieces longer than mla_absorb_max_q_len (16): the decompressed route
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    calls, one_shot = [], []
    real_block, real_one = mla.block_attention_lse, mla._attend_one_shot

    def spy_block(q, k, v, scale, causal=False, mask=None):
        calls.append((len(one_shot), q.shape[2], k.shape[2], causal, mask is None))
        return real_block(q, k, v, scale, causal=causal, mask=mask)

    def spy_one(q, latent, *a, **kw):
        one_shot.append((q.shape[1], latent.shape[1], a[1] is None))
        return real_one(q, latent, *a, **kw)

    def no_materialize(self, *a, **kw):
        raise AssertionError("a chunked prefill without padding materialised its CausalBias into a dense mask")

    monkeypatch.setattr(mla, "block_attention_lse", spy_block)
    monkeypatch.setattr(mla, "_attend_one_shot", spy_one)
    monkeypatch.setattr(CausalBias, "_materialize", no_materialize)
    monkeypatch.setattr(mla, "KV_BLOCK_BYTES", 1)  # -> 16-key blocks: several prefix blocks per piece
    with torch.no_grad():
        full = m(ids, use_cache=False).logits
        one_shot.clear()
        cache = KimiHybridCache(cfg)
        outs = []
        for s in range(0, T, P):
            kw = {"attention_mask": torch.ones(B, s + P, dtype=torch.long)} if mask_kind == "all_ones" else {}
            outs.append(m(ids[:, s:s + P], past_key_values=cache, use_cache=True, **kw).logits)
    assert (torch.cat(outs, 1) - full).abs().max().item() < 1e-4
    # one SDPA call per MLA layer, for the first piece only (plain causal, no mask)
    assert one_shot == [(P, P, True)] * n_mla
    # pieces 2.. of every MLA layer: s // 16 full prefix blocks, then the piece's own keys in 16-key blocks (rows
    # [a, a + 16) see their block causally, the rows after it see all of it), all unmasked
    own = [(16, 16, True, True), (P - 16, 16, False, True), (16, 16, True, True)]
    per_piece = [[(P, 16, False, True)] * (s // 16) + own for s in range(P, T, P)]
    expected = [c for piece in per_piece for c in piece] * n_mla
    assert sorted(c[1:] for c in calls) == sorted(expected)
    assert all(c[4] for c in calls) and len(calls) == len(expected)
