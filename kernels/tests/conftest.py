"""GPU test session set-up: Triton autotuning reduced to one config per kernel (see kernels/testing.py)."""

import os

# fp32 tests compare against fp32 references: Triton's fp32 dots in IEEE precision, not TF32 (read when kernels compile)
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

from kimi_hybrid.kernels.testing import limit_triton_autotuning  # noqa: E402

limit_triton_autotuning()
