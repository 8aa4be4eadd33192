"""config.json readers and writers for the converters.

Three source formats are read into ONE normalised dict in our format (`model_type = "kimi_hybrid"`, docs/LAYOUT.md):

- released Kimi-Linear (`moonshotai/Kimi-Linear-48B-A3B-*`, remote code): `model_type = "kimi_linear"`, 1-based
  `linear_attn_config.kda_layers / full_attn_layers`, `dtype`, `model_max_length` (no `max_position_embeddings`).
- transformers-native `kimi_linear` (`KimiLinearConfig.save_pretrained`): the same fields plus `layer_types`,
  `mlp_layer_types`, `linear_head_dim`, ... (written by transformers 5.x).
- Kimi K3 (`model_type = "kimi_k3"` with a `text_config` of `model_type = "kimi_linear"`), the text backbone only.

`ours_config_to_released` is the inverse used by the export (it reproduces the 43 keys of the released file).

When the model package (`KimiHybridConfig`) is importable, `to_model_config` builds the real config object from the
dict so the written config.json is exactly what `KimiHybridConfig.save_pretrained` writes.
"""

from __future__ import annotations

import copy
import json
import os

# The 43 top-level keys of the released Kimi-Linear-48B-A3B config.json (docs/checkpoint-format.md section 1), sorted.
RELEASED_KEYS = [
    "architectures", "auto_map", "bos_token_id", "dtype", "eos_token_id", "first_k_dense_replace", "head_dim",
    "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "kv_lora_rank", "linear_attn_config",
    "mla_use_nope", "model_max_length", "model_type", "moe_intermediate_size", "moe_layer_freq", "moe_renormalize",
    "moe_router_activation_func", "num_attention_heads", "num_expert_group", "num_experts", "num_experts_per_token",
    "num_hidden_layers", "num_key_value_heads", "num_nextn_predict_layers", "num_shared_experts", "pad_token_id",
    "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_scaling", "rope_theta",
    "routed_scaling_factor", "tie_word_embeddings", "topk_group", "transformers_version", "use_cache",
    "use_grouped_topk", "v_head_dim", "vocab_size",
]
RELEASED_AUTO_MAP = {
    "AutoConfig": "configuration_kimi.KimiLinearConfig",
    "AutoModel": "modeling_kimi.KimiLinearModel",
    "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
}
# Defaults of the released remote `configuration_kimi.py` for keys a config may omit (docs/checkpoint-format.md section 1).
RELEASED_DEFAULTS = {
    "vocab_size": 163840, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "rms_norm_eps": 1e-6, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "mla_use_nope": False, "num_shared_experts": 0, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
    "moe_layer_freq": 1, "q_lora_rank": None, "num_experts": None, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "hidden_act": "silu",
}
# Fields that only our format has; K3 switches default to "off" (Kimi-Linear).
OUR_K3_DEFAULTS = {
    "mla_use_output_gate": False,
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": False,
    "activation_situ_beta": None,
    "activation_situ_linear_beta": None,
    "attn_res_block_size": 0,
    "gate_lower_bound": None,
    "use_full_rank_gate": False,
}
# generic PretrainedConfig bookkeeping that `to_dict()` adds; not model fields
_GENERIC = {
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "_name_or_path", "torchscript", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task", "add_cross_attention",
    "tie_encoder_decoder", "architectures_", "_attn_implementation_autoset", "_commit_hash", "cross_attention_hidden_size",
    "is_decoder", "pruned_heads", "tf_legacy_loss", "use_bfloat16", "torch_dtype",
}
# transformers-native-only keys that carry nothing our format needs (derived or unused).
_NATIVE_ONLY = {
    "layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
    "qk_head_dim", "pretraining_tp", "attention_bias", "attention_dropout", "output_router_logits",
    "max_position_embeddings", "num_local_experts", "num_experts_per_tok", "n_shared_experts", "n_group",
    "norm_topk_prob",
}


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


