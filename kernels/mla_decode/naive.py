"""The plain-PyTorch reference of the latent MLA decode kernel: the bundle's torch path of
``mla_kimi_hybrid.attend_latent`` (``latent_context``), fp32 scores and softmax."""

from __future__ import annotations

from kimi_hybrid.mla_kimi_hybrid import latent_context

__all__ = ["naive_latent_decode"]


def naive_latent_decode(q, latent, attn_mask, *, num_heads, kv_lora_rank, scaling):
    """``[B, T*H, r]`` in the latent's dtype, the contract of
    :func:`kimi_hybrid.kernels.mla_decode.latent_decode_attention` (``q [B, T*H, r + rope]``, ``latent
    [B, S, r + rope]``, ``attn_mask`` bool ``[B | 1, 1, T, S]`` or None)."""
    return latent_context(q, latent, attn_mask, num_heads=num_heads, kv_lora_rank=kv_lora_rank, scaling=scaling)
