"""Our split-KV latent MLA decode kernel (``kimi_hybrid.kernels.mla_decode``) on CUDA vs its plain-PyTorch
reference (the bundle's ``latent_context``), at the 48B-A3B widths (32 heads, r 512, rope 64); skipped without CUDA.
Tolerances (relative L2): fp32 1e-5, bf16 1e-2 (the reference rounds the normalised probabilities to bf16, the kernel
the un-normalised ones)."""

import warnings

import pytest
import torch

from kimi_hybrid import mla_kimi_hybrid as mla
from kimi_hybrid.kernels.mla_decode import latent_decode_attention, naive_latent_decode
from kimi_hybrid.kernels.testing import rel_err

warnings.filterwarnings("ignore")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.gpu

H, R, P = 32, 512, 64
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(B, T, S, dtype, seed=0, pad_rows=False, spare=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(B, T * H, R + P, device="cuda", generator=g) * 0.5).to(dtype)
    latent = torch.randn(B, S + spare, R + P, device="cuda", generator=g).to(dtype)[:, :S]
    mask = None
    if T > 1 or pad_rows:
        q_abs = torch.arange(T, device="cuda") + S - T
        mask = (torch.arange(S, device="cuda").view(1, S) <= q_abs.view(T, 1)).view(1, 1, T, S)
        mask = mask.expand(B, 1, T, S).clone()
        if pad_rows:
            mask[0, ..., : S // 3] = False  # a left-padded row
    return q, latent, mask


BF16, FP32 = torch.bfloat16, torch.float32


@needs_cuda
@pytest.mark.parametrize("B,T,S,dtype", [(1, 1, 1, BF16), (1, 1, 100, BF16), (2, 1, 4097, BF16), (1, 2, 33000, BF16),
                                         (3, 1, 131072, BF16), (32, 1, 4096, BF16), (5, 3, 999, BF16),
                                         (1, 1, 1, FP32), (2, 1, 4097, FP32), (1, 2, 33000, FP32), (5, 3, 999, FP32)])
def test_latent_decode_vs_naive(B, T, S, dtype):
    q, latent, mask = _inputs(B, T, S, dtype, seed=S, pad_rows=B > 1, spare=7)
    kw = dict(num_heads=H, kv_lora_rank=R, scaling=0.07)
    with torch.no_grad():
        got = latent_decode_attention(q, latent, mask, **kw)
        ref = naive_latent_decode(q, latent, mask, **kw)
    assert got.dtype == dtype and got.shape == (B, T * H, R)
    assert rel_err(got, ref) < TOL[dtype], rel_err(got, ref)


@needs_cuda
@pytest.mark.parametrize("splits", [1, 7, 132, 600])
def test_latent_decode_any_split_count(splits):
    """The merge is exact for any number of splits (fp32)."""
    q, latent, mask = _inputs(1, 1, 20000, torch.float32, seed=splits)
    kw = dict(num_heads=H, kv_lora_rank=R, scaling=0.07)
    with torch.no_grad():
        got = latent_decode_attention(q, latent, mask, num_splits=splits, **kw)
        ref = naive_latent_decode(q, latent, mask, **kw)
    assert rel_err(got, ref) < 1e-5


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_latent_decode_rows_are_independent(dtype):
    """A row alone == the same row in a batch of 32 (bit for bit: the split count depends on S only)."""
    q, latent, mask = _inputs(32, 1, 5000, dtype, seed=1, pad_rows=True)
    kw = dict(num_heads=H, kv_lora_rank=R, scaling=0.07)
    with torch.no_grad():
        batch = latent_decode_attention(q, latent, mask, **kw)
        for n in (0, 17, 31):
            alone = latent_decode_attention(q[n:n + 1], latent[n:n + 1], mask[n:n + 1], **kw)
            assert torch.equal(alone[0], batch[n]), n


@needs_cuda
def test_attend_latent_dispatches_to_the_kernel_and_is_graph_capturable(monkeypatch):
    """``mla_kimi_hybrid.attend_latent`` on CUDA uses the kernel and agrees with its torch path (bf16 1e-2); one
    CUDA-graph replay gives the eager result bit for bit."""
    B, T, S, nope, dv = 2, 1, 20000, 128, 128
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(B, T, H, nope + P, device="cuda", generator=g).bfloat16()
    latent = torch.randn(B, S, R + P, device="cuda", generator=g).bfloat16()
    w = (torch.randn(H * (nope + dv), R, device="cuda", generator=g) * R ** -0.5).bfloat16()
    kw = dict(num_heads=H, kv_lora_rank=R, nope=nope, v_dim=dv, scaling=0.07)
    real, used = mla.load_kernel, []
    monkeypatch.setattr(mla, "load_kernel", lambda op: used.append(real(op)) or used[-1])
    with torch.no_grad():
        got = mla.attend_latent(q, latent, w, None, **kw)
        assert used and used[-1] is not None  # the kernel package was found
        absorbed = torch.empty(B, T * H, R + P, device="cuda", dtype=latent.dtype)
        assert used[-1].latent_decode_supports(absorbed, latent, R, None, H)  # ... and S is above its threshold
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mla.attend_latent(q, latent, w, None, **kw)
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(mla, "load_kernel", lambda op: None)  # the torch path
        ref = mla.attend_latent(q, latent, w, None, **kw)
    assert torch.equal(captured, got)
    assert rel_err(got, ref) < 1e-2
