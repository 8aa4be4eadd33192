"""Test set-up: import the bundle from *this* checkout.

The system may have ``kimi_hybrid`` installed editable from another checkout; the tests must exercise the files next
to them. Putting the repository root first on ``sys.path`` makes ``import modeling_kimi_hybrid`` (the bundle folder;
its ``__init__`` registers the classes with the Auto classes), ``import app`` and ``import examples.<name>`` resolve
here.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import modeling_kimi_hybrid  # noqa: E402,F401  (registers KimiHybridConfig / KimiHybridForCausalLM)