def _layer_types_from_lists(n_layers: int, lac: dict) -> list[str]:
    kda = [int(i) for i in lac.get("kda_layers") or []]
    full = [int(i) for i in lac.get("full_attn_layers") or []]
    types: list[str | None] = [None] * n_layers
    for i in kda:
        if not 1 <= i <= n_layers:
            raise ConfigError(f"linear_attn_config.kda_layers has {i}, outside 1..{n_layers} (the lists are 1-based)")
        types[i - 1] = "linear_attention"
    for i in full:
        if not 1 <= i <= n_layers:
            raise ConfigError(f"linear_attn_config.full_attn_layers has {i}, outside 1..{n_layers} (1-based)")
        if types[i - 1] is not None:
            raise ConfigError(f"layer {i} (1-based) is in both kda_layers and full_attn_layers")
        types[i - 1] = "full_attention"
    missing = [i + 1 for i, t in enumerate(types) if t is None]
    if missing:
        raise ConfigError(f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers")
    return types  # type: ignore[return-value]


def mlp_layer_types_for(cfg: dict) -> list[str]:
    """Released rule: layer i is MoE iff num_experts is set, i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    n = cfg["num_hidden_layers"]
    e = cfg.get("num_experts")
    k = cfg.get("first_k_dense_replace", 0) or 0
    freq = cfg.get("moe_layer_freq", 1) or 1
    return ["sparse" if (e and i >= k and i % freq == 0) else "dense" for i in range(n)]


def released_config_to_ours(released: dict) -> dict:
    """Released Kimi-Linear config.json (or a K3 `text_config`) -> our config dict (`model_type = "kimi_hybrid"`).

    Every released field keeps its name; `model_max_length` becomes `max_position_embeddings`; the 1-based
    `linear_attn_config` lists are kept and mirrored as 0-based `layer_types`; `mlp_layer_types` follows the
    released rule; K3 switches are read when present (`linear_attn_config.gate_lower_bound / use_full_rank_gate`,
    `mla_use_output_gate`, `routed_expert_hidden_size`, `latent_moe_use_norm`, SiTU betas, `attn_res_block_size`).
    """
    src = copy.deepcopy(released)
    mt = src.get("model_type")
    if mt not in ("kimi_linear", None):
        raise ConfigError(f"expected a released Kimi-Linear config (model_type 'kimi_linear'), got {mt!r}")
    cfg = {k: v for k, v in RELEASED_DEFAULTS.items()}
    for k, v in src.items():
        if k in ("model_type", "architectures", "auto_map", "transformers_version", "quantization_config",
                 "torch_dtype", "model_max_length") or k in _NATIVE_ONLY or k in _GENERIC:
            continue
        cfg[k] = v
    lac = dict(src.get("linear_attn_config") or {})
    if not lac:
        raise ConfigError("config has no linear_attn_config (kda_layers / full_attn_layers are required)")
    n = int(cfg["num_hidden_layers"])
    if "max_position_embeddings" in src:
        cfg["max_position_embeddings"] = src["max_position_embeddings"]
    elif "model_max_length" in src:
        cfg["max_position_embeddings"] = src["model_max_length"]
    dtype = src.get("dtype") or src.get("torch_dtype") or "bfloat16"
    cfg["dtype"] = dtype
    cfg["linear_attn_config"] = lac
    cfg["layer_types"] = _layer_types_from_lists(n, lac)
    cfg["mlp_layer_types"] = mlp_layer_types_for(cfg)
    cfg["linear_head_dim"] = int(lac["head_dim"])
    cfg["linear_num_heads"] = int(lac["num_heads"])
    cfg["linear_conv_kernel_size"] = int(lac.get("short_conv_kernel_size", 4))
    for k, v in OUR_K3_DEFAULTS.items():
        cfg.setdefault(k, v)
    cfg["gate_lower_bound"] = lac.get("gate_lower_bound")
    cfg["use_full_rank_gate"] = bool(lac.get("use_full_rank_gate", False))
    if cfg.get("attn_res_block_size") is None:
        cfg["attn_res_block_size"] = 0
    cfg["model_type"] = "kimi_hybrid"
    cfg["architectures"] = ["KimiHybridForCausalLM"]
    return cfg


def native_config_to_ours(native: dict) -> dict:
    """transformers-native `KimiLinearConfig` dict (saved config.json or `config.to_dict()`) -> our config dict.

    The native config keeps `linear_attn_config` when it was read from a released file; otherwise its
    `layer_types` / `linear_*` fields are turned back into the released 1-based lists. The native model decides
    "MoE or dense" by `mlp_layer_types` (from `first_k_dense_replace` only), which we keep.
    """
    src = copy.deepcopy(native)
    n = int(src["num_hidden_layers"])
    lac = dict(src.get("linear_attn_config") or {})
    lt = src.get("layer_types")
    if lt:
        lac["kda_layers"] = [i + 1 for i, t in enumerate(lt) if t == "linear_attention"]
        lac["full_attn_layers"] = [i + 1 for i, t in enumerate(lt) if t == "full_attention"]
    lac.setdefault("head_dim", src.get("linear_head_dim", 128))
    lac.setdefault("num_heads", src.get("linear_num_heads", 32))
    lac.setdefault("short_conv_kernel_size", src.get("linear_conv_kernel_dim", 4))
    if lt is None and not lac.get("kda_layers"):
        raise ConfigError("native config has neither layer_types nor linear_attn_config lists")
    # attribute aliases of KimiLinearConfig
    aliases = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
               "n_shared_experts": "num_shared_experts", "n_group": "num_expert_group",
               "norm_topk_prob": "moe_renormalize"}
    for a, b in aliases.items():
        if a in src and b not in src:
            src[b] = src[a]
    src["linear_attn_config"] = lac
    src["model_type"] = "kimi_linear"
    # the native MLA never rotates (NoPE) and always routes with sigmoid scores
    src.setdefault("mla_use_nope", True)
    src.setdefault("moe_router_activation_func", "sigmoid")
    if "max_position_embeddings" in src and "model_max_length" not in src:
        src["model_max_length"] = src["max_position_embeddings"]
    ours = released_config_to_ours(src)
    mlt = src.get("mlp_layer_types")
    if mlt:
        if len(mlt) != n:
            raise ConfigError(f"mlp_layer_types has {len(mlt)} entries for {n} layers")
        ours["mlp_layer_types"] = list(mlt)
    return ours


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
    """Our config dict -> the released Kimi-Linear config.json (43 keys, 1-based lists, `model_max_length`).

    `template`, when given (for example the released file the checkpoint came from), supplies values for keys our
    format does not carry (`transformers_version`, `auto_map`, `head_dim`, ...). Refuses K3-only features, which the
    released Kimi-Linear format cannot express.
    """
    k3 = [k for k in ("mla_use_output_gate", "latent_moe_use_norm", "use_full_rank_gate") if ours.get(k)]
    k3 += [k for k in ("routed_expert_hidden_size", "gate_lower_bound") if ours.get(k) is not None]
    if ours.get("hidden_act", "silu") != "silu":
        k3.append(f"hidden_act={ours['hidden_act']!r}")
    if ours.get("attn_res_block_size"):
        k3.append("attn_res_block_size")
    if k3:
        raise ConfigError(f"the released Kimi-Linear layout cannot express K3 features {k3}")
    t = template or {}
    n = int(ours["num_hidden_layers"])
    lt = ours.get("layer_types") or _layer_types_from_lists(n, ours["linear_attn_config"])
    lac = dict(ours.get("linear_attn_config") or {})
    for k in ("gate_lower_bound", "use_full_rank_gate"):
        lac.pop(k, None)
    lac["kda_layers"] = [i + 1 for i, x in enumerate(lt) if x == "linear_attention"]
    lac["full_attn_layers"] = [i + 1 for i, x in enumerate(lt) if x == "full_attention"]
    lac["head_dim"] = int(ours.get("linear_head_dim", lac.get("head_dim")))
    lac["num_heads"] = int(ours.get("linear_num_heads", lac.get("num_heads")))
    lac["short_conv_kernel_size"] = int(ours.get("linear_conv_kernel_size", lac.get("short_conv_kernel_size", 4)))
    if list(ours.get("mlp_layer_types") or mlp_layer_types_for(ours)) != mlp_layer_types_for(ours):
        raise ConfigError("mlp_layer_types does not follow first_k_dense_replace / moe_layer_freq; the released "
                          "config cannot express it")
    out: dict = {}
    for k in RELEASED_KEYS:
        if k == "architectures":
            out[k] = t.get(k, ["KimiLinearForCausalLM"])
        elif k == "auto_map":
            out[k] = t.get(k, dict(RELEASED_AUTO_MAP))
        elif k == "model_type":
            out[k] = "kimi_linear"
        elif k == "linear_attn_config":
            out[k] = {kk: lac[kk] for kk in sorted(lac)}
        elif k == "model_max_length":
            out[k] = ours.get("max_position_embeddings", t.get(k, 1048576))
        elif k == "transformers_version":
            out[k] = t.get(k, "4.57.0")
        elif k == "head_dim":
            out[k] = ours.get("head_dim", t.get(k, ours["hidden_size"] // ours["num_attention_heads"]))
        elif k == "dtype":
            out[k] = ours.get("dtype", t.get(k, "bfloat16"))
        elif k in ours:
            out[k] = ours[k]
        elif k in t:
            out[k] = t[k]
        else:
            out[k] = {"rope_theta": 10000.0, "rope_scaling": None, "use_cache": True, "initializer_range": 0.02,
                      "num_key_value_heads": ours["num_attention_heads"]}.get(k, RELEASED_DEFAULTS.get(k))
    return out


def detect_format(cfg: dict) -> str:
    """Guess the checkpoint format from config.json alone: 'k3', 'ours', 'native' or 'released'."""
    mt = cfg.get("model_type")
    if mt == "kimi_k3" or "text_config" in cfg:
        return "k3"
    if mt == "kimi_hybrid":
        return "ours"
    if mt == "kimi_linear":
        lac = cfg.get("linear_attn_config") or {}
        if "gate_lower_bound" in lac or "use_full_rank_gate" in lac or cfg.get("attn_res_block_size"):
            return "k3"
        if "layer_types" in cfg or "linear_head_dim" in cfg:
            return "native"
        return "released"
    raise ConfigError(f"unknown model_type {mt!r} (expected kimi_linear, kimi_k3 or kimi_hybrid)")


def to_ours(cfg: dict, fmt: str) -> dict:
    if fmt == "released":
        return released_config_to_ours(cfg)
    if fmt == "native":
        return native_config_to_ours(cfg)
    if fmt == "k3":
        return k3_config_to_ours(cfg)
    if fmt == "ours":
        ours = copy.deepcopy(cfg)
        n = int(ours["num_hidden_layers"])
        ours.setdefault("layer_types", _layer_types_from_lists(n, ours["linear_attn_config"]))
        ours.setdefault("mlp_layer_types", mlp_layer_types_for(ours))
        for k, v in OUR_K3_DEFAULTS.items():
            ours.setdefault(k, v)
        lac = ours.get("linear_attn_config") or {}
        ours["gate_lower_bound"] = lac.get("gate_lower_bound")
        ours["use_full_rank_gate"] = bool(lac.get("use_full_rank_gate", False))
        if not ours.get("dtype"):
            ours["dtype"] = ours.get("torch_dtype") or "bfloat16"
        ours.setdefault("linear_head_dim", lac.get("head_dim"))
        ours.setdefault("linear_num_heads", lac.get("num_heads"))
        ours.setdefault("linear_conv_kernel_size", lac.get("short_conv_kernel_size", 4))
        return ours
    raise ConfigError(f"unknown source format {fmt!r}")


def write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def packaged_config(name: str) -> str:
    """Path of a config shipped in conversion/configs/ (e.g. 'kimi-linear-48b-a3b-instruct')."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    p = os.path.join(folder, name if name.endswith(".json") else name + ".json")
    if not os.path.exists(p):
        known = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".json"))
        raise ConfigError(f"unknown preset {name!r}; the shipped presets are: {', '.join(known)}")
    return p
