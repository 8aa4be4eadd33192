# coding=utf-8
"""The one rule for "our GPU kernels are present": :func:`load_kernel`.

The Triton kernels live in the installed package (``kimi_hybrid.kernels.<op>``), not in the model bundle. A bundle
file uses one when it is the installed package's own copy (a Hub copy loaded as remote code stays self-contained and
never imports ``kimi_hybrid``, even where it is installed), the import succeeds (triton present) and the kernel's
switch is not turned off (``KIMI_HYBRID_DISABLE_<OP>=1``, for A/B comparisons). Every caller imports lazily, on its
first CUDA call, so CPU runs never import triton.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Dict, Optional

__all__ = ["load_kernel"]

_INSTALLED = __name__.startswith("kimi_hybrid.")
_LOADED: Dict[str, Optional[ModuleType]] = {}


def load_kernel(op: str) -> Optional[ModuleType]:
    """The kernel package ``kimi_hybrid.kernels.<op>`` (e.g. ``"kda_decode"``, ``"moe_decode"``, ``"mla_decode"``),
    or None where it does not apply: a Hub copy of the bundle, triton missing, or ``KIMI_HYBRID_DISABLE_<OP>=1``
    (``<OP>`` = ``op.upper()``). Cached per op after the first call."""
    if op not in _LOADED:
        module = None
        if _INSTALLED and os.environ.get(f"KIMI_HYBRID_DISABLE_{op.upper()}", "0") != "1":
            try:
                module = importlib.import_module(f"kimi_hybrid.kernels.{op}")
            except Exception:  # noqa: BLE001 - no triton / no GPU build: the bundle's references serve every device
                module = None
        _LOADED[op] = module
    return _LOADED[op]
