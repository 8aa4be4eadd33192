"""Shared pytest setup: import the bundle from THIS checkout (not an installed copy elsewhere)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path or sys.path[0] != str(ROOT):
    sys.path.insert(0, str(ROOT))

import modeling_kimi_hybrid  # noqa: E402,F401  (registers the classes with the Auto classes)

assert Path(modeling_kimi_hybrid.__file__).resolve().parent == ROOT / "modeling_kimi_hybrid", (
    f"tests must import the bundle of this checkout, got {modeling_kimi_hybrid.__file__}")
