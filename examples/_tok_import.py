"""Load ``modeling_kimi_hybrid/tokenization_kimi_hybrid.py`` by file path (the package __init__ belongs to main)."""

import importlib.util
import sys
from pathlib import Path

TOKENIZER_FILE = Path(__file__).resolve().parents[1] / "modeling_kimi_hybrid" / "tokenization_kimi_hybrid.py"


def load_tokenizer_module():
    name = "tokenization_kimi_hybrid"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOKENIZER_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
