"""The only place where the converters touch the model package (modeling_kimi_hybrid/, "the bundle").

- `model_package()`: the model package `kimi_hybrid` (pip maps modeling_kimi_hybrid/ to kimi_hybrid/).
- `to_model_config(ours)`: our config dict -> `KimiHybridConfig` (the config class is the one reader and writer of
  released config.json files; `config_io` calls it).
- `meta_model(ours)`: the model built on the meta device, whose state_dict is the converters' tensor plan.
- `write_model_config`: writes config.json as `KimiHybridConfig` serialises it and copies the bundle files next to
  the weights with a full `auto_map` (both from `kimi_hybrid.bundle`), so the folder loads with
  `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` where kimi-hybrid is not installed.
  Without the bundle (converter used alone) the normalised dict is written as is.
"""

from __future__ import annotations

import os

from . import config_io

# converter-side mirrors that KimiHybridConfig derives itself (read-only properties there)
_MIRRORS = ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_size", "gate_lower_bound",
            "use_full_rank_gate", "source_format", "model_type", "architectures", "auto_map", "dtype", "torch_dtype",
            "transformers_version")


def model_package():
    """The model package ``kimi_hybrid`` (this converter is its subpackage ``kimi_hybrid.conversion``)."""
    import kimi_hybrid

    return kimi_hybrid


def config_class():
    """KimiHybridConfig, the model's config class."""
    from kimi_hybrid.configuration_kimi_hybrid import KimiHybridConfig

    return KimiHybridConfig


def meta_model(ours: dict):
    """``KimiHybridForCausalLM`` for our config dict, built on the meta device: its ``state_dict`` names, shapes and
    dtypes are the layout the converters plan against (no memory is allocated). Raises ValueError when the
    model refuses the config."""
    import torch

    with torch.device("meta"):
        return model_package().KimiHybridForCausalLM(to_model_config(ours))


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

    written += write_bundle(out)
    cfg = cfg_obj.to_dict()
    cfg["auto_map"] = dict(AUTO_MAP)
    cfg["dtype"] = str(ours.get("dtype") or "bfloat16")
    config_io.write_json(os.path.join(out, "config.json"), cfg)
    return written
