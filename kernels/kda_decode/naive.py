"""Plain-PyTorch references of the KDA decode kernels, composed from the bundle's definitions (the token loop
``recurrent_kda_ref`` every KDA path is tested against, the conv update, the gate, the gated RMSNorm)."""

from __future__ import annotations

import torch

from kimi_hybrid.kda_kimi_hybrid import causal_conv1d_update_ref, kda_gate, recurrent_kda_ref
from kimi_hybrid.norms_kimi_hybrid import KimiGatedRMSNorm

__all__ = ["naive_kda_decode", "naive_kda_decode_step"]


def naive_kda_decode(q, k, v, g, beta, initial_state, scale=None, use_qk_l2norm_in_kernel=True):
    """``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] fp32)``, the contract of
    :func:`kimi_hybrid.kernels.kda_decode.kda_decode_triton`, in fp32 plain PyTorch."""
    return recurrent_kda_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def naive_kda_decode_step(x_raw, conv_state, conv_weight, g_raw, A_log, dt_bias, beta_raw, gate, norm_weight, state,
                          *, num_heads, eps, lower_bound=None, valid=None, scale=None):
    """The contract of :func:`kimi_hybrid.kernels.kda_decode.kda_decode_step`, composed from the bundle's
    references (``causal_conv1d_update_ref``, ``kda_gate``, ``recurrent_kda_ref``, ``KimiGatedRMSNorm``) as the
    KDA layer's decode step runs them on CUDA (beta rounded to the activations' dtype). Returns
    ``(out [B, H, K], new_conv_state [B, 3P, W], new_state [B, H, K, K] fp32)``; the inputs are not modified."""
    B, C = x_raw.shape
    H = num_heads
    P = C // 3
    K = P // H
    y, window = causal_conv1d_update_ref(x_raw, conv_weight, conv_state)
    q, k, v = (t.reshape(B, 1, H, K) for t in y.split(P, dim=-1))
    g = kda_gate(g_raw.view(B, 1, H, K), A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_raw.float()).to(x_raw.dtype).view(B, 1, H)
    if valid is not None:
        k = k * valid.view(B, 1, 1, 1).to(k.dtype)
        g = g * valid.view(B, 1, 1, 1).to(g.dtype)
        beta = beta * valid.view(B, 1, 1).to(beta.dtype)
        window = torch.where(valid.view(B, 1, 1), window, conv_state.to(window.dtype))
    o, new_state = recurrent_kda_ref(q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
    with torch.device(x_raw.device), torch.no_grad():  # built on the device: no host copy (CUDA-graph capturable)
        norm = KimiGatedRMSNorm(K, eps=eps)
        norm.weight.copy_(norm_weight)
    out = norm(o.reshape(B, H, K), gate.view(B, H, K))
    return out, window.to(conv_state.dtype), new_state
