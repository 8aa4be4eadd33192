"""Our two Triton kernels on CPU through Triton's interpreter (``TRITON_INTERPRET=1``), so CI without a GPU checks
their logic against the plain-PyTorch references: ``kda_decode_triton`` vs ``recurrent_kda_ref`` and
``moe_decode_gemv`` vs the experts' CPU loop. fp32 only (the interpreter emulates bf16 casts by truncation, not
round-to-nearest as the GPU does; bf16 is covered by kernels/tests on CUDA). Tolerance: relative L2 error 1e-5.

Runs in a subprocess: the interpreter is chosen when triton is imported. Skipped without triton (CPU-only installs
that do not have it); CI installs it through the ``test`` extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from presets import TINY_PRESETS

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys, torch
from kimi_hybrid import KimiHybridConfig
from kimi_hybrid import kda_kimi_hybrid as kk
from kimi_hybrid import moe_kimi_hybrid as moe
from kimi_hybrid.kernels import kda_decode
from kimi_hybrid.kernels.moe_gemv import moe_decode_gemv

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

out = {"kda": [], "moe": [], "flags": [kda_decode.TRITON_AVAILABLE, moe._MOE_TRITON]}
for (B, T, H, K, V, l2) in [(2, 1, 4, 64, 64, True), (1, 3, 2, 32, 48, True), (2, 2, 3, 100, 20, False),
                            (1, 1, 2, 128, 128, True)]:
    g = torch.Generator().manual_seed(B * 10 + T)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = kk.kda_gate(torch.randn(B, T, H, K, generator=g), torch.rand(H, generator=g) * 2,
                       torch.randn(H * K, generator=g))
    beta = torch.rand(B, T, H, generator=g)
    h0 = torch.randn(B, H, K, V, generator=g) * 0.1
    o, s = kda_decode.kda_decode_triton(q, k, v, gate, beta, h0, use_qk_l2norm_in_kernel=l2, block_v=16)
    o_ref, s_ref = kk.recurrent_kda_ref(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=l2)
    out["kda"].append([rel(o, o_ref), rel(s, s_ref), list(o.shape) == list(o_ref.shape)])
for (N, E, k, D, F) in [(1, 16, 4, 64, 48), (3, 8, 2, 40, 24)]:
    cfg = KimiHybridConfig(**{**json.loads(sys.argv[1]), "num_experts": E, "num_experts_per_token": k,
                              "moe_intermediate_size": F, "hidden_size": D})
    torch.manual_seed(N)
    ex = moe.KimiExperts(cfg, D)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.05)
    torch.nn.init.normal_(ex.down_proj, std=0.05)
    x = torch.randn(N, D)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    w = torch.rand(N, k)
    with torch.no_grad():
        ref = ex(x, idx, w)  # CPU: the loop over the experts that received tokens
        got = moe_decode_gemv(x, idx, w, ex.gate_up_proj, ex.down_proj, block_n=16, block_k=32)
    out["moe"].append([rel(got, ref), list(got.shape) == list(ref.shape)])
print(json.dumps(out))
"""


def test_triton_kernels_match_references_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", KIMI_HYBRID_DISABLE_FLA="1")
    res = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(TINY_PRESETS["tiny-kda-first"])], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["flags"] == [True, True]
    for o_err, s_err, same_shape in out["kda"]:
        assert same_shape and o_err < 1e-5 and s_err < 1e-5, out["kda"]
    for err, same_shape in out["moe"]:
        assert same_shape and err < 1e-5, out["moe"]
