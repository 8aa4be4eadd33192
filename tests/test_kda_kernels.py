"""KDA kernels on CPU: chunked vs recurrent vs an independent per-head token loop written here.

Metric: max absolute difference. Tolerances: fp64 inputs -> the kernels compute in fp32, so 2e-5 on outputs and
states; gradients 5e-5 (relative to values of order 1).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kimi_hybrid.kda_kimi_hybrid import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    chunk_kda_ref,
    kda_gate,
    l2norm,
    recurrent_kda_ref,
)

TOL = 2e-5


def loop_reference(q, k, v, g, beta, h0=None, scale=None):
    """The recurrence (docs/kda.md, step 7) written per batch and head with explicit matrices, float64."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_out = torch.zeros(B, H, K, V, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[b, h].double().clone()
            for t in range(T):
                qt = q[b, t, h].double()
                qt = qt / math.sqrt(float((qt * qt).sum()) + 1e-6)
                kt = k[b, t, h].double()
                kt = kt / math.sqrt(float((kt * kt).sum()) + 1e-6)
                S = torch.diag(g[b, t, h].double().exp()) @ S
                u = beta[b, t, h].double() * (v[b, t, h].double() - S.t() @ kt)
                S = S + torch.outer(kt, u)
                o[b, t, h] = S.t() @ (scale * qt)
            S_out[b, h] = S
    return o, S_out


def make_inputs(B, T, H=2, K=8, V=6, seed=0, strong_decay=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    raw = torch.randn(B, T, H, K, generator=gen) * (4 if strong_decay else 1)
    g = kda_gate(raw, torch.randn(H, generator=gen), torch.randn(H * K, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunk_recurrent_loop_agree(T, with_state, chunk_size):
    q, k, v, g, beta, h0 = make_inputs(2, T)
    h0 = h0 if with_state else None
    o_ref, s_ref = loop_reference(q, k, v, g, beta, h0)
    o_rec, s_rec = recurrent_kda_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
    o_chk, s_chk = chunk_kda_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    assert s_rec.dtype == torch.float32 and s_chk.dtype == torch.float32
    assert (o_rec.double() - o_ref).abs().max() < TOL
    assert (s_rec.double() - s_ref).abs().max() < TOL
    assert (o_chk.double() - o_ref).abs().max() < TOL
    assert (s_chk.double() - s_ref).abs().max() < TOL


def test_chunk_handles_strong_decay_without_overflow():
    q, k, v, g, beta, h0 = make_inputs(1, 130, strong_decay=True)
    assert g[:, :64].sum(1).min() < -100  # exp(-G) over a chunk would overflow fp32 in a factorised form
    o_ref, s_ref = loop_reference(q, k, v, g, beta, h0)
    o, s = chunk_kda_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all()
    assert (o.double() - o_ref).abs().max() < TOL
    assert (s.double() - s_ref).abs().max() < TOL


@pytest.mark.parametrize("T", [5, 70])
def test_gradients_chunk_vs_recurrent(T):
    base = make_inputs(1, T, seed=3)
    grads = []
    for fn in (recurrent_kda_ref, chunk_kda_ref):
        ins = [t.clone().requires_grad_(True) for t in base]
        q, k, v, g, beta, h0 = ins
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
        (o.pow(2).sum() + (s * 0.1).sum()).backward()
        grads.append([t.grad for t in ins])
    for a, b in zip(*grads):
        assert (a - b).abs().max() < 5e-5 * max(1.0, float(a.abs().max()))


def test_varlen_equals_separate_sequences():
    lens = [5, 64, 1, 70]
    H, K, V = 2, 8, 6
    parts = [make_inputs(1, n, H, K, V, seed=10 + i) for i, n in enumerate(lens)]
    cat = [torch.cat([p[j] for p in parts], dim=1) for j in range(5)]
    h0 = torch.cat([p[5] for p in parts], 0)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long)
    for fn in (chunk_kda_ref, recurrent_kda_ref):
        o, s = fn(*cat, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        for i, p in enumerate(parts):
            o_i, s_i = loop_reference(*p[:5], p[5])
            assert (o[:, cu[i]:cu[i + 1]].double() - o_i).abs().max() < TOL
            assert (s[i].double() - s_i[0]).abs().max() < TOL


def test_kernel_shape_errors_are_clear():
    q, k, v, g, beta, h0 = make_inputs(2, 4)
    with pytest.raises(ValueError, match="beta must be"):
        chunk_kda_ref(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_kda_ref(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="batch 1"):
        chunk_kda_ref(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 4]))


def test_gate_formulas():
    raw = torch.randn(3, 2, 4)
    A_log = torch.randn(2)
    dt = torch.randn(8)
    x = raw + dt.view(2, 4)
    expected = -A_log.exp().view(2, 1) * torch.log1p(torch.exp(x))
    assert (kda_gate(raw, A_log, dt) - expected).abs().max() < 1e-6
    expected_lb = -5.0 * torch.sigmoid(A_log.exp().view(2, 1) * x)
    got = kda_gate(raw, A_log, dt, lower_bound=-5.0)
    assert (got - expected_lb).abs().max() < 1e-6
    assert got.dtype == torch.float32 and (got > -5).all() and (got < 0).all()
    with pytest.raises(ValueError, match="A_log has 3 values"):
        kda_gate(raw, torch.randn(3), dt)


def test_l2norm_eps_inside_sqrt():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    y = l2norm(x)
    assert torch.allclose(y[0], torch.tensor([3.0, 4.0]) / math.sqrt(25 + 1e-6))
    assert (y[1] == 0).all()


@pytest.mark.parametrize("T", [1, 2, 3, 9])
def test_short_conv_matches_loop_and_decode(T):
    gen = torch.Generator().manual_seed(1)
    B, C, W = 2, 5, 4
    x = torch.randn(B, T, C, generator=gen)
    w = torch.randn(C, 1, W, generator=gen)
    state = torch.randn(B, C, W, generator=gen)  # the last W inputs; the oldest is not read
    y, new_state = causal_conv1d_ref(x, w, state)
    hist = torch.cat([state, x.transpose(1, 2)], -1)
    for t in range(T):
        window = hist[..., t + 1:t + 1 + W]
        assert torch.allclose(y[:, t], F.silu((window * w.squeeze(1)).sum(-1)), atol=1e-6)
    assert torch.equal(new_state, hist[..., -W:])
    y2, _ = causal_conv1d_ref(x, w, torch.cat([torch.full_like(state[..., :1], 1e6), state[..., 1:]], -1))
    assert torch.equal(y2, y), "the oldest window column must not be read"
    with pytest.raises(ValueError, match="keeps 4"):
        causal_conv1d_ref(x, w, state[..., 1:])
    # token-by-token decode gives the same outputs and state
    st = state
    for t in range(T):
        yt, st = causal_conv1d_update_ref(x[:, t], w, st)
        assert torch.allclose(yt, y[:, t], atol=1e-6)
    assert torch.allclose(st, new_state)


def test_short_conv_varlen_does_not_cross_documents():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 7, 3, generator=gen)
    w = torch.randn(3, 4, generator=gen)
    cu = torch.tensor([0, 3, 7])
    y, st = causal_conv1d_ref(x, w, cu_seqlens=cu)
    y1, s1 = causal_conv1d_ref(x[:, :3], w)
    y2, s2 = causal_conv1d_ref(x[:, 3:], w)
    assert torch.allclose(y, torch.cat([y1, y2], 1))
    assert torch.allclose(st, torch.cat([s1, s2], 0))
