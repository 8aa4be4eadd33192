"""Latent MLA decode kernels (``naive.py``: the plain-PyTorch reference; ``split_kv.py``: the Triton flash-decoding
kernel, keys split across the SMs, partials merged by log-sum-exp). Importing this package needs triton; the bundle
reaches it through ``kimi_hybrid.kernels_kimi_hybrid.load_kernel("mla_decode")``."""

from .naive import naive_latent_decode
from .split_kv import MIN_KERNEL_KEYS, default_num_splits, latent_decode_attention, latent_decode_supports

__all__ = ["MIN_KERNEL_KEYS", "default_num_splits", "latent_decode_attention", "latent_decode_supports", "naive_latent_decode"]
