"""KDA decode kernels (``naive.py``: the plain-PyTorch references; ``recurrent.py``: the Triton recurrence for a few
tokens from a state; ``fused.py``: one whole decode step, conv update to gated RMSNorm, in one launch). Importing this
package needs triton; the bundle reaches it through ``kimi_hybrid.kernels_kimi_hybrid.load_kernel("kda_decode")``."""

from .fused import kda_decode_step, kda_decode_step_supports
from .naive import naive_kda_decode, naive_kda_decode_step
from .recurrent import kda_decode_triton

__all__ = ["kda_decode_step", "kda_decode_step_supports", "kda_decode_triton", "naive_kda_decode",
           "naive_kda_decode_step"]
