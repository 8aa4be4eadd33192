"""Our Triton KDA decode kernel (``kimi_hybrid.kernels.kda_decode``) on CUDA vs its plain-PyTorch reference
(skipped without CUDA). Tolerances: outputs rel 1e-2 (bf16) / 1e-5 (fp32), final states rel 1e-5."""

import warnings

import pytest
import torch

from kimi_hybrid import kda_kimi_hybrid as kk
from kimi_hybrid.kernels.kda_decode import kda_decode_triton, naive_kda_decode
from kimi_hybrid.kernels.testing import kda_inputs, rel_err

warnings.filterwarnings("ignore")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = pytest.mark.gpu


@needs_cuda
@pytest.mark.parametrize("B,T,H,K,V", [(1, 1, 32, 128, 128), (3, 1, 4, 64, 64), (2, 5, 4, 128, 128),
                                       (2, 3, 3, 100, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("l2", [True, False])
def test_kda_decode_triton_vs_ref(B, T, H, K, V, dtype, l2):
    """Our Triton decode kernel == the token-loop reference in fp32 on the same inputs: outputs (rounded once to the
    input dtype: rel 1e-2 for bf16, 1e-5 for fp32) and final states (rel 1e-5); the model's dispatcher uses it."""
    g_ = torch.Generator(device="cuda").manual_seed(B * 100 + T)
    q, k, v = (torch.randn(B, T, H, d, device="cuda", generator=g_).to(dtype) for d in (K, K, V))
    gate = kk.kda_gate(torch.randn(B, T, H, K, device="cuda", generator=g_), torch.rand(H, device="cuda") * 2,
                       torch.randn(H * K, device="cuda"))
    beta = torch.rand(B, T, H, device="cuda", generator=g_).to(dtype)
    h0 = torch.randn(B, H, K, V, device="cuda", generator=g_) * 0.1
    with torch.no_grad():
        o, ht = kda_decode_triton(q, k, v, gate, beta, h0, use_qk_l2norm_in_kernel=l2)
        o_ref, ht_ref = naive_kda_decode(q, k, v, gate, beta, h0, use_qk_l2norm_in_kernel=l2)
        o_d, ht_d = kk.kda_recurrent(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=l2)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert rel_err(o, o_ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert rel_err(ht, ht_ref) < 1e-5
    assert torch.equal(o_d, o) and torch.equal(ht_d, ht)  # the dispatcher's CUDA decode path is this kernel


@needs_cuda
def test_kda_decode_triton_is_graph_capturable():
    q, k, v, g, beta, h0 = kda_inputs(1, 1, 8, 128, 128, seed=5, state=True)
    with torch.no_grad():
        kda_decode_triton(q, k, v, g, beta, h0)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, ht = kda_decode_triton(q, k, v, g, beta, h0)
        graph.replay()
        o_ref, ht_ref = naive_kda_decode(q, k, v, g, beta, h0)
    assert rel_err(o, o_ref) < 1e-2 and rel_err(ht, ht_ref) < 1e-5
