"""Our Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``), one test per kernel, each against
its plain-PyTorch reference (``kimi_hybrid.kernels.<op>.naive``), so CI without a GPU checks their logic. fp32
only (the interpreter emulates bf16 casts by truncation, not round-to-nearest as the GPU does; bf16 is covered by
kernels/tests on CUDA). Tolerance: relative L2 error 1e-5 unless stated.

Each test runs its script in a subprocess: the interpreter is chosen when triton is imported. Skipped without triton
(CPU-only installs that do not have it); CI installs it through the ``test`` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# numpy >= 2.4 refuses int() of a 1-element array, which Triton 3.6's interpreter does for a loop bound given at run
# time (kernel arguments are 1-element arrays there): read the element instead (the compiled kernels are unaffected)
PRELUDE = r"""
import json, torch
import triton.runtime.interpreter as _interp
_patch_tensor = _interp._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_interp._patch_lang_tensor = _patch_lang_tensor
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
"""


def run_interpreted(script: str):
    """Run ``PRELUDE + script`` under Triton's interpreter; returns the JSON its last stdout line holds."""
    env = dict(os.environ, TRITON_INTERPRET="1", KIMI_HYBRID_DISABLE_FLA="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", PRELUDE + script], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


KDA_DECODE = r"""
from kimi_hybrid import kda_kimi_hybrid as kk
from kimi_hybrid.kernels.kda_decode import kda_decode_triton, naive_kda_decode
out = []
for (B, T, H, K, V, l2) in [(2, 1, 4, 64, 64, True), (1, 3, 2, 32, 48, True), (2, 2, 3, 100, 20, False),
                            (1, 1, 2, 128, 128, True)]:
    g = torch.Generator().manual_seed(B * 10 + T)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = kk.kda_gate(torch.randn(B, T, H, K, generator=g), torch.rand(H, generator=g) * 2,
                       torch.randn(H * K, generator=g))
    beta = torch.rand(B, T, H, generator=g)
    h0 = torch.randn(B, H, K, V, generator=g) * 0.1
    o, s = kda_decode_triton(q, k, v, gate, beta, h0, use_qk_l2norm_in_kernel=l2, block_v=16)
    o_ref, s_ref = naive_kda_decode(q, k, v, gate, beta, h0, use_qk_l2norm_in_kernel=l2)
    out.append([rel(o, o_ref), rel(s, s_ref), list(o.shape) == list(o_ref.shape)])
print(json.dumps(out))
"""


def test_kda_decode_in_the_interpreter():
    for o_err, s_err, same_shape in run_interpreted(KDA_DECODE):
        assert same_shape and o_err < 1e-5 and s_err < 1e-5


MOE_DECODE = r"""
from kimi_hybrid.kernels.moe_decode import moe_decode_gemv, naive_moe_decode
from kimi_hybrid.kernels.moe_decode.gemv import GemvConfig
cfg = GemvConfig(gate_up_n=16, gate_up_k=32, down_n=16, down_k=32)
out = []
for (N, E, k, D, F) in [(1, 16, 4, 64, 48), (3, 8, 2, 40, 24), (5, 6, 3, 33, 17)]:
    torch.manual_seed(N)
    gate_up, down = torch.randn(E, 2 * F, D) * 0.05, torch.randn(E, D, F) * 0.05
    x = torch.randn(N, D)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    w = torch.rand(N, k)
    got = moe_decode_gemv(x, idx, w, gate_up, down, config=cfg)
    ref = naive_moe_decode(x, idx, w, gate_up, down)
    alone = moe_decode_gemv(x[-1:], idx[-1:], w[-1:], gate_up, down, config=cfg)
    out.append([rel(got, ref), list(got.shape) == list(ref.shape), torch.equal(alone[0], got[-1])])
print(json.dumps(out))
"""


def test_moe_decode_gemv_in_the_interpreter():
    for err, same_shape, row_invariant in run_interpreted(MOE_DECODE):
        assert same_shape and row_invariant and err < 1e-5


MLA_DECODE = r"""
from kimi_hybrid.kernels.mla_decode import latent_decode_attention, naive_latent_decode
out = []
for (B, T, H, R, P, S, splits, masked) in [(1, 1, 4, 32, 16, 50, 3, False), (2, 2, 3, 32, 16, 37, 2, True),
                                          (3, 1, 2, 16, 16, 20, None, True), (1, 1, 16, 64, 16, 7, 4, False),
                                          (2, 1, 3, 16, 16, 601, None, True)]:
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, T * H, R + P, generator=g)
    lat = torch.randn(B, S + 3, R + P, generator=g)[:, :S]  # a static buffer's prefix: strided batch
    mask = None
    if masked:
        q_abs = torch.arange(T) + S - T
        mask = (torch.arange(S).view(1, S) <= q_abs.view(T, 1)).view(1, 1, T, S).expand(B, 1, T, S).clone()
        mask[0, :, :, 3:9] = False  # padded keys of row 0
    kw = dict(num_heads=H, kv_lora_rank=R, scaling=0.3)
    tiles = dict(num_splits=splits, block_n=16, block_h=16, num_warps=4)
    got = latent_decode_attention(q, lat, mask, **kw, **tiles)
    ref = naive_latent_decode(q, lat, mask, **kw)
    alone = latent_decode_attention(q[-1:], lat[-1:], None if mask is None else mask[-1:], **kw, **tiles)
    out.append([rel(got, ref), list(got.shape) == list(ref.shape), torch.equal(alone[0], got[-1])])
print(json.dumps(out))
"""


