"""GPU fast paths vs the plain-PyTorch references (skipped without CUDA, or without FLA for the FLA kernels).

fp32 runs use IEEE fp32 dots in Triton (``TRITON_F32_DEFAULT=ieee``, set in conftest.py before any kernel compiles;
FLA's kernels otherwise use TF32 for fp32 inputs).

Error metric, unless stated: relative RMS error ``||a - b||_2 / ||b||_2`` between the fast path on bf16 inputs and
the fp32 reference computed from the *same* bf16-rounded inputs. Tolerances (bf16, K = V = 64: one autotuned shape family):
outputs and final states 1e-2, gradients 2e-2; fp32 model logits vs the CPU reference 2e-3; bf16 model logits vs the CPU fp32 reference 3e-2.
"""

import warnings

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid import kda_kimi_hybrid as kk
from kimi_hybrid import modeling_kimi_hybrid as mk
from kimi_hybrid import moe_kimi_hybrid as moe
from kimi_hybrid.kernels.kda_decode import kda_decode_triton
from presets import preset_config

warnings.filterwarnings("ignore")

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
needs_fla = pytest.mark.skipif(not (CUDA and kk.fla_available()), reason="needs CUDA and flash-linear-attention")
pytestmark = pytest.mark.gpu


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def grad_err(a, b, floor=1e-3):
    """Relative L2 error of a gradient, with an RMS floor: a gradient that is zero in exact arithmetic (dg of the
    first token without an initial state) is rounding noise on both sides, and a plain relative error divides by
    that noise."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / torch.maximum(b.norm(), torch.tensor(floor * b.numel() ** 0.5))).item()


def kda_inputs(B, T, H, K, V, seed=0, state=False, N=None, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev, generator=g).bfloat16()
    k = torch.randn(B, T, H, K, device=dev, generator=g).bfloat16()
    v = torch.randn(B, T, H, V, device=dev, generator=g).bfloat16()
    A_log = torch.empty(H, device=dev).uniform_(1, 16, generator=g).log()
    dt = torch.empty(H * K, device=dev).uniform_(-7, -2, generator=g).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    graw = torch.randn(B, T, H, K, device=dev, generator=g)
    gate = kk.kda_gate(graw, A_log, dt_bias)
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev, generator=g)).bfloat16()
    h0 = torch.randn(N or B, H, K, V, device=dev, generator=g) * 0.1 if state else None
    ts = [q, k, v, gate, beta] + ([h0] if state else [])
    if grad:
        for t in ts:
            t.requires_grad_(True)
    return ts if state else ts + [None]


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
    assert rel(o, o_ref) < 1e-2 and rel(ht, ht_ref) < 1e-2
    do = torch.randn_like(o_ref.float())
    dht = torch.randn_like(ht_ref)
    ((o.float() * do).sum() + (ht * dht).sum()).backward()
    ((o_ref.float() * do).sum() + (ht_ref * dht).sum()).backward()
    pairs = [(q, qr), (k, kr), (v, vr), (g, gr), (beta, br)] + ([(h0, h0r)] if state else [])
    for name, (a, b) in zip("q k v g beta h0".split(), pairs):
        assert grad_err(a.grad, b.grad) < 2e-2, (T, state, name, grad_err(a.grad, b.grad))


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
    assert rel(o, o_ref) < 1e-2 and rel(ht, ht_ref) < 1e-2


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
        o_ref, ht_ref = kk.recurrent_kda_ref(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=l2)
        o_d, ht_d = kk.kda_recurrent(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                     use_qk_l2norm_in_kernel=l2)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert rel(o, o_ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert rel(ht, ht_ref) < 1e-5
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
        o_ref, ht_ref = kk.recurrent_kda_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    assert rel(o, o_ref) < 1e-2 and rel(ht, ht_ref) < 1e-5


@needs_fla
@pytest.mark.parametrize("state", [False, True])
def test_kda_varlen_fla_vs_ref(state):
    cu = torch.tensor([0, 1, 64, 129, 1129], device="cuda")
    q, k, v, g, beta, h0 = kda_inputs(1, 1129, 4, 64, 64, seed=7, state=state, N=4)
    with torch.no_grad():
        o, ht = kk.kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        o_ref, ht_ref = kk.chunk_kda_ref(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        assert rel(o, o_ref) < 1e-2 and rel(ht, ht_ref) < 1e-2
        cu1 = torch.tensor([0, 1, 2, 3], device="cuda")
        q1, k1, v1, g1, b1, h1 = kda_inputs(1, 3, 4, 64, 64, seed=8, state=True, N=3)
        o, ht = kk.kda_recurrent(q1, k1, v1, g1, b1, initial_state=h1, output_final_state=True, cu_seqlens=cu1)
        o_ref, ht_ref = kk.recurrent_kda_ref(q1, k1, v1, g1, b1, initial_state=h1, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True, cu_seqlens=cu1)
        assert rel(o, o_ref) < 1e-2 and rel(ht, ht_ref) < 1e-2


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
    assert rel(y, y_ref) < 1e-2
    assert torch.equal(st.float(), st_ref)  # the window is a copy of inputs: exact
    dy = torch.randn_like(y_ref)
    (y.float() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    assert rel(x.grad, xr.grad) < 2e-2 and rel(w.grad, wr.grad) < 2e-2
    if state:
        assert rel(s0.grad, s0r.grad) < 2e-2


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
    assert rel(y, y_ref) < 1e-2 and torch.equal(st.float(), st_ref)


# ----------------------------------------------------------------------------------------------- grouped experts
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
    assert moe._grouped_mm_ok(x, ex.gate_up_proj, ex.down_proj)
    with torch.no_grad():
        torch.cuda.set_sync_debug_mode("error")  # the grouped path must never synchronise with the host
        try:
            y = ex(x, idx, w)
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
    assert rel(y, ref) < 1e-2


@needs_cuda
@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_moe_decode_gemv_vs_reference(N, dtype, tol):
    """The decode-sized expert GEMVs (Triton) == a per-token fp32 loop over the chosen experts; KimiExperts uses
    them for <= MOE_GEMV_MAX_PAIRS token-expert pairs, and they agree with the grouped GEMM path (bf16)."""
    E, k, D, F_ = 64, 8, 256, 96
    cfg = preset_config("tiny-kda-first", num_experts=E, num_experts_per_token=k,
                                       moe_intermediate_size=F_, hidden_size=D)
    torch.manual_seed(N)
    ex = moe.KimiExperts(cfg, D).cuda()
    torch.nn.init.normal_(ex.gate_up_proj, std=0.05)
    torch.nn.init.normal_(ex.down_proj, std=0.05)
    ex = ex.to(dtype)
    x = torch.randn(N, D, device="cuda").to(dtype)
    idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(N)])
    w = torch.rand(N, k, device="cuda")
    with torch.no_grad():
        assert moe._moe_gemv_applies(cfg, x, ex.gate_up_proj, ex.down_proj, N * k)
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = ex(x, idx, w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(y, moe.moe_decode_gemv(x, idx, w, ex.gate_up_proj, ex.down_proj))
        gu, dn = ex.gate_up_proj.float(), ex.down_proj.float()
        ref = torch.zeros(N, D, device="cuda")
        for t in range(N):
            for j in range(k):
                h = gu[idx[t, j]] @ x[t].float()
                h = torch.nn.functional.silu(h[:F_]) * h[F_:]
                ref[t] += w[t, j] * (dn[idx[t, j]] @ h)
        assert rel(y, ref) < tol
        if dtype == torch.bfloat16:  # the grouped GEMM path on the same inputs
            moe._MOE_TRITON_ENABLED = False
            try:
                y_grouped = ex(x, idx, w)
            finally:
                moe._MOE_TRITON_ENABLED = True
            assert rel(y, y_grouped) < 1e-2


# ------------------------------------------------------------------------------------------------------- models
def _tiny(preset):
    # linear head dim 32 so the FLA kernels run at a realistic tile shape; widths multiples of 8 for grouped GEMM
    cfg = preset_config(preset, linear_attn_config={"head_dim": 32, "num_heads": 2,
                                                                   "short_conv_kernel_size": 4})
    torch.manual_seed(0)
    return cfg, KimiHybridForCausalLM(cfg).eval()


@needs_cuda
@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_model_cuda_matches_cpu(preset, dtype, tol):
    cfg, m = _tiny(preset)
    ids = torch.randint(3, cfg.vocab_size, (2, 77))
    with torch.no_grad():
        ref = m(ids).logits
        g = m.to("cuda", dtype)
        out = g(ids.cuda()).logits
    assert rel(out.cpu(), ref) < tol


@needs_cuda
@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_prefill_decode_equals_full_cuda(preset, dtype, tol):
    cfg, m = _tiny(preset)
    m = m.to("cuda", dtype)
    ids = torch.randint(3, cfg.vocab_size, (2, 40), device="cuda")
    with torch.no_grad():
        full = m(ids).logits
        for static in (False, True):
            cache = KimiHybridCache(cfg, max_cache_len=64) if static else KimiHybridCache(cfg)
            outs = [m(ids[:, :30], past_key_values=cache, use_cache=True).logits]
            outs.append(m(ids[:, 30:33], past_key_values=cache, use_cache=True).logits)  # chunk with a past
            for t in range(33, 40):
                outs.append(m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
            assert rel(torch.cat(outs, 1), full) < tol, static


@needs_fla
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_cuda_graph_decode_equals_eager(dtype, tol, compile):
    """Graph replay (optionally of the torch.compile-d step, whose KDA recurrence is the traced reference) == eager
    steps from the same prefilled cache, and == the full forward. fp32 checks the math (1e-4, compiled or not). In
    bf16 the compiled step rounds differently (inductor fuses elementwise chains in fp32 and rounds once where eager
    rounds every op; measured 1.3e-2 over 10 steps, a near-tied router choice can flip), so compiled bf16 is held
    to the bf16-vs-fp32 model tolerance 3e-2; the plain graph replays eager's kernels and stays at 1e-2."""
    from kimi_hybrid.engine_kimi_hybrid import GraphDecoder, prefill_to_static

    torch._dynamo.reset()
    cfg, m = _tiny("tiny-kda-first")
    m = m.to("cuda", dtype)
    ids = torch.randint(3, cfg.vocab_size, (2, 50), device="cuda")
    with torch.no_grad():
        cache_e, last_e = prefill_to_static(m, ids[:, :40], 64)
        eager = []
        for t in range(40, 50):
            eager.append(m(ids[:, t:t + 1], past_key_values=cache_e, use_cache=True).logits[:, -1])
        cache_g, last_g = prefill_to_static(m, ids[:, :40], 64)
        dec = GraphDecoder(m, cache_g, compile=compile)
        graph = [dec.step(ids[:, t:t + 1]).clone() for t in range(40, 50)]
        full = m(ids).logits[:, 40:]
    assert cache_g.seen_tokens == 50 and int(cache_g._pos) == 50
    tol_graph = 3e-2 if (compile and dtype == torch.bfloat16) else tol
    assert rel(torch.stack(graph, 1), torch.stack(eager, 1)) < tol_graph
    assert rel(torch.stack(graph, 1), full) < max(tol, 2e-3 if dtype == torch.float32 else 3e-2)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_static_cache_on_cuda_equals_dynamic(dtype):
    """transformers auto-compiles the decode step of ``generate`` on CUDA when the cache is static
    (``cache_implementation="static"``): greedy tokens must equal those of the dynamic cache (fp32: identical; bf16:
    the first 6 of 8 new tokens, allowing a late near-tie flip from the compiled step's rounding)."""
    torch._dynamo.reset()
    cfg, m = _tiny("tiny-kda-first")
    m = m.to("cuda", dtype)
    x = torch.randint(3, cfg.vocab_size, (2, 12), device="cuda")
    with torch.no_grad():
        dyn = m.generate(input_ids=x, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        sta = m.generate(input_ids=x, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         cache_implementation="static")
    n = 8 if dtype == torch.float32 else 6
    assert torch.equal(sta[:, : 12 + n], dyn[:, : 12 + n])
    torch._dynamo.reset()
