"""Expert decode kernels (``naive.py``: the plain-PyTorch references; ``gemv.py``: the Triton expert GEMVs;
``routing.py``: the routing decision in one launch). Importing this package needs triton; the bundle reaches it
through ``kimi_hybrid.kernels_kimi_hybrid.load_kernel("moe_decode")``."""

from .gemv import GEMV_CONFIGS, GemvConfig, gemv_config, moe_decode_gemv
from .naive import naive_moe_decode, naive_route_topk
from .routing import route_topk_supports, route_topk_triton

__all__ = ["GEMV_CONFIGS", "GemvConfig", "gemv_config", "moe_decode_gemv", "naive_moe_decode", "naive_route_topk",
           "route_topk_supports", "route_topk_triton"]
