"""Expert GEMVs for decode-sized MoE on CUDA (Triton): each chosen expert's weights are read in place.

``moe_decode_gemv`` computes ``y[n] = sum_j w[n, j] * down_e(silu(gate_e(x[n])) * up_e(x[n]))`` with
``e = idx[n, j]`` for a few tokens (the ``"kimi_hybrid_gemv"`` expert implementation of ``KimiExperts``). Reference:
:func:`kimi_hybrid.kernels.moe_decode.naive.naive_moe_decode`. Tests: kernels/tests/test_moe_decode.py (CUDA),
tests/test_triton_interpreter.py (Triton's interpreter on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["GEMV_CONFIGS", "GemvConfig", "gemv_config", "moe_decode_gemv"]


@triton.jit
def _moe_gate_up_glu_kernel(x_ptr, w_ptr, idx_ptr, h_ptr, D: tl.constexpr, F: tl.constexpr, K_TOP: tl.constexpr,
                            BN: tl.constexpr, BD: tl.constexpr):
    """Widths are compile-time constants (one model, one compile). Program (pair m, block of BN intermediate
    channels): ``h[m, n] = silu(W1[e] x) * (W3[e] x)`` with
    ``e = idx[m]``, ``x = x[m // K_TOP]``; ``W [E, 2F, D]`` rows [:F] gate, [F:] up; fp32 accumulation."""
    m = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < F
    e = tl.load(idx_ptr + m).to(tl.int64)
    tok = m // K_TOP
    base = w_ptr + e * (2 * F) * D
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cmask = cols < D
        xv = tl.load(x_ptr + tok * D + cols, mask=cmask, other=0.0).to(tl.float32)
        m2 = rmask[:, None] & cmask[None, :]
        wg = tl.load(base + rows[:, None] * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        wu = tl.load(base + (rows[:, None] + F) * D + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
    gate = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)  # the unfused path rounds both to x.dtype first
    up = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + m * F + rows, h.to(h_ptr.dtype.element_ty), mask=rmask)

@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, idx_ptr, wt_ptr, y_ptr, D: tl.constexpr, F: tl.constexpr, BN: tl.constexpr,
                     BF: tl.constexpr):
    """Program (pair m, block of BN output channels): ``y[m, n] = wt[m] * (W2[e] h[m])[n]`` in fp32,
    ``W2 [E, D, F]``."""
    m = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask = rows < D
    e = tl.load(idx_ptr + m).to(tl.int64)
    base = w_ptr + e * D * F
    acc = tl.zeros([BN], dtype=tl.float32)
    for f0 in range(0, F, BF):
        cols = f0 + tl.arange(0, BF)
        cmask = cols < F
        hv = tl.load(h_ptr + m * F + cols, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(base + rows[:, None] * F + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * hv[None, :], axis=1)
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # the unfused path's GEMM output is in x.dtype
    wt = tl.load(wt_ptr + m).to(tl.float32)
    tl.store(y_ptr + m * D + rows, acc * wt, mask=rmask)


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the two expert GEMV launches: ``gate_up_n`` / ``down_n`` output rows per program (the grid is
    ``pairs x rows / n``: thousands of programs at batch 1), ``gate_up_k`` / ``down_k`` the reduction tile, and
    the warps / pipeline stages of each program."""

    gate_up_n: int = 16
    gate_up_k: int = 256
    down_n: int = 16
    down_k: int = 256
    num_warps: int = 4
    num_stages: int = 3


# by the number of token-expert pairs (the first row whose bound is >= pairs). Measured on one H200 (bench_kernels
# moe_gemv_sweep, 48B-A3B widths): (8, 256, 16, 256, 4 warps, 4 stages) was the fastest of the sweep at batch 1,
# 4 and 32 alike (B1 39.9 us, B4 114 us, B32 616 us); the larger-pair rows keep it until a sweep says otherwise
GEMV_CONFIGS = (
    (1 << 30, GemvConfig(gate_up_n=8, gate_up_k=256, down_n=16, down_k=256, num_warps=4, num_stages=4)),
)


def gemv_config(pairs: int) -> GemvConfig:
    """The tile configuration for ``pairs`` token-expert pairs (:data:`GEMV_CONFIGS`)."""
    return next(cfg for bound, cfg in GEMV_CONFIGS if pairs <= bound)


def moe_decode_gemv(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, config: Optional[GemvConfig] = None) -> torch.Tensor:
    """Routed experts for a few tokens (decode) as expert GEMVs that read the chosen experts' weights in place: no
    sort, no gather of weights, no host synchronisation (CUDA-graph safe). Two Triton launches (gate/up + SiLU-GLU,
    then down times the routing weight), and a sum over the k choices in fp32 (the grouped path's combine).

    Args:
        x: ``[N, D]`` (bf16 / fp16 / fp32, CUDA). topk_idx: ``[N, k]`` int64 expert ids. topk_w: ``[N, k]`` routing
            weights (fp32). gate_up: ``[E, 2F, D]`` (rows [:F] w1, [F:] w3), down: ``[E, D, F]``, contiguous.
        config: tiles (default :func:`gemv_config` of ``N * k``).

    Returns:
        ``[N, D]`` in x.dtype. The gate / up / down products are rounded to x.dtype where the grouped path rounds
        them (SiLU-GLU on the rounded values), so both paths agree to accumulation order. Each row depends on its
        own pairs only (batch-invariant).
    """
    N, k = topk_idx.shape
    E, F2, D = gate_up.shape
    F_ = F2 // 2
    M = N * k
    cfg = config or gemv_config(M)
    idx = topk_idx.reshape(-1).contiguous()
    wt = topk_w.reshape(-1).float().contiguous()
    xc = x.contiguous()
    h = torch.empty(M, F_, dtype=x.dtype, device=x.device)
    _moe_gate_up_glu_kernel[(M, triton.cdiv(F_, cfg.gate_up_n))](
        xc, gate_up, idx, h, D=D, F=F_, K_TOP=k, BN=cfg.gate_up_n, BD=cfg.gate_up_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    y = torch.empty(M, D, dtype=torch.float32, device=x.device)
    _moe_down_kernel[(M, triton.cdiv(D, cfg.down_n))](
        h, down, idx, wt, y, D=D, F=F_, BN=cfg.down_n, BF=cfg.down_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y.view(N, k, D).sum(1).to(x.dtype)
