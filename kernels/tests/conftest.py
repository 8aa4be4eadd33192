"""GPU test session set-up: import from this checkout; Triton autotuning reduced to one config per kernel (see
kernels/testing.py)."""

import os
import sys
from pathlib import Path

# fp32 tests compare against fp32 references: Triton's fp32 dots in IEEE precision, not TF32 (read when kernels compile)
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kernels.testing import limit_triton_autotuning  # noqa: E402

limit_triton_autotuning()
