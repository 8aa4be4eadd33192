"""FLA's KDA kernels (chunk, fused recurrent, varlen) and short convolution on CUDA vs the plain-PyTorch references
(skipped without CUDA and FLA).

fp32 runs use IEEE fp32 dots in Triton (``TRITON_F32_DEFAULT=ieee``, conftest.py). Error metric: relative L2 error
between the fast path on bf16 inputs and the fp32 reference on the same bf16-rounded inputs; tolerances (K = V = 64):
outputs and final states 1e-2, gradients 2e-2.
"""

import warnings

import pytest
import torch

from kimi_hybrid import kda_kimi_hybrid as kk
from kimi_hybrid.kernels.testing import grad_rel_err, kda_inputs, rel_err

warnings.filterwarnings("ignore")

CUDA = torch.cuda.is_available()
needs_fla = pytest.mark.skipif(not (CUDA and kk.fla_available()), reason="needs CUDA and flash-linear-attention")
pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------------------------------------ chunk / recurrent
@needs_fla
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("state", [False, True])
def test_chunk_kda_fla_vs_ref(T, state):
    q, k, v, g, beta, h0 = kda_inputs(2, T, 4, 64, 64, seed=T, state=state, grad=True)
    o, ht = kk.kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    qr, kr, vr, gr, br = (t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta))
    h0r = h0.detach().clone().requires_grad_(True) if state else None
    o_ref, ht_ref = kk.chunk_kda_ref(qr, kr, vr, gr, br, initial_state=h0r, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
    assert ht.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-2 and rel_err(ht, ht_ref) < 1e-2
    do = torch.randn_like(o_ref.float())
    dht = torch.randn_like(ht_ref)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    ((o_ref.float() * do).sum() + (ht_ref * dht).sum()).backward()
    pairs = [(q, qr), (k, kr), (v, vr), (g, gr), (beta, br)] + ([(h0, h0r)] if state else [])
    for name, (a, b) in zip("q k v g beta h0".split(), pairs):
        assert grad_rel_err(a.grad, b.grad) < 2e-2, (T, state, name, grad_rel_err(a.grad, b.grad))


@needs_fla
@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("state", [False, True])
def test_fused_recurrent_kda_fla_vs_ref(T, state):
    """FLA's fused_recurrent_kda (our dispatcher sends varlen decode there) with our gate / beta conventions."""
    from fla.ops.kda import fused_recurrent_kda

    q, k, v, g, beta, h0 = kda_inputs(2, T, 4, 64, 64, seed=100 + T, state=state)
    with torch.no_grad():
        o, ht = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
        o_ref, ht_ref = kk.recurrent_kda_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) < 1e-2 and rel_err(ht, ht_ref) < 1e-2


@needs_fla
@pytest.mark.parametrize("state", [False, True])
def test_kda_varlen_fla_vs_ref(state):
    cu = torch.tensor([0, 1, 64, 129, 1129], device="cuda")
    q, k, v, g, beta, h0 = kda_inputs(1, 1129, 4, 64, 64, seed=7, state=state, N=4)
    with torch.no_grad():
        o, ht = kk.kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        o_ref, ht_ref = kk.chunk_kda_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        assert rel_err(o, o_ref) < 1e-2 and rel_err(ht, ht_ref) < 1e-2
        cu1 = torch.tensor([0, 1, 2, 3], device="cuda")
        q1, k1, v1, g1, b1, h1 = kda_inputs(1, 3, 4, 64, 64, seed=8, state=True, N=3)
        o, ht = kk.kda_recurrent(q1, k1, v1, g1, b1, initial_state=h1, output_final_state=True, cu_seqlens=cu1)
        o_ref, ht_ref = kk.recurrent_kda_ref(q1, k1, v1, g1, b1, initial_state=h1, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, cu_seqlens=cu1)
        assert rel_err(o, o_ref) < 1e-2 and rel_err(ht, ht_ref) < 1e-2


# ------------------------------------------------------------------------------------------------------- short conv
@needs_fla
def test_fla_conv_is_used():
    assert kk._fla_conv_fn() is not None


@needs_fla
@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65, 1000])
@pytest.mark.parametrize("state", [False, True])
def test_short_conv_fla_vs_ref(T, state):
    gen = torch.Generator(device="cuda").manual_seed(T)
    B, C, W = 2, 192, 4
    x = torch.randn(B, T, C, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    w = (torch.randn(C, W, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_(True)
    s0 = torch.randn(B, C, W, device="cuda", generator=gen).bfloat16().requires_grad_(True) if state else None
    y, st = kk.short_conv(x, w, s0, "silu")
    xr, wr = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    s0r = s0.detach().float().requires_grad_(True) if state else None
    y_ref, st_ref = kk.causal_conv1d_ref(xr, wr, s0r, "silu")
    assert st.shape == (B, C, W)
    assert rel_err(y, y_ref) < 1e-2
    assert torch.equal(st.float(), st_ref)  # the window is a copy of inputs: exact
    dy = torch.randn_like(y_ref)
    (y.float() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    assert rel_err(x.grad, xr.grad) < 2e-2 and rel_err(w.grad, wr.grad) < 2e-2
    if state:
        assert rel_err(s0.grad, s0r.grad) < 2e-2


@needs_fla
def test_short_conv_varlen_fla_vs_ref():
    gen = torch.Generator(device="cuda").manual_seed(3)
    cu = torch.tensor([0, 1, 3, 70, 200], device="cuda")
    x = torch.randn(1, 200, 192, device="cuda", generator=gen).bfloat16()
    w = torch.randn(192, 4, device="cuda", generator=gen).bfloat16()
    s0 = torch.randn(4, 192, 4, device="cuda", generator=gen).bfloat16()  # W-wide windows, one per document
    with torch.no_grad():
        y, st = kk.short_conv(x, w, s0, "silu", cu)
        y_ref, st_ref = kk.causal_conv1d_ref(x.float(), w.float(), s0.float(), "silu", cu)
    assert rel_err(y, y_ref) < 1e-2 and torch.equal(st.float(), st_ref)
