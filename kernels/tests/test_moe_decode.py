"""Our Triton expert GEMVs (``kimi_hybrid.kernels.moe_decode``) on CUDA vs the experts' loop (skipped without
CUDA). Tolerances: rel L2 1e-5 (fp32), 1e-2 (bf16)."""

import warnings

import pytest
import torch

from kimi_hybrid import moe_kimi_hybrid as moe
from kimi_hybrid.kernels.moe_decode import (GemvConfig, moe_decode_gemv, naive_moe_decode, naive_route_topk,
                                            route_topk_triton)
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
@pytest.mark.parametrize("N", [1, 3, 32])
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


@needs_cuda
@pytest.mark.parametrize("config", [GemvConfig(), GemvConfig(gate_up_n=8, gate_up_k=512, down_n=64, down_k=128,
                                                             num_warps=8, num_stages=2)])
def test_moe_decode_gemv_tile_configs_agree(config):
    """Any tile configuration gives the reference's result (fp32, rel 1e-5)."""
    _, ex = _experts(64, 8, 256, 96, torch.float32)
    x, idx, w = _routes(5, 64, 8, 256, torch.float32, seed=9)
    with torch.no_grad():
        y = moe_decode_gemv(x, idx, w, ex.gate_up_proj, ex.down_proj, config=config)
        ref = naive_moe_decode(x, idx, w, ex.gate_up_proj, ex.down_proj)
    assert rel_err(y, ref) < 1e-5


@needs_cuda
@pytest.mark.parametrize("N", [1, 5, 32])
@pytest.mark.parametrize("E,k,G,TG,sig", [(256, 8, 1, 1, True), (64, 4, 8, 3, True), (32, 2, 4, 2, False)])
def test_route_topk_triton_vs_naive(N, E, k, G, TG, sig):
    """One-launch routing == the bundle's routing: the same experts in the same order, weights rel 1e-6."""
    g = torch.Generator(device="cuda").manual_seed(N * E)
    logits = torch.randn(N, E, device="cuda", generator=g) * 3
    bias = torch.randn(E, device="cuda", generator=g) * 0.1
    kw = dict(top_k=k, num_groups=G, topk_group=TG, sigmoid=sig, renormalize=True, scaling=2.446)
    w, idx = route_topk_triton(logits, bias, **kw)
    w_ref, idx_ref = naive_route_topk(logits, bias, **kw)
    assert torch.equal(idx, idx_ref)
    assert rel_err(w, w_ref) < 1e-6


@needs_cuda
def test_router_uses_the_routing_kernel():
    """``KimiRouter`` on CUDA without autograd routes through the kernel (== its output) and equals the bundle's
    routing."""
    cfg = preset_config("tiny-kda-first", num_experts=64, num_experts_per_token=8, hidden_size=128)
    torch.manual_seed(0)
    router = moe.KimiRouter(cfg).cuda()
    torch.nn.init.normal_(router.weight, std=0.1)
    torch.nn.init.normal_(router.e_score_correction_bias, std=0.01)
    x = torch.randn(7, 128, device="cuda")
    with torch.no_grad():
        logits, w, idx = router(x)
        kw = dict(top_k=8, num_groups=cfg.num_expert_group if cfg.use_grouped_topk else 1,
                  topk_group=cfg.topk_group, sigmoid=cfg.moe_router_activation_func == "sigmoid",
                  renormalize=cfg.moe_renormalize, scaling=cfg.routed_scaling_factor)
        w_k, idx_k = route_topk_triton(logits, router.e_score_correction_bias, **kw)
        w_ref, idx_ref = moe.route_topk(logits, router.e_score_correction_bias, **kw)
    assert torch.equal(idx, idx_k) and torch.equal(w, w_k)
    assert torch.equal(idx, idx_ref) and rel_err(w, w_ref) < 1e-6
