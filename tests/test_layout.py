"""The repository imports every module under one name, the installed package ``kimi_hybrid``: no test module
imports the checkout's folder ``modeling_kimi_hybrid`` as a package of its own (which would give a second copy of
every class), and no Python file edits the module search path or loads a module from a file path."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the patterns are assembled so that this file does not match them itself
_PATH_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\s*\(|\[[^\]]*\]\s*=|\+?=(?!=))")
_FILE_LOAD = re.compile("spec_from_file" + r"_location|Source" + r"FileLoader|\bimp\.load_source")


def test_no_module_named_after_the_source_folder():
    """After the test modules are imported (collection imports them all before any test runs), the model
    classes come from ``kimi_hybrid`` only."""
    import kimi_hybrid

    assert "modeling_kimi_hybrid" not in sys.modules, sys.modules.get("modeling_kimi_hybrid")
    assert not [n for n in sys.modules if n.startswith("modeling_kimi_hybrid.")]
    # (not checked for ``kernels``: run from the repository root, transformers' probe for the Hub ``kernels``
    # library imports the folder kernels/ by that name, and finds no such distribution installed)
    assert not [n for n in ("conversion", "app") if n in sys.modules]
    assert sys.modules["kimi_hybrid.modeling_kimi_hybrid"].KimiHybridForCausalLM is kimi_hybrid.KimiHybridForCausalLM


def test_no_python_file_edits_sys_path_or_loads_by_file_path():
    offenders = []
    # hidden folders (.git, virtual environments, scratch copies) are not part of the repository's code
    files = [p for p in ROOT.rglob("*.py")
             if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    assert len(files) > 40, f"expected the repository's .py files under {ROOT}, found {len(files)}"
    for path in files:
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _PATH_EDIT.search(line) or _FILE_LOAD.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
