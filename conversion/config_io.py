"""config.json for the converters: format detection, JSON files, and thin calls of the model's one reader and
writer of released configs (``KimiHybridConfig.from_released_dict`` / ``to_released_dict``).

Three source formats are read into ONE config dict in our format (``model_type = "kimi_hybrid"``): the
``KimiHybridConfig``'s ``to_dict()`` plus the derived views the tensor plans read (``linear_head_dim``,
``linear_num_heads``, ``linear_conv_kernel_size``, ``gate_lower_bound``, ``use_full_rank_gate``, ``dtype``):

- released Kimi-Linear (``moonshotai/Kimi-Linear-48B-A3B-*``, remote code): ``model_type = "kimi_linear"``;
- transformers-native ``kimi_linear`` (``KimiLinearConfig.save_pretrained``);
- Kimi K3 (``model_type = "kimi_k3"`` with a ``text_config``), the text backbone only.

``ours_config_to_released`` is the inverse used by the export (the 43 keys of the released file).
"""

from __future__ import annotations

import copy
import json

from kimi_hybrid import configuration_kimi_hybrid

RELEASED_KEYS = configuration_kimi_hybrid.RELEASED_KEYS  # the keys of a released config.json, in their order


class ConfigError(ValueError):
    """A config.json cannot be interpreted."""


def load_json(path: str) -> dict:
    """Read a JSON object. Raises ConfigError naming the file when it is not valid JSON or not an object."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def mlp_layer_types_for(cfg: dict) -> list[str]:
    """Released rule: layer i is MoE iff num_experts is set, i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    n = cfg["num_hidden_layers"]
    e = cfg.get("num_experts")
    k = cfg.get("first_k_dense_replace", 0) or 0
    freq = cfg.get("moe_layer_freq", 1) or 1
    return ["sparse" if (e and i >= k and i % freq == 0) else "dense" for i in range(n)]


def config_to_ours(cfg) -> dict:
    """``KimiHybridConfig`` -> our config dict: ``to_dict()`` plus the derived views the tensor plans read."""
    d = cfg.to_dict()
    d.update(linear_head_dim=cfg.linear_head_dim, linear_num_heads=cfg.linear_num_heads,
             linear_conv_kernel_size=cfg.linear_conv_kernel_size, gate_lower_bound=cfg.gate_lower_bound,
             use_full_rank_gate=cfg.use_full_rank_gate, model_type="kimi_hybrid",
             architectures=["KimiHybridForCausalLM"])
    d["dtype"] = str(getattr(cfg, "dtype", None) or "bfloat16").replace("torch.", "")
    return d


def _model_config_class():
    from .model_glue import config_class

    cls = config_class()
    if cls is None:
        raise ConfigError("the kimi-hybrid model package is not importable: its config class reads config.json")
    return cls


def _read_released(d: dict) -> dict:
    try:
        return config_to_ours(_model_config_class().from_released_dict(d))
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"the model rejects this config: {e}") from None


def released_config_to_ours(released: dict) -> dict:
    """Released Kimi-Linear config.json (or a K3 ``text_config``) -> our config dict, read by
    ``KimiHybridConfig.from_released_dict``. Raises ConfigError for another ``model_type``, a missing
    ``linear_attn_config`` or a config the model rejects."""
    mt = released.get("model_type")
    if mt not in ("kimi_linear", None):
        raise ConfigError(f"expected a released Kimi-Linear config (model_type 'kimi_linear'), got {mt!r}")
    if not released.get("linear_attn_config"):
        raise ConfigError("config has no linear_attn_config (kda_layers / full_attn_layers are required)")
    return _read_released(released)


def native_config_to_ours(native: dict) -> dict:
    """transformers-native ``KimiLinearConfig`` dict (saved config.json or ``config.to_dict()``) -> our config dict
    (``KimiHybridConfig.from_released_dict`` reads the native names; the native ``mlp_layer_types`` is kept)."""
    src = copy.deepcopy(native)
    src["model_type"] = "kimi_linear"
    if not src.get("layer_types") and not (src.get("linear_attn_config") or {}).get("kda_layers"):
        raise ConfigError("native config has neither layer_types nor linear_attn_config lists")
    src.setdefault("linear_head_dim", (src.get("linear_attn_config") or {}).get("head_dim", 128))
    return _read_released(src)


