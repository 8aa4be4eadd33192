"""The plain-PyTorch reference of the KDA decode kernels: the bundle's token loop (``recurrent_kda_ref``), the
definition every KDA path is tested against, called with the decode kernel's arguments."""

from __future__ import annotations

from kimi_hybrid.kda_kimi_hybrid import recurrent_kda_ref

__all__ = ["naive_kda_decode"]


def naive_kda_decode(q, k, v, g, beta, initial_state, scale=None, use_qk_l2norm_in_kernel=True):
    """``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] fp32)``, the contract of
    :func:`kimi_hybrid.kernels.kda_decode.kda_decode_triton`, in fp32 plain PyTorch."""
    return recurrent_kda_ref(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
