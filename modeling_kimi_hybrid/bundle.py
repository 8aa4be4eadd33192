"""The model bundle: the flat ``*_kimi_hybrid.py`` files that let a checkpoint folder load with
``trust_remote_code=True`` where kimi-hybrid is not installed, and the ``auto_map`` entries that point at them.

The one writer of bundle code and ``auto_map``, used by the converter (``kimi-hybrid-convert``) and by the Hub export
(``kimi-hybrid export`` / ``push``). Every file matching ``BUNDLE_GLOB`` ships, so a new bundle file needs no change
here. This module itself is not part of the bundle (its name does not match the glob).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Union

__all__ = ["AUTO_MAP", "BUNDLE_GLOB", "BUNDLE_REQUIRED", "TOKENIZER_AUTO_MAP", "bundle_dir", "bundle_files",
           "write_auto_map", "write_bundle"]

BUNDLE_GLOB = "*_kimi_hybrid.py"
BUNDLE_REQUIRED = ("configuration_kimi_hybrid.py", "conversion_kimi_hybrid.py", "modeling_kimi_hybrid.py",
                   "cache_kimi_hybrid.py", "engine_kimi_hybrid.py", "kda_kimi_hybrid.py", "tokenization_kimi_hybrid.py")
AUTO_MAP: Dict[str, str] = {
    "AutoConfig": "configuration_kimi_hybrid.KimiHybridConfig",
    "AutoModel": "modeling_kimi_hybrid.KimiHybridModel",
    "AutoModelForCausalLM": "modeling_kimi_hybrid.KimiHybridForCausalLM",
}
TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi_hybrid.KimiHybridTokenizer", None]}


def bundle_dir() -> Path:
    """The folder of this package's bundle files."""
    return Path(__file__).resolve().parent


def bundle_files(folder: Optional[Union[str, Path]] = None) -> List[Path]:
    """Every ``*_kimi_hybrid.py`` file of ``folder`` (default: this package; a Hub folder's own bundle otherwise),
    sorted by name. Raises FileNotFoundError naming any required file that is missing."""
    folder = Path(folder) if folder is not None else bundle_dir()
    missing = [n for n in BUNDLE_REQUIRED if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"bundle files {missing} are missing from {folder}")
    return sorted(folder.glob(BUNDLE_GLOB))


def write_bundle(out_dir: Union[str, Path], folder: Optional[Union[str, Path]] = None) -> List[str]:
    """Copy every bundle file of ``folder`` (default: this package) into ``out_dir`` as regular files. Returns the
    file names written."""
    out = Path(out_dir)
    names = []
    for f in bundle_files(folder):
        shutil.copyfile(f, out / f.name)
        names.append(f.name)
    return names


def write_auto_map(config_path: Union[str, Path], auto_map: Optional[dict] = None) -> None:
    """Set ``auto_map`` (default :data:`AUTO_MAP`) in the JSON file ``config_path``, keeping its other keys; written
    with sorted keys and a 2-space indent."""
    path = Path(config_path)
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["auto_map"] = dict(AUTO_MAP if auto_map is None else auto_map)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
