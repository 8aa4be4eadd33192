# coding=utf-8
"""Kimi Delta Attention (KDA) kernels: plain-PyTorch references and device dispatch.

KDA (Kimi Linear, arXiv 2510.26692) is a gated delta rule with a per-channel decay. Per head, with a fp32 state
S in R^{K x V} (K = key head dim, V = value head dim):

    S <- Diag(exp(g_t)) S                      (g_t <= 0, log-space decay per key channel)
    u_t = beta_t * (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = S^T (scale * q_t)

q and k are L2-normalised with the epsilon inside the square root (x / sqrt(sum x^2 + 1e-6)) when
``use_qk_l2norm_in_kernel`` is true, the released checkpoints' setting. The state layout is ``[N, H, K, V]`` float32,
the same as FLA's ``chunk_kda`` / ``fused_recurrent_kda`` with ``state_v_first=False``, so a cache written by one
path is read by the other.

This file holds:
  * ``recurrent_kda_ref``: the token loop, the definition the other paths are tested against;
  * ``chunk_kda_ref``: the chunked (chunk 64) WY / UT-transform form in plain PyTorch, any length;
  * ``kda_gate``: the decay gate, Kimi-Linear form ``-exp(A_log) * softplus(x + dt_bias)`` and the K3
    lower-bounded form ``lb * sigmoid(exp(A_log) * (x + dt_bias))``;
  * ``causal_conv1d_ref`` / ``causal_conv1d_update_ref``: the depthwise causal short convolution with SiLU;
  * ``kda_chunk`` / ``kda_recurrent`` / ``short_conv`` / ``short_conv_update``: dispatchers that pick FLA's Triton
    kernels for CUDA tensors when FLA imports, and the references otherwise. The choice is made from the tensor's
    device at call time, never from "is FLA importable" alone (with FLA installed on a CPU machine its kernels fail
    at call time). ``kda_recurrent`` uses our Triton decode kernel (``kimi_hybrid.kernels.kda_decode``) for CUDA
    tensors where the kimi-hybrid package is installed.

Only ``torch`` is required. FLA (``fla-core`` / ``flash-linear-attention`` 0.6.0) is optional.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

try:  # relative import inside the package / Hub bundle
    from .compat_kimi_hybrid import compiling as _compiling
except ImportError:  # pragma: no cover
    from compat_kimi_hybrid import compiling as _compiling  # type: ignore

__all__ = [
    "l2norm",
    "kda_gate",
    "recurrent_kda_ref",
    "chunk_kda_ref",
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
    "kda_chunk",
    "kda_recurrent",
    "short_conv",
    "short_conv_update",
    "fla_available",
]

L2NORM_EPS = 1e-6
# The chunked form is exact for any chunk size. FLA uses 64; on CPU the reference's pairwise decay tensor
# ([C, C, K] per chunk) and the batched triangular solve make 16 about 20x faster than 64 for a training step of the
# embedded model (measured: 2.8 s vs 63 s, 2 cores, batch 8 x 256), so the CPU dispatcher uses 16.
CPU_CHUNK_SIZE = 16


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """L2-normalise the last dim with the epsilon inside the square root: ``x * rsqrt(sum(x^2) + eps)``.

    This is the KDA kernels' normalisation (not ``F.normalize``, which clamps the norm). Returns float32.
    """
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
) -> torch.Tensor:
    """KDA log-space decay gate, computed in float32.

    Args:
        g_raw: ``[..., H, K]`` raw gate projection (``f_b_proj(f_a_proj(x))`` viewed per head), any float dtype.
        A_log: ``[H]`` per-head log decay rate (fp32 in the checkpoints).
        dt_bias: ``[H * K]`` per-channel bias, or None.
        lower_bound: None for Kimi-Linear, ``g = -exp(A_log) * softplus(g_raw + dt_bias)``; a negative float for
            Kimi K3 (``gate_lower_bound``, -5.0), ``g = lb * sigmoid(exp(A_log) * (g_raw + dt_bias))``.

    Returns:
        ``[..., H, K]`` float32, all values <= 0.
    """
    H, K = g_raw.shape[-2], g_raw.shape[-1]
    if A_log.numel() != H:
        raise ValueError(f"A_log has {A_log.numel()} values but the gate has {H} heads")
    g = g_raw.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(H, K)
    rate = A_log.float().view(H, 1).exp()
    if lower_bound is None:
        return -rate * F.softplus(g)
    return float(lower_bound) * torch.sigmoid(rate * g)


def _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {(B, T, H)}, got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must be [B, T, H, K] like q, got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H], got {tuple(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"varlen (cu_seqlens) needs the sequences flattened to batch 1, got batch {B}")
        if int(cu_seqlens[-1]) != T or int(cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu_seqlens.tolist()}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        V = v.shape[-1]
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}")
    return N


def _varlen_apply(fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  cu_seqlens, **kw):
    outs, finals = [], []
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        h0 = initial_state[n:n + 1] if initial_state is not None else None
        if e == s:  # an empty sequence: no output, its state passes through (zeros without an initial state)
            K, V = q.shape[-1], v.shape[-1]
            finals.append(h0 if h0 is not None else q.new_zeros(1, q.shape[2], K, V, dtype=torch.float32))
            continue
        o, hn = fn(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale=scale, initial_state=h0,
                   output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kw)
        outs.append(o)
        finals.append(hn)
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(*v.shape[:1], 0, *v.shape[2:])
    return o, (torch.cat(finals, 0) if output_final_state else None)


def recurrent_kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token-by-token KDA recurrence (the reference definition), float32 math.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, H, V]``. g: ``[B, T, H, K]`` log-space decay (<= 0, float32).
        beta: ``[B, T, H]`` in (0, 1). scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` float32 (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: also return the final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (eps 1e-6 inside the sqrt).
        cu_seqlens: ``[N + 1]`` int64 boundaries of packed sequences (B must be 1); each starts from its own state.

    Returns:
        ``(o [B, T, H, V] in v.dtype, final_state [N, H, K, V] float32 or None)``.

    Raises:
        ValueError: on shape mismatches.
    """
    _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        return _varlen_apply(recurrent_kda_ref, q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    qf, kf = (l2norm(q), l2norm(k)) if use_qk_l2norm_in_kernel else (q.float(), k.float())
    vf, gf, bf = v.float(), g.float(), beta.float()
    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    out = []
    for t in range(T):
        S = S * gf[:, t].exp().unsqueeze(-1)
        kt = kf[:, t]
        u = bf[:, t].unsqueeze(-1) * (vf[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", qf[:, t] * scale, S))
    o = torch.stack(out, dim=1) if T > 0 else vf.new_zeros(B, 0, H, V)
    return o.to(v.dtype), (S if output_final_state else None)


def chunk_kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked KDA in plain PyTorch (WY / UT-transform form), any length T (padded internally), float32 math.

    Same arguments, shapes and returns as :func:`recurrent_kda_ref`, plus ``chunk_size`` (default 64, as FLA).

    Within a chunk of C tokens with cumulative log decay G_r = sum_{s<=r} g_s (per key channel), the delta-rule
    updates U (``[C, V]``) solve the unit lower-triangular system
    ``(I + diag(beta) A) U = diag(beta) (V - (K * exp(G)) S_0)``, ``A_rs = sum_c k_rc k_sc exp(G_rc - G_sc)``
    for s < r. Outputs are ``scale * ((Q * exp(G)) S_0 + Bqk U)`` with the inclusive causal
    ``Bqk_rs = sum_c q_rc k_sc exp(G_rc - G_sc)``, and the state moves to
    ``exp(G_C) * S_0 + (K * exp(G_C - G))^T U``. Decay differences are only taken for s <= r, so every exponent is
    <= 0 and nothing overflows whatever the decay.
    """
    _check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        return _varlen_apply(chunk_kda_ref, q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens, chunk_size=chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    qf, kf = (l2norm(q), l2norm(k)) if use_qk_l2norm_in_kernel else (q.float(), k.float())
    vf, gf, bf = v.float(), g.float(), beta.float()
    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    if T == 0:
        return vf.new_zeros(B, 0, H, V).to(v.dtype), (S if output_final_state else None)
    pad = (-T) % C
    if pad:
        # zero k, beta and g on the padded tail: the state is left exactly as it was
        qf, kf, vf, gf = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qf, kf, vf, gf))
        bf = F.pad(bf, (0, 0, 0, pad))
    n = (T + pad) // C
    # [B, H, n, C, *]
    qc, kc, vc, gc = (x.view(B, n, C, H, -1).permute(0, 3, 1, 2, 4) for x in (qf, kf, vf, gf))
    bc = bf.view(B, n, C, H).permute(0, 3, 1, 2)
    G = gc.cumsum(-2)  # [B, H, n, C, K]
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., r, s, K] = G_r - G_s
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    decay = torch.where(incl[..., None], diff, torch.full_like(diff, float("-inf"))).exp()  # 0 for s > r
    A = torch.einsum("bhnrc,bhnsc,bhnrsc->bhnrs", kc, kc, decay) * strict
    Bqk = torch.einsum("bhnrc,bhnsc,bhnrsc->bhnrs", qc, kc, decay)
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    L = eye + bc.unsqueeze(-1) * A
    Tinv = torch.linalg.solve_triangular(L, eye.expand_as(L).contiguous(), upper=False, unitriangular=True)
    expG = G.exp()
    W = Tinv @ (bc.unsqueeze(-1) * kc * expG)  # [B, H, n, C, K]
    Ub = Tinv @ (bc.unsqueeze(-1) * vc)  # [B, H, n, C, V]
    Qg = qc * expG * scale
    Bqk = Bqk * scale
    Kend = kc * (G[..., -1:, :] - G).exp()  # [B, H, n, C, K]
    gend = G[..., -1, :].exp()  # [B, H, n, K]
    outs = []
    for i in range(n):
        U = Ub[:, :, i] - W[:, :, i] @ S
        outs.append(Qg[:, :, i] @ S + Bqk[:, :, i] @ U)
        S = gend[:, :, i].unsqueeze(-1) * S + Kend[:, :, i].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(v.dtype), (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------------
# short convolution
# ----------------------------------------------------------------------------------------------------------------

def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    cu_seqlens: Optional[torch.LongTensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time, channels last.

    Args:
        x: ``[B, T, C]`` input.
        weight: ``[C, W]`` (or ``[C, 1, W]``) depthwise kernel of width W; ``y_t = sum_j weight[:, j] x_{t-W+1+j}``.
        conv_state: ``[N, C, W]`` the W inputs before ``x`` (oldest first; the oldest is not read, it is the window
            layout of transformers' ``LinearAttentionLayer`` and FLA's ``causal_conv1d``), or None for zeros.
        activation: "silu" or None.
        cu_seqlens: ``[N + 1]`` packed-sequence boundaries (B must be 1); no window crosses a boundary.

    Returns:
        ``(y [B, T, C] in x.dtype, new_state [N, C, W])``: the last W inputs, zeros-padded if fewer were seen.
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    Cw, W = weight.shape
    if x.shape[-1] != Cw:
        raise ValueError(f"conv weight has {Cw} channels but the input has {x.shape[-1]}")
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        ys, states = [], []
        for n in range(len(bounds) - 1):
            s, e = bounds[n], bounds[n + 1]
            st = conv_state[n:n + 1] if conv_state is not None else None
            y, ns = causal_conv1d_ref(x[:, s:e], weight, st, activation)
            ys.append(y)
            states.append(ns)
        return torch.cat(ys, 1), torch.cat(states, 0)
    B, T, _ = x.shape
    if conv_state is None:
        conv_state = x.new_zeros(B, Cw, W)
    if conv_state.shape[-1] != W:
        raise ValueError(f"conv_state holds {conv_state.shape[-1]} inputs per channel; a width-{W} convolution "
                         f"keeps {W}")
    if T == 0:  # an empty sequence (e.g. inside cu_seqlens): no output, the window is unchanged
        return x.new_zeros(B, 0, Cw), conv_state.to(x.dtype)
    xt = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W+T]
    y = F.conv1d(xt[..., 1:], weight.to(x.dtype).unsqueeze(1), groups=Cw)  # [B, C, T]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}; expected 'silu' or None")
    new_state = xt[..., xt.shape[-1] - W:]
    return y.transpose(1, 2), new_state


def causal_conv1d_update_ref(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, activation: Optional[str] = "silu"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One decode step of :func:`causal_conv1d_ref`: ``x`` ``[B, C]``, ``conv_state`` ``[B, C, W]`` (the last W
    inputs, oldest first).

    Returns ``(y [B, C], new_state [B, C, W])``: the window shifted by one, ending with ``x``.
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    window = torch.cat([conv_state[..., 1:].to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, W]
    y = (window * weight.to(x.dtype)).sum(-1)
    if activation == "silu":
        y = F.silu(y)
    return y, window


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------

_FLA = None
USE_TRITON_DECODE = os.environ.get("KIMI_HYBRID_DISABLE_TRITON_DECODE", "0") != "1"


def fla_available() -> bool:
    """True when FLA's KDA kernels import (needs triton and a GPU build); cached after the first call."""
    global _FLA
    if _FLA is None:
        if os.environ.get("KIMI_HYBRID_DISABLE_FLA", "0") == "1":
            _FLA = False
            return False
        try:
            from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: F401

            _FLA = True
        except Exception:  # noqa: BLE001 - any import failure means "use the reference"
            _FLA = False
    return _FLA


_DECODE_KERNEL = None


def _decode_kernel():
    """Our Triton decode kernel (``kimi_hybrid.kernels.kda_decode.kda_decode_triton``) when the kimi-hybrid package
    is installed with triton, else None (a Hub folder loaded without the package uses FLA or the reference).
    Imported on the first CUDA call, never on CPU; cached."""
    global _DECODE_KERNEL
    if _DECODE_KERNEL is None:
        try:
            from kimi_hybrid.kernels.kda_decode import TRITON_AVAILABLE, kda_decode_triton

            _DECODE_KERNEL = kda_decode_triton if TRITON_AVAILABLE else False
        except Exception:  # noqa: BLE001 - package or triton missing: FLA / the reference serve CUDA tensors
            _DECODE_KERNEL = False
    return _DECODE_KERNEL or None


def _use_fla(t: torch.Tensor) -> bool:
    return t.is_cuda and fla_available()




def _contig(*ts):
    return tuple(None if t is None else t.contiguous() for t in ts)


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=True, cu_seqlens=None):
    """Chunked KDA (prefill / training): FLA ``chunk_kda`` on CUDA tensors, :func:`chunk_kda_ref` elsewhere.

    Shapes as :func:`recurrent_kda_ref`; the initial state must be float32; the final state is float32.

    On CUDA the decay is passed as our precomputed fp32 log-space gate (``use_gate_in_kernel=False``): FLA's in-kernel
    gate computes the same formula, but passing ours keeps the two paths bit-for-bit on the same gate values for both
    the Kimi-Linear and the K3 lower-bounded form (one less place where the math can drift); it costs one fp32
    ``[T, H*K]`` read per layer, well under 1% of a prefill. Beta is passed post-sigmoid (``[B, T, H]``) and the L2
    norm of q/k is done in the kernel (eps 1e-6 inside the sqrt, as the reference).
    """
    if _use_fla(q):
        from fla.ops.kda import chunk_kda

        q, k, v, beta = _contig(q, k, v, beta)
        if initial_state is not None:
            initial_state = initial_state.float().contiguous()
        return chunk_kda(q, k, v, g.float().contiguous(), beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cu_seqlens=cu_seqlens)
    return chunk_kda_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cu_seqlens=cu_seqlens, chunk_size=CPU_CHUNK_SIZE)


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=None):
    """Recurrent KDA (decode, few tokens). On CUDA tensors without autograd: our Triton kernel
    (``kimi_hybrid.kernels.kda_decode.kda_decode_triton``, one launch, state tile in registers; used where the
    kimi-hybrid package is installed) when continuing from a state without ``cu_seqlens``, else FLA
    ``fused_recurrent_kda``; :func:`recurrent_kda_ref` elsewhere (and whenever a gradient is
    needed: the recurrent kernels have none, so on CUDA FLA's chunked kernel, which has a backward, is used instead).
    Set ``KIMI_HYBRID_DISABLE_TRITON_DECODE=1`` to route CUDA decode to FLA (A/B comparisons).

    The Triton and FLA calls allocate their outputs and final states and never synchronise with the host, so a decode
    step that uses them can be captured in a CUDA graph (after a warm-up call has compiled / autotuned the kernels)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    if (q.is_cuda and not needs_grad and cu_seqlens is None and initial_state is not None and USE_TRITON_DECODE
            and not _compiling() and q.shape[-1] <= 256 and _decode_kernel() is not None):
        o, final = _decode_kernel()(q, k, v, g, beta, initial_state, scale=scale,
                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return o, (final if output_final_state else None)
    # under torch.compile (the compiled CUDA-graph decode step) the reference is traced instead: a few elementwise
    # ops and two reductions over the [B, H, K, V] state that inductor fuses with the gate / norm around them
    if _use_fla(q) and not needs_grad and not _compiling():
        from fla.ops.kda import fused_recurrent_kda

        q, k, v, beta = _contig(q, k, v, beta)
        if initial_state is not None:
            initial_state = initial_state.float().contiguous()
        return fused_recurrent_kda(q, k, v, g.float().contiguous(), beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    if needs_grad and q.is_cuda and fla_available():
        return kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                         cu_seqlens)
    return recurrent_kda_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens)


_FLA_CONV = None


def _fla_conv_fn():
    """FLA's functional causal conv (``fla.modules.causal_conv1d.causal_conv1d`` in fla-core 0.6.0; the older
    ``fla.modules.convolution`` path is an alias there), or None."""
    global _FLA_CONV
    if _FLA_CONV is None:
        fn = None
        for mod in ("fla.modules.causal_conv1d", "fla.modules.convolution"):
            try:
                fn = getattr(__import__(mod, fromlist=["causal_conv1d"]), "causal_conv1d")
                break
            except Exception:  # noqa: BLE001
                continue
        _FLA_CONV = fn if fn is not None else False
    return _FLA_CONV or None


def short_conv(x, weight, conv_state=None, activation="silu", cu_seqlens=None):
    """Causal depthwise conv for prefill: FLA's Triton ``causal_conv1d`` on CUDA when available, else the reference.

    Same contract as :func:`causal_conv1d_ref` (state ``[N, C, W]``)."""
    if _use_fla(x):
        fla_conv = _fla_conv_fn()
        if fla_conv is not None:
            return _fla_short_conv(fla_conv, x, weight, conv_state, activation, cu_seqlens)
    return causal_conv1d_ref(x, weight, conv_state, activation, cu_seqlens)


def _fla_short_conv(fla_conv, x, weight, conv_state, activation, cu_seqlens):
    """FLA ``causal_conv1d(x [B, T, C], weight [C, W], initial_state [N, C, W], output_final_state, activation,
    cu_seqlens)``: FLA keeps the same W-wide window as ours (the W most recent inputs, oldest first)."""
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    init = None if conv_state is None else conv_state.to(x.dtype).contiguous()
    y, final = fla_conv(x=x.contiguous(), weight=weight.to(x.dtype).contiguous(), bias=None,
                        activation=activation, initial_state=init, output_final_state=True, cu_seqlens=cu_seqlens)
    return y, final


def short_conv_update(x, weight, conv_state, activation="silu"):
    """One-token conv step (``x`` ``[B, C]``, state ``[B, C, W]``); the plain-torch form is already a few fused
    elementwise ops, so it is used on every device."""
    return causal_conv1d_update_ref(x, weight, conv_state, activation)
