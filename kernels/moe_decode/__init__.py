"""Expert decode kernels (``naive.py``: the plain-PyTorch references; ``gemv.py``: the Triton expert GEMVs).
Importing this package needs triton; the bundle reaches it through
``kimi_hybrid.kernels_kimi_hybrid.load_kernel("moe_decode")``."""

from .gemv import moe_decode_gemv
from .naive import naive_moe_decode

__all__ = ["moe_decode_gemv", "naive_moe_decode"]
