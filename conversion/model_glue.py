"""The only place where the converters touch the model package (modeling_kimi_hybrid/, "the bundle").

- `model_package()`: the bundle as an imported package -- `modeling_kimi_hybrid` beside this package in a source
  checkout, or the installed `kimi_hybrid` (pip maps modeling_kimi_hybrid/ to kimi_hybrid/).
- `to_model_config(ours)`: our config dict -> `KimiHybridConfig` (the config class is the one reader and writer of
  released config.json files; `config_io` calls it).
- `meta_model(ours)`: the model built on the meta device, whose state_dict is the converters' tensor plan.
- `write_model_config`: writes config.json as `KimiHybridConfig` serialises it and copies the bundle files next to
  the weights with a full `auto_map` (both from `kimi_hybrid.bundle`), so the folder loads with
  `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` where kimi-hybrid is not installed.
  Without the bundle (converter used alone) the normalised dict is written as is.
"""

from __future__ import annotations

import importlib
import os
import sys

from . import config_io

# converter-side mirrors that KimiHybridConfig derives itself (read-only properties there)
_MIRRORS = ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_size", "gate_lower_bound",
            "use_full_rank_gate", "source_format", "model_type", "architectures", "auto_map", "dtype", "torch_dtype",
            "transformers_version")


def _package_dir() -> str | None:
    """Folder of the model package: modeling_kimi_hybrid/ beside this package (source checkout), else the installed
    package folder that contains this package (site-packages/kimi_hybrid/)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(os.path.dirname(here), "modeling_kimi_hybrid"), os.path.dirname(here)):
        if os.path.isfile(os.path.join(d, "configuration_kimi_hybrid.py")):
            return d
    return None


def model_package():
    """Import and return the bundle package, or None when it is not available."""
    d = _package_dir()
    if d is None:
        return None
    name = os.path.basename(d)
    if name == "modeling_kimi_hybrid":
        root = os.path.dirname(d)
        if root not in sys.path:
            sys.path.insert(0, root)
    return importlib.import_module(name)


def config_class():
    """KimiHybridConfig of the model package (None without it)."""
    pkg = model_package()
    return None if pkg is None else pkg.KimiHybridConfig


def meta_model(ours: dict):
    """``KimiHybridForCausalLM`` for our config dict, built on the meta device: its ``state_dict`` names, shapes and
    dtypes are the layout the converters plan against (no memory is allocated). Raises ValueError without the
    model package, or when the model refuses the config."""
    import torch

    pkg = model_package()
    if pkg is None:
        raise ValueError("the kimi-hybrid model package is not importable: the tensor plan is read from the model")
    with torch.device("meta"):
        return pkg.KimiHybridForCausalLM(to_model_config(ours))


def to_model_config(ours: dict):
    """Our config dict -> KimiHybridConfig (None without the model package). Raises ValueError (naming the field)
    when the model rejects the config."""
    cls = config_class()
    if cls is None:
        return None
    kw = {k: v for k, v in ours.items() if k not in _MIRRORS}
    for k in ("activation_situ_beta", "activation_situ_linear_beta", "rope_scaling"):
        if kw.get(k) is None:
            kw.pop(k, None)
    cfg = cls(**kw)
    cfg.dtype = ours.get("dtype") or ours.get("torch_dtype") or "bfloat16"
    cfg.architectures = ["KimiHybridForCausalLM"]
    return cfg


def write_model_config(out: str, ours: dict, with_bundle: bool) -> list[str]:
    cfg_obj = to_model_config(ours) if with_bundle else None
    written = ["config.json"]
    if cfg_obj is None:
        cfg = {k: v for k, v in ours.items() if k != "source_format"}
        config_io.write_json(os.path.join(out, "config.json"), cfg)
        return written
    from kimi_hybrid.bundle import AUTO_MAP, write_bundle

    written += write_bundle(out, _package_dir())
    cfg = cfg_obj.to_dict()
    cfg["auto_map"] = dict(AUTO_MAP)
    cfg["dtype"] = str(ours.get("dtype") or "bfloat16")
    config_io.write_json(os.path.join(out, "config.json"), cfg)
    return written
