"""The only place where the converters touch the model package (modeling_kimi_hybrid/, "the bundle").

- `model_package()`: the model package `kimi_hybrid` (pip maps modeling_kimi_hybrid/ to kimi_hybrid/).
- `to_model_config(ours)`: our normalised config dict -> `KimiHybridConfig`, cross-checked (layer plan, KDA dims)
  against the converter's own reading, so the converter and the model can never disagree silently.
- `write_model_config`: writes config.json as `KimiHybridConfig` serialises it and copies the bundle's flat .py
  files next to the weights with a full `auto_map`, so the folder loads with
  `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` where kimi-hybrid is not installed.
  Without the bundle (converter used alone) the normalised dict is written as is.
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
# converter-side mirrors that KimiHybridConfig derives itself (read-only properties there)
_MIRRORS = ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_size", "gate_lower_bound",
            "use_full_rank_gate", "source_format", "model_type", "architectures", "auto_map", "dtype", "torch_dtype",
            "transformers_version")


def bundle_dir() -> str | None:
    """Folder of the model package's flat .py files: modeling_kimi_hybrid/ of the checkout in an editable install,
    site-packages/kimi_hybrid/ in a regular one."""
    from kimi_hybrid import configuration_kimi_hybrid

    return os.path.dirname(os.path.abspath(configuration_kimi_hybrid.__file__))


def model_package():
    """The model package ``kimi_hybrid`` (this converter is its subpackage ``kimi_hybrid.conversion``)."""
    import kimi_hybrid

    return kimi_hybrid


def config_class():
    """KimiHybridConfig, the model's config class."""
    from kimi_hybrid.configuration_kimi_hybrid import KimiHybridConfig

    return KimiHybridConfig


def bundle_files(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".py") and f != "__init__.py")


def to_model_config(ours: dict):
    """Our config dict -> KimiHybridConfig (None without the bundle). Raises ValueError if the model's reading of
    the config disagrees with the converter's (layer plan, MLP plan, KDA dims)."""
    cls = config_class()
    if cls is None:
        return None
    kw = {k: v for k, v in ours.items() if k not in _MIRRORS}
    for k in ("activation_situ_beta", "activation_situ_linear_beta", "rope_scaling"):
        if kw.get(k) is None:
            kw.pop(k, None)
    cfg = cls(**kw)
    cfg.dtype = ours.get("dtype") or "bfloat16"
    cfg.architectures = ["KimiHybridForCausalLM"]
    diffs = []
    for name, mine in (("layer_types", ours["layer_types"]), ("mlp_layer_types", ours["mlp_layer_types"]),
                       ("linear_num_heads", ours["linear_num_heads"]), ("linear_head_dim", ours["linear_head_dim"]),
                       ("linear_conv_kernel_size", ours["linear_conv_kernel_size"]),
                       ("gate_lower_bound", ours.get("gate_lower_bound")),
                       ("use_full_rank_gate", bool(ours.get("use_full_rank_gate")))):
        if getattr(cfg, name) != mine:
            diffs.append(f"{name}: model {getattr(cfg, name)!r}, converter {mine!r}")
    if diffs:
        raise ValueError("KimiHybridConfig reads the config differently from the converter:\n  " + "\n  ".join(diffs))
    return cfg


def write_model_config(out: str, ours: dict, with_bundle: bool) -> list[str]:
    cfg_obj = to_model_config(ours) if with_bundle else None
    written = ["config.json"]
    if cfg_obj is None:
        cfg = {k: v for k, v in ours.items() if k != "source_format"}
        config_io.write_json(os.path.join(out, "config.json"), cfg)
        return written
    d = bundle_dir()
    for f in bundle_files(d):
        shutil.copy2(os.path.join(d, f), os.path.join(out, f))
        written.append(f)
    cfg = cfg_obj.to_dict()
    cfg["auto_map"] = dict(AUTO_MAP)
    cfg["dtype"] = str(ours.get("dtype") or "bfloat16")
    config_io.write_json(os.path.join(out, "config.json"), cfg)
    return written
