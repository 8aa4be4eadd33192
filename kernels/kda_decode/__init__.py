"""KDA decode kernels (``naive.py``: the plain-PyTorch reference; ``recurrent.py``: the Triton recurrence for a few
tokens from a state). Importing this package needs triton; the bundle reaches it through
``kimi_hybrid.kernels_kimi_hybrid.load_kernel("kda_decode")``."""

from .naive import naive_kda_decode
from .recurrent import kda_decode_triton

__all__ = ["kda_decode_triton", "naive_kda_decode"]
