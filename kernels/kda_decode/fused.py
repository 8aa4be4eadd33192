"""One KDA decode step in one Triton launch: short-conv update + SiLU, decay gate, beta, q/k L2 norm, the
delta-rule recurrence and the gated RMSNorm of the output, with the conv windows and the fp32 state read once and
written once, in place (static addresses: CUDA-graph safe).

Per token and head (docs/kda.md): ``[q | k | v] = silu(conv(window + x_raw))``, ``g = -exp(A_log) * softplus(g_raw +
dt_bias)`` (or K3's ``lb * sigmoid(exp(A_log) * (g_raw + dt_bias))``), ``beta = sigmoid(beta_raw)``, then
``S <- exp(g) S``, ``S <- S + k (beta (v - S^T k))^T``, ``o = S^T (scale q)`` and ``out = RMSNorm(o) * w *
sigmoid(gate_raw)``. Rounding follows the unfused layer: q / k / v, beta and o are rounded to the activations' dtype
where the layer's separate ops produce them in it.

Reference: :func:`kimi_hybrid.kernels.kda_decode.naive.naive_kda_decode_step`. Tests: kernels/tests/test_kda_decode.py
(CUDA), tests/test_triton_interpreter.py (interpreter).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["kda_decode_step", "kda_decode_step_supports"]


@triton.jit
def _conv_silu(x_ptr, cs_ptr, w_ptr, ch, cmask, taps, W: tl.constexpr, VALID):
    """Channels ``ch`` of one row: the window shifted by one ending with ``x``, written back in place where the row
    is valid; returns ``silu(sum_j window_j * weight_j)`` rounded as the layer does (conv output and SiLU in x's
    dtype)."""
    dt = x_ptr.dtype.element_ty
    m2 = cmask[:, None] & (taps[None, :] < W)
    x_new = tl.load(x_ptr + ch, mask=cmask, other=0.0)
    older = tl.load(cs_ptr + ch[:, None] * W + taps[None, :] + 1, mask=m2 & (taps[None, :] + 1 < W), other=0.0)
    window = tl.where(taps[None, :] == W - 1, x_new[:, None], older.to(dt))
    wt = tl.load(w_ptr + ch[:, None] * W + taps[None, :], mask=m2, other=0.0).to(dt)
    y = tl.sum((window.to(dt) * wt).to(tl.float32), axis=1).to(dt).to(tl.float32)
    tl.store(cs_ptr + ch[:, None] * W + taps[None, :], window.to(cs_ptr.dtype.element_ty), mask=m2 & VALID)
    return (y * tl.sigmoid(y)).to(dt).to(tl.float32)


@triton.jit
def _kda_step_kernel(x_ptr, cs_ptr, cw_ptr, graw_ptr, alog_ptr, dtb_ptr, braw_ptr, gate_ptr, nw_ptr, s_ptr,
                     valid_ptr, out_ptr, H, K, V, P, scale, eps, lower_bound,
                     W: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     LOWER_BOUND: tl.constexpr, HAS_VALID: tl.constexpr):
    """Program (row b, head h). x_raw ``[B, 3P]`` (q | k | v), conv state ``[B, 3P, W]``, conv weight ``[3P, W]``,
    g_raw ``[B, P]``, A_log ``[H]``, dt_bias ``[P]``, beta_raw ``[B, H]``, gate ``[B, P]``, norm weight ``[V]``,
    state ``[B, H, K, V]`` fp32, valid ``[B]``; out ``[B, H, V]``. P = H * K (K = V)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    taps = tl.arange(0, BW)
    mk = ok < K
    mv = ov < V
    valid = b >= 0  # an i1 scalar: every row valid
    if HAS_VALID:
        valid = tl.load(valid_ptr + b) != 0
    xr = x_ptr + b * 3 * P
    cs = cs_ptr + b * 3 * P * W
    q = _conv_silu(xr, cs, cw_ptr, h * K + ok, mk, taps, W, valid)
    k = _conv_silu(xr, cs, cw_ptr, P + h * K + ok, mk, taps, W, valid)
    v = _conv_silu(xr, cs, cw_ptr, 2 * P + h * V + ov, mv, taps, W, valid)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    a = tl.load(graw_ptr + b * P + h * K + ok, mask=mk, other=0.0).to(tl.float32)
    a = a + tl.load(dtb_ptr + h * K + ok, mask=mk, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if LOWER_BOUND:
        g = lower_bound * tl.sigmoid(rate * a)
    else:
        g = -rate * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    beta = tl.sigmoid(tl.load(braw_ptr + b * H + h).to(tl.float32)).to(dt).to(tl.float32)
    if HAS_VALID:
        k = tl.where(valid, k, 0.0)
        g = tl.where(valid, g, 0.0)
        beta = tl.where(valid, beta, 0.0)
    m2 = mk[:, None] & mv[None, :]
    s_off = s_ptr + (b * H + h) * K * V + ok[:, None] * V + ov[None, :]
    S = tl.load(s_off, mask=m2, other=0.0)
    S = S * tl.exp(g)[:, None]
    u = beta * (v - tl.sum(k[:, None] * S, axis=0))
    S = S + k[:, None] * u[None, :]
    tl.store(s_off, S, mask=m2)
    o = tl.sum((q * scale)[:, None] * S, axis=0).to(dt).to(tl.float32)
    o = tl.where(mv, o, 0.0)
    o = o * tl.rsqrt(tl.sum(o * o, axis=0) / V + eps)
    gate = tl.load(gate_ptr + b * P + h * V + ov, mask=mv, other=0.0).to(tl.float32)
    o = o * tl.load(nw_ptr + ov, mask=mv, other=0.0).to(tl.float32) * tl.sigmoid(gate)
    tl.store(out_ptr + (b * H + h) * V + ov, o.to(out_ptr.dtype.element_ty), mask=mv)


def kda_decode_step_supports(conv_state: torch.Tensor, state: torch.Tensor, num_heads: int) -> bool:
    """Whether :func:`kda_decode_step` can update these cache buffers in place: a contiguous ``[B, 3P, W]`` window
    and a contiguous float32 ``[B, H, K, K]`` state on CUDA, K <= 256."""
    return (conv_state.is_cuda and conv_state.dim() == 3 and conv_state.is_contiguous() and state.dim() == 4
            and state.dtype == torch.float32 and state.is_contiguous() and state.shape[1] == num_heads
            and state.shape[2] == state.shape[3] <= 256 and conv_state.shape[1] == 3 * num_heads * state.shape[2]
            and conv_state.shape[0] == state.shape[0])


def kda_decode_step(x_raw: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, g_raw: torch.Tensor,
                    A_log: torch.Tensor, dt_bias: torch.Tensor, beta_raw: torch.Tensor, gate: torch.Tensor,
                    norm_weight: torch.Tensor, state: torch.Tensor, *, num_heads: int, eps: float,
                    lower_bound: Optional[float] = None, valid: Optional[torch.Tensor] = None,
                    scale: Optional[float] = None, num_warps: int = 8) -> torch.Tensor:
    """One KDA decode token for every row, fused (see the module docstring); updates ``conv_state`` and ``state``
    in place.

    Args:
        x_raw: ``[B, 3P]`` the q | k | v projections before the conv (P = H * K), activations' dtype.
        conv_state: ``[B, 3P, W]`` contiguous, the last W inputs (oldest first); updated in place.
        conv_weight: ``[3P, W]`` (or ``[3P, 1, W]``). g_raw: ``[B, P]`` gate projection (``f_b_proj(f_a_proj(x))``).
        A_log: ``[H]``; dt_bias: ``[P]``; beta_raw: ``[B, H]`` (``b_proj(x)``, before the sigmoid).
        gate: ``[B, P]`` output-gate projection; norm_weight: ``[K]`` (``o_norm.weight``); eps: its epsilon.
        state: ``[B, H, K, K]`` float32 contiguous; updated in place.
        lower_bound: K3's gate lower bound, or None (Kimi-Linear's softplus gate).
        valid: ``[B]`` bool or None; an invalid row leaves its conv window and state unchanged.
        scale: query scale, default ``K ** -0.5``.

    Returns:
        ``[B, H, K]`` in gate's dtype: the gated-RMSNormed output (``o_proj``'s input).

    Raises:
        ValueError: shapes, dtypes or layouts it does not serve (K > 256, a non-contiguous state or window).
    """
    B, C = x_raw.shape
    H = num_heads
    P = C // 3
    K = P // H
    cw = conv_weight.reshape(C, -1)
    W = cw.shape[1]
    problems = []
    if C != 3 * P or P != H * K or K > 256:
        problems.append(f"x_raw [B, 3 * H * K] with K <= 256 (got {tuple(x_raw.shape)}, {H} heads)")
    if tuple(conv_state.shape) != (B, C, W) or not conv_state.is_contiguous():
        problems.append(f"conv_state contiguous [B, 3P, W] = {(B, C, W)} (got {tuple(conv_state.shape)})")
    if tuple(state.shape) != (B, H, K, K) or state.dtype != torch.float32 or not state.is_contiguous():
        problems.append(f"state contiguous float32 [B, H, K, K] = {(B, H, K, K)} (got {tuple(state.shape)} "
                        f"{state.dtype})")
    if tuple(g_raw.shape) != (B, P) or tuple(gate.shape) != (B, P) or tuple(beta_raw.shape) != (B, H):
        problems.append(f"g_raw / gate [B, P] = {(B, P)} and beta_raw [B, H] = {(B, H)} (got "
                        f"{tuple(g_raw.shape)}, {tuple(gate.shape)}, {tuple(beta_raw.shape)})")
    if problems:
        raise ValueError("kda_decode_step needs " + "; ".join(problems))
    out = torch.empty(B, H, K, dtype=gate.dtype, device=x_raw.device)
    if B == 0:
        return out
    x_raw, g_raw, beta_raw, gate = (t.contiguous() for t in (x_raw, g_raw, beta_raw, gate))
    has_valid = valid is not None
    _kda_step_kernel[(B, H)](
        x_raw, conv_state, cw.contiguous(), g_raw, A_log.contiguous(), dt_bias.contiguous(), beta_raw, gate,
        norm_weight.contiguous(), state, valid.contiguous() if has_valid else out, out, H, K, K, P,
        float(K ** -0.5 if scale is None else scale), float(eps), float(lower_bound or 0.0),
        W=W, BW=triton.next_power_of_2(W), BK=max(16, triton.next_power_of_2(K)),
        BV=max(16, triton.next_power_of_2(K)), LOWER_BOUND=lower_bound is not None, HAS_VALID=has_valid,
        num_warps=num_warps)
    return out