def test_mla_decode_split_kv_in_the_interpreter():
    """Splits of one or two key tiles with a partial last split, key padding, bottom-right causal T = 2, rows
    fewer than a row block, a strided latent, the default split count over several splits (601 keys: 3 splits of
    256); a row alone == the same row in its batch."""
    for err, same_shape, row_invariant in run_interpreted(MLA_DECODE):
        assert same_shape and row_invariant and err < 1e-5


def test_mla_decode_dispatch_threshold():
    """Below MIN_KERNEL_KEYS keys the kernel declines (attend_latent keeps the faster torch path); min_keys=0 asks
    about validity only, and an invalid shape is declined either way."""
    import torch

    from kimi_hybrid.kernels.mla_decode import MIN_KERNEL_KEYS, latent_decode_supports

    q = torch.zeros(1, 32, 576)
    short, long = torch.zeros(1, MIN_KERNEL_KEYS - 1, 576), torch.zeros(1, MIN_KERNEL_KEYS, 576)
    assert not latent_decode_supports(q, short, 512, None, 32)
    assert latent_decode_supports(q, short, 512, None, 32, min_keys=0)
    assert latent_decode_supports(q, long, 512, None, 32)
    assert not latent_decode_supports(q, long[..., :575], 512, None, 32)


ROUTING = r"""
from kimi_hybrid.kernels.moe_decode import naive_route_topk, route_topk_triton
out = []
for (N, E, k, G, TG, sig, renorm) in [(1, 256, 8, 1, 1, True, True), (5, 64, 4, 8, 3, True, True),
                                     (3, 32, 2, 4, 2, False, True), (2, 16, 1, 1, 1, True, False),
                                     (4, 16, 4, 16, 4, True, True)]:
    g = torch.Generator().manual_seed(N * E)
    logits = torch.randn(N, E, generator=g) * 3
    bias = torch.randn(E, generator=g) * 0.1
    kw = dict(top_k=k, num_groups=G, topk_group=TG, sigmoid=sig, renormalize=renorm, scaling=2.446)
    w, idx = route_topk_triton(logits, bias, **kw)
    w_ref, idx_ref = naive_route_topk(logits, bias, **kw)
    out.append([torch.equal(idx, idx_ref), rel(w, w_ref), w.dtype == w_ref.dtype])
print(json.dumps(out))
"""


def test_routing_in_the_interpreter():
    """Sigmoid / softmax scores, grouped top-k (groups of 1 ... 8 experts), renormalised or not: the same experts
    in the same order, weights to rel 1e-6."""
    for same_idx, w_err, same_dtype in run_interpreted(ROUTING):
        assert same_idx and same_dtype and w_err < 1e-6


KDA_DECODE_STEP = r"""
from kimi_hybrid import kda_kimi_hybrid as kk
from kimi_hybrid.kernels.kda_decode import kda_decode_step, naive_kda_decode_step
out = []
for (B, H, K, W, lb, masked) in [(2, 2, 16, 4, None, False), (3, 3, 24, 4, -5.0, True), (1, 1, 32, 3, None, False)]:
    g = torch.Generator().manual_seed(B * 7 + K)
    P = H * K
    x_raw = torch.randn(B, 3 * P, generator=g)
    cs = torch.randn(B, 3 * P, W, generator=g)
    cw = torch.randn(3 * P, 1, W, generator=g) * 0.5
    g_raw = torch.randn(B, P, generator=g)
    A_log = torch.rand(H, generator=g)
    dtb = torch.randn(P, generator=g)
    braw = torch.randn(B, H, generator=g)
    gate = torch.randn(B, P, generator=g)
    nw = torch.rand(K, generator=g) + 0.5
    st = torch.randn(B, H, K, K, generator=g) * 0.1
    valid = torch.tensor([True, False, True][:B]) if masked else None
    kw = dict(num_heads=H, eps=1e-5, lower_bound=lb, valid=valid)
    ref, ref_cs, ref_st = naive_kda_decode_step(x_raw, cs, cw, g_raw, A_log, dtb, braw, gate, nw, st, **kw)
    cs2, st2 = cs.clone(), st.clone()
    got = kda_decode_step(x_raw, cs2, cw, g_raw, A_log, dtb, braw, gate, nw, st2, num_warps=4, **kw)
    out.append([rel(got, ref), rel(st2, ref_st), torch.equal(cs2, ref_cs), list(got.shape) == list(ref.shape)])
print(json.dumps(out))
"""


def test_kda_decode_step_in_the_interpreter():
    """The fused decode step (conv update to gated RMSNorm) == the composed references: Kimi-Linear and K3 gates,
    an invalid row (window and state unchanged), conv widths 4 and 3, odd head dims; the window exact."""
    for o_err, s_err, same_window, same_shape in run_interpreted(KDA_DECODE_STEP):
        assert same_shape and same_window and o_err < 1e-5 and s_err < 1e-5
