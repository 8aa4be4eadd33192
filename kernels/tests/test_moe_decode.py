"""Our Triton expert GEMVs (``kimi_hybrid.kernels.moe_decode``) on CUDA vs the experts' loop (skipped without
CUDA). Tolerances: rel L2 1e-5 (fp32), 1e-2 (bf16)."""

import warnings

import pytest
import torch

from kimi_hybrid import moe_kimi_hybrid as moe
from kimi_hybrid.kernels.moe_decode import moe_decode_gemv, naive_moe_decode
from kimi_hybrid.kernels.testing import rel_err
from presets import preset_config

warnings.filterwarnings("ignore")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.gpu


def _experts(E, k, D, F_, dtype, seed=0):
    cfg = preset_config("tiny-kda-first", num_experts=E, num_experts_per_token=k, moe_intermediate_size=F_,
                        hidden_size=D)
    torch.manual_seed(seed)
    ex = moe.KimiExperts(cfg, D).cuda()
    torch.nn.init.normal_(ex.gate_up_proj, std=0.05)
    torch.nn.init.normal_(ex.down_proj, std=0.05)
    return cfg, ex.to(dtype)


def _routes(N, E, k, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, device="cuda", generator=g)
    return x, idx, w


@needs_cuda
@pytest.mark.parametrize("N", [1, 2, 3, 4, 7, 32])
@pytest.mark.parametrize("E,k,D,F_", [(64, 8, 256, 96), (16, 3, 200, 72)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_moe_decode_gemv_vs_naive(N, E, k, D, F_, dtype, tol):
    """The expert GEMVs == the per-pair loop (same rounding points), batch 1 ... 32 rows, an odd width."""
    _, ex = _experts(E, k, D, F_, dtype, seed=N)
    x, idx, w = _routes(N, E, k, D, dtype, seed=N)
    with torch.no_grad():
        y = moe_decode_gemv(x, idx, w, ex.gate_up_proj, ex.down_proj)
        ref = naive_moe_decode(x, idx, w, ex.gate_up_proj, ex.down_proj)
    assert y.dtype == dtype and y.shape == (N, D)
    assert rel_err(y, ref) < tol


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_decode_gemv_rows_are_independent(dtype):
    """A row computed alone == the same row inside a batch of 32 (bit for bit)."""
    E, k, D, F_ = 64, 8, 256, 96
    _, ex = _experts(E, k, D, F_, dtype)
    x, idx, w = _routes(32, E, k, D, dtype, seed=3)
    with torch.no_grad():
        batch = moe_decode_gemv(x, idx, w, ex.gate_up_proj, ex.down_proj)
        for n in (0, 13, 31):
            alone = moe_decode_gemv(x[n:n + 1], idx[n:n + 1], w[n:n + 1], ex.gate_up_proj, ex.down_proj)
            assert torch.equal(alone[0], batch[n]), n


@needs_cuda
@pytest.mark.parametrize("N", [1, 3])
def test_experts_decode_dispatch_uses_the_gemv(N):
    """``KimiExperts`` at decode size ("eager") runs the GEMV without a host synchronisation, and the registered
    ``"kimi_hybrid_grouped_mm"`` implementation agrees with it (bf16, rel 1e-2)."""
    E, k, D, F_ = 64, 8, 256, 96
    cfg, ex = _experts(E, k, D, F_, torch.bfloat16)
    x, idx, w = _routes(N, E, k, D, torch.bfloat16, seed=N)
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = ex(x, idx, w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(y, moe_decode_gemv(x, idx, w, ex.gate_up_proj, ex.down_proj))
        y_grouped = moe.EXPERTS_FUNCTIONS["kimi_hybrid_grouped_mm"](ex, x, idx, w)
    assert rel_err(y, y_grouped) < 1e-2
