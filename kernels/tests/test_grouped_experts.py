"""The grouped-GEMM expert path (``"kimi_hybrid_grouped_mm"``: two grouped GEMMs, no host synchronisation) on
CUDA vs a per-token fp32 loop (skipped without CUDA). Tolerance: rel L2 1e-2 (bf16)."""

import warnings

import pytest
import torch

from kimi_hybrid import moe_kimi_hybrid as moe
from kimi_hybrid.kernels.testing import rel_err
from presets import preset_config

warnings.filterwarnings("ignore")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.gpu


@needs_cuda
@pytest.mark.parametrize("N", [1, 7, 300])
def test_grouped_experts_vs_loop(N):
    cfg = preset_config("tiny-kda-first", num_experts=64, num_experts_per_token=8,
                                       moe_intermediate_size=64, hidden_size=128)
    torch.manual_seed(N)
    ex = moe.KimiExperts(cfg, 128).cuda()
    torch.nn.init.normal_(ex.gate_up_proj, std=0.05)
    torch.nn.init.normal_(ex.down_proj, std=0.05)
    ex = ex.bfloat16()
    x = torch.randn(N, 128, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(64, device="cuda")[:8] for _ in range(N)])
    w = torch.rand(N, 8, device="cuda")
    offs = torch.arange(1, 65, device="cuda", dtype=torch.int32)
    assert moe.grouped_mm_applies(x, ex.gate_up_proj, ex.down_proj, offs)
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")  # the grouped path must never synchronise with the host
        try:
            y = moe.grouped_experts_forward(ex, x, idx, w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # reference: per token, per chosen expert, fp32
        gu, dn = ex.gate_up_proj.float(), ex.down_proj.float()
        ref = torch.zeros(N, 128, device="cuda")
        for t in range(N):
            for j in range(8):
                e = idx[t, j]
                h = gu[e] @ x[t].float()
                h = torch.nn.functional.silu(h[:64]) * h[64:]
                ref[t] += w[t, j] * (dn[e] @ h)
    assert rel_err(y, ref) < 1e-2
