"""Our Triton KDA decode kernel (``kimi_hybrid.kernels.kda_decode``) on CUDA vs its plain-PyTorch reference
(skipped without CUDA). Tolerances: outputs rel 1e-2 (bf16) / 1e-5 (fp32), final states rel 1e-5."""

import warnings
from types import SimpleNamespace

import pytest
import torch

from kimi_hybrid import kda_kimi_hybrid as kk
from kimi_hybrid.kernels.kda_decode import kda_decode_step, kda_decode_triton, naive_kda_decode, naive_kda_decode_step
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



def _step_inputs(B, H, K, W, dtype, seed=0, lower_bound=None, masked=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    P = H * K
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    A_log = torch.empty(H, device="cuda").uniform_(1, 16, generator=g).log()
    dt = torch.empty(P, device="cuda").uniform_(-7, -2, generator=g).exp()
    args = dict(x_raw=r(B, 3 * P).to(dtype), conv_state=r(B, 3 * P, W).to(dtype),
                conv_weight=(r(3 * P, 1, W) * 0.5).to(dtype), g_raw=r(B, P).to(dtype), A_log=A_log,
                dt_bias=dt + torch.log(-torch.expm1(-dt)), beta_raw=r(B, H).to(dtype), gate=r(B, P).to(dtype),
                norm_weight=(torch.rand(K, device="cuda", generator=g) + 0.5), state=r(B, H, K, K) * 0.1)
    valid = (torch.arange(B, device="cuda") % 3 != 1) if masked else None
    return args, dict(num_heads=H, eps=1e-5, lower_bound=lower_bound, valid=valid)


@needs_cuda
@pytest.mark.parametrize("B", [1, 7, 32])
@pytest.mark.parametrize("H,K,W", [(32, 128, 4), (3, 48, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lower_bound,masked", [(None, False), (-5.0, True)])
def test_kda_decode_step_vs_naive(B, H, K, W, dtype, lower_bound, masked):
    """The fused step == the composed references: output rel 1e-2 (bf16) / 1e-5 (fp32), state rel 1e-5 (bf16:
    1e-3, the conv outputs round differently), conv window exact; in place."""
    args, kw = _step_inputs(B, H, K, W, dtype, seed=B * 10 + K, lower_bound=lower_bound, masked=masked)
    with torch.no_grad():
        ref, ref_window, ref_state = naive_kda_decode_step(**args, **kw)
        window_ptr, state_ptr = args["conv_state"].data_ptr(), args["state"].data_ptr()
        out = kda_decode_step(**args, **kw)
    assert out.dtype == dtype and out.shape == (B, H, K)
    assert args["conv_state"].data_ptr() == window_ptr and args["state"].data_ptr() == state_ptr
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert rel_err(args["state"], ref_state) < (1e-3 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(args["conv_state"], ref_window)


PER_ROW = ("x_raw", "conv_state", "g_raw", "beta_raw", "gate", "state")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kda_decode_step_rows_are_independent_and_graph_capturable(dtype):
    """A row alone == the same row in a batch of 32 (bit for bit), and a CUDA-graph replay == an eager call."""
    args, kw = _step_inputs(32, 32, 128, 4, dtype, seed=3)
    fresh = lambda: {k: v.clone() for k, v in args.items()}  # noqa: E731
    with torch.no_grad():
        batch_args = fresh()
        batch = kda_decode_step(**batch_args, **kw)
        for n in (0, 19, 31):
            one = {k: (v[n:n + 1] if k in PER_ROW else v).clone() for k, v in args.items()}
            alone = kda_decode_step(**one, **kw)
            assert torch.equal(alone[0], batch[n]) and torch.equal(one["state"][0], batch_args["state"][n]), n
        graph_args = fresh()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = kda_decode_step(**graph_args, **kw)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, batch) and torch.equal(graph_args["state"], batch_args["state"])


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("static", [False, True])
def test_layer_decode_uses_the_fused_step(dtype, tol, static, monkeypatch):
    """A tiny model's decode steps on CUDA go through ``kda_decode_step`` (counted) and give the unfused layer's
    logits and KDA states (padded batch: one row left-padded)."""
    from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
    from kimi_hybrid import kda_layer_kimi_hybrid as mk
    from presets import preset_config

    cfg = preset_config("tiny-kda-first", linear_attn_config={"head_dim": 32, "num_heads": 2,
                                                              "short_conv_kernel_size": 4})
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(cfg).eval().to("cuda", dtype)
    ids = torch.randint(3, cfg.vocab_size, (2, 12), device="cuda")
    mask = torch.ones(2, 12, dtype=torch.long, device="cuda")
    mask[1, :3] = 0
    real, calls = mk.load_kernel, []

    def counting(op):  # the kernel package with its fused step counted
        ops = real(op)
        if op != "kda_decode" or ops is None:
            return ops
        step = ops.kda_decode_step
        return SimpleNamespace(kda_decode_step_supports=ops.kda_decode_step_supports,
                               kda_decode_step=lambda *a, **kw: calls.append(1) or step(*a, **kw))

    def decode(fused):
        monkeypatch.setattr(mk, "load_kernel", counting if fused else (lambda op: None))
        cache = KimiHybridCache(cfg, max_cache_len=16) if static else KimiHybridCache(cfg)
        with torch.no_grad():
            model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)
            logits = [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                            use_cache=True).logits for t in range(9, 12)]
        kda = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
        return torch.cat(logits, 1), [cache.kda_states(i)[1].clone() for i in kda]

    ref_logits, ref_states = decode(False)
    got_logits, got_states = decode(True)
    assert calls  # the fused step ran
    assert rel_err(got_logits, ref_logits) < tol
    for a, b in zip(got_states, ref_states):
        assert rel_err(a, b) < (1e-5 if dtype == torch.float32 else 1e-3)
