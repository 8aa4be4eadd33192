"""Latent-space MLA decode (``KimiMLAttention._attend_latent``) == the decompressed path, and the expert GEMM
fallback == a per-token reference. CPU, fp32; error metric max |a - b|, tolerance 1e-5 (fp32 rounding only)."""

import warnings

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from kimi_hybrid import modeling_kimi_hybrid as mk
from kimi_hybrid import moe_kimi_hybrid as moe
from presets import preset_config

warnings.filterwarnings("ignore")


def _attn(preset="tiny-kda-first"):
    cfg = preset_config(preset)
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(cfg).eval()
    layer = next(l.self_attn for l in m.model.layers if isinstance(l.self_attn, mk.KimiMLAttention))
    return cfg, layer


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_attend_latent_equals_decompressed(T, masked):
    cfg, attn = _attn()
    B, S, H = 2, 29, cfg.num_attention_heads
    q = torch.randn(B, T, H, attn.qk_dim)
    latent = torch.randn(B, S, attn.r + attn.rope)
    mask = None
    if masked or T > 1:
        q_abs = torch.arange(T) + S - T
        mask = (torch.arange(S).view(1, S) <= q_abs.view(T, 1)).view(1, 1, T, S).expand(B, 1, T, S).clone()
        if masked:
            mask[0, :, :, 5:9] = False  # padded keys of row 0
    with torch.no_grad():
        a = attn._attend_latent(q, latent, mask)
        b = attn._attend_decompressed(q, latent, mask if mask is not None else None)
    assert a.shape == (B, T, H, attn.v_dim)
    assert (a - b).abs().max().item() < 1e-5


def test_attend_latent_causal_bias():
    from torch.nn.attention.bias import causal_lower_right

    cfg, attn = _attn()
    B, T, S, H = 1, 4, 11, cfg.num_attention_heads
    q = torch.randn(B, T, H, attn.qk_dim)
    latent = torch.randn(B, S, attn.r + attn.rope)
    with torch.no_grad():
        a = attn._attend_latent(q, latent, causal_lower_right(T, S))
        b = attn._attend_decompressed(q, latent, causal_lower_right(T, S))
        c = attn._attend_latent(q, latent, None)  # None with T > 1: bottom-right causal as well
    assert (a - b).abs().max().item() < 1e-5 and (c - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
def test_decode_latent_vs_decompressed_model(preset):
    """Prefill, a 3-token chunk with a past (bottom-right causal bias) and 1-token steps: latent-space decode and the
    decompressed path (``mla_absorb_max_q_len=0``) both equal the full forward; dynamic and static caches."""
    cfg = preset_config(preset)
    torch.manual_seed(1)
    m = KimiHybridForCausalLM(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 14))
    with torch.no_grad():
        full = m(ids).logits
        for absorb in (16, 0):
            for static in (False, True):
                m.config.mla_absorb_max_q_len = absorb
                cache = KimiHybridCache(cfg, max_cache_len=20) if static else KimiHybridCache(cfg)
                outs = [m(ids[:, :8], past_key_values=cache, use_cache=True).logits,
                        m(ids[:, 8:11], past_key_values=cache, use_cache=True).logits]
                outs += [m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(11, 14)]
                assert (torch.cat(outs, 1) - full).abs().max().item() < 1e-5, (absorb, static)
    m.config.mla_absorb_max_q_len = 16


def test_expert_fallback_vs_reference():
    cfg = preset_config("tiny-kda-first")
    torch.manual_seed(2)
    ex = moe.KimiExperts(cfg, cfg.hidden_size)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.1)
    torch.nn.init.normal_(ex.down_proj, std=0.1)
    N, E, k, F_ = 5, cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size
    x = torch.randn(N, cfg.hidden_size)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    w = torch.rand(N, k)
    with torch.no_grad():
        y = ex(x, idx, w)
        ref = torch.zeros_like(x)
        for t in range(N):
            for j in range(k):
                h = ex.gate_up_proj[idx[t, j]] @ x[t]
                ref[t] += w[t, j] * (ex.down_proj[idx[t, j]] @ (torch.nn.functional.silu(h[:F_]) * h[F_:]))
    assert (y - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("impl", ["kimi_hybrid_grouped_mm", "kimi_hybrid_gemv"])
def test_expert_implementations_are_registered_with_transformers(impl):
    """Our expert implementations are chosen through transformers' ``experts_implementation`` switch (registered in
    ``ExpertsInterface``) and give the default's logits (on CPU both run the expert loop)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    registered, ours = ALL_EXPERTS_FUNCTIONS[impl], moe.EXPERTS_FUNCTIONS[impl]
    # (the same function, or its copy from a Hub bundle of this code loaded earlier in the process, which registers
    # its own module's functions under the same names)
    assert registered.__qualname__ == ours.__qualname__
    assert registered.__module__.rsplit(".", 1)[-1] == ours.__module__.rsplit(".", 1)[-1] == "moe_kimi_hybrid"
    cfg = preset_config("tiny-kda-first")
    torch.manual_seed(0)
    ref = KimiHybridForCausalLM(cfg).eval()
    torch.manual_seed(0)
    got = KimiHybridForCausalLM._from_config(cfg, experts_implementation=impl).eval()
    assert got.config._experts_implementation == impl
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert (got(ids).logits - ref(ids).logits).abs().max().item() < 1e-5


def test_static_cache_copy_and_prefill_to_static():
    from kimi_hybrid.engine_kimi_hybrid import prefill_to_static

    cfg = preset_config("tiny-mla-first")
    torch.manual_seed(3)
    m = KimiHybridForCausalLM(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        full = m(ids).logits
        st, last = prefill_to_static(m, ids[:, :9], 16, chunk_size=4)  # chunked prefill, then static
        assert st.static and st.seen_tokens == 9 and int(st._pos) == 9
        outs = [m(ids[:, t:t + 1], past_key_values=st, use_cache=True).logits for t in range(9, 12)]
    assert (last - full[:, 8]).abs().max().item() < 1e-5
    assert (torch.cat(outs, 1) - full[:, 9:]).abs().max().item() < 1e-5