def k3_config_to_ours(k3: dict) -> dict:
    """Kimi K3 config.json (model_type kimi_k3 with text_config) or its text_config alone -> our config dict."""
    text = k3.get("text_config") if k3.get("model_type") == "kimi_k3" or "text_config" in k3 else k3
    if not isinstance(text, dict):
        raise ConfigError("K3 config has no text_config")
    text = dict(text)
    text.setdefault("model_type", "kimi_linear")
    ours = released_config_to_ours(text)
    ours["source_format"] = "k3"
    return ours


def ours_config_to_released(ours: dict, template: dict | None = None) -> dict:
    """Our config dict -> the released Kimi-Linear config.json (43 keys), written by
    ``KimiHybridConfig.to_released_dict``. ``template`` (the released file the checkpoint came from) supplies
    ``architectures``, ``auto_map`` and ``transformers_version``. Refuses K3-only features and an MLP plan the
    released rule cannot express (ConfigError)."""
    k3 = [k for k in ("mla_use_output_gate", "latent_moe_use_norm", "use_full_rank_gate") if ours.get(k)]
    k3 += [k for k in ("routed_expert_hidden_size", "gate_lower_bound") if ours.get(k) is not None]
    if ours.get("hidden_act", "silu") != "silu":
        k3.append(f"hidden_act={ours['hidden_act']!r}")
    if ours.get("attn_res_block_size"):
        k3.append("attn_res_block_size")
    if k3:
        raise ConfigError(f"the released Kimi-Linear layout cannot express K3 features {k3}")
    if list(ours.get("mlp_layer_types") or mlp_layer_types_for(ours)) != mlp_layer_types_for(ours):
        raise ConfigError("mlp_layer_types does not follow first_k_dense_replace / moe_layer_freq; the released "
                          "config cannot express it")
    from .model_glue import to_model_config

    return to_model_config(ours).to_released_dict(template)


def detect_format(cfg: dict) -> str:
    """Guess the checkpoint format from config.json alone: 'k3', 'ours', 'native' or 'released' (the model bundle's
    ``checkpoint_format``, which ``from_pretrained`` also uses to decide what it loads directly). Raises ConfigError
    for an unknown ``model_type``."""
    from kimi_hybrid.conversion_kimi_hybrid import checkpoint_format

    try:
        return checkpoint_format(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def to_ours(cfg: dict, fmt: str) -> dict:
    """config.json of format ``fmt`` ("released", "native", "k3", "ours") -> our config dict."""
    if fmt == "released":
        return released_config_to_ours(cfg)
    if fmt == "native":
        return native_config_to_ours(cfg)
    if fmt == "k3":
        return k3_config_to_ours(cfg)
    if fmt == "ours":
        from .model_glue import to_model_config

        try:
            return config_to_ours(to_model_config(cfg))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the model rejects this config: {e}") from None
    raise ConfigError(f"unknown source format {fmt!r}")


def write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


# the presets users plan and dry-run for, one list for ``kimi-hybrid-convert inventory --preset`` and ``kimi-hybrid
# memory --preset``: name -> the config class's preset that writes its config.json (so each config exists once; the
# Instruct checkpoint has the Base architecture), plus short aliases
RELEASED_PRESETS = {"kimi-linear-48b-a3b": "kimi-linear-48b-a3b", "kimi-linear-48b-a3b-instruct": "kimi-linear-48b-a3b",
                    "kimi-k3": "kimi-k3"}
PRESET_ALIASES = {"k3": "kimi-k3", "kimi-linear": "kimi-linear-48b-a3b", "48b": "kimi-linear-48b-a3b"}


def preset_name(name: str) -> str:
    """The canonical preset name (a key of ``RELEASED_PRESETS``) of ``name``, an alias or a ``.json`` suffix
    allowed, case-insensitive. Raises ConfigError for an unknown name, listing the known ones."""
    key = str(name).lower()
    key = key[:-5] if key.endswith(".json") else key
    key = PRESET_ALIASES.get(key, key)
    if key not in RELEASED_PRESETS:
        raise ConfigError(f"unknown preset {name!r}; the shipped presets are: {', '.join(RELEASED_PRESETS)}")
    return key


def preset_config(name: str) -> dict:
    """The released config.json of a known checkpoint (e.g. 'kimi-linear-48b-a3b-instruct'), as
    ``KimiHybridConfig.from_preset(...).to_released_dict()`` writes it (for K3: inside ``text_config`` of a
    ``kimi_k3`` config). Raises ConfigError for an unknown name, listing the known ones."""
    cfg = _model_config_class().from_preset(RELEASED_PRESETS[preset_name(name)])
    return {"model_type": "kimi_k3", "text_config": cfg.to_released_dict()} if cfg.is_k3 else cfg.to_released_dict()
