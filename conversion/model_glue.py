"""The only place where the converters touch the model package (modeling_kimi_hybrid/, "the bundle").

- `write_model_config`: writes our config.json. Without the bundle the normalised dict from `config_io` is written
  as is; with it, the dict goes through `KimiHybridConfig` so the file is what the model itself would save, and the
  bundle's flat .py files are copied next to the weights with an `auto_map`, so that the folder loads with
  `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` on a machine without kimi-hybrid installed.
"""

from __future__ import annotations

import os
import shutil

from . import config_io

AUTO_MAP = {
    "AutoConfig": "configuration_kimi_hybrid.KimiHybridConfig",
    "AutoModel": "modeling_kimi_hybrid.KimiHybridModel",
    "AutoModelForCausalLM": "modeling_kimi_hybrid.KimiHybridForCausalLM",
}


def bundle_files(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".py") and f != "__init__.py")


def write_model_config(out: str, ours: dict, with_bundle: bool) -> list[str]:
    from .convert import bundle_dir

    cfg = dict(ours)
    cfg.pop("source_format", None)
    d = bundle_dir() if with_bundle else None
    written = ["config.json"]
    if d is not None:
        for f in bundle_files(d):
            shutil.copy2(os.path.join(d, f), os.path.join(out, f))
            written.append(f)
        cfg["auto_map"] = dict(AUTO_MAP)
    config_io.write_json(os.path.join(out, "config.json"), cfg)
    return written
