"""Make the tests import the bundle of THIS checkout (the folder ``modeling_kimi_hybrid``), not an installed copy."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import modeling_kimi_hybrid  # noqa: E402,F401  (its __init__ registers the classes with the Auto classes)

assert Path(modeling_kimi_hybrid.__file__).resolve().parent == ROOT / "modeling_kimi_hybrid", (
    f"tests imported {modeling_kimi_hybrid.__file__}, not this checkout's bundle")
