# coding=utf-8
"""Configuration of Kimi's hybrid linear-attention models (``model_type = "kimi_hybrid"``).

One config family covers Kimi-Linear-48B-A3B (Base / Instruct, released ``config.json`` with
``model_type = "kimi_linear"``) and the text backbone of Kimi K3 (``text_config`` of ``moonshotai/Kimi-K3``).
Every released field keeps its released name; the layer plan is held in ``layer_types`` ("linear_attention" = KDA,
"full_attention" = MLA) and ``mlp_layer_types`` ("dense" / "sparse"), and the released 1-based
``linear_attn_config.kda_layers / full_attn_layers`` lists are read into them (and written back on export).

Formats: ``docs/checkpoint-format.md`` (Kimi-Linear) and ``docs/k3.md`` (K3).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Dict, List, Optional

from transformers import PretrainedConfig

LINEAR = "linear_attention"
FULL = "full_attention"

_KIMI_LINEAR_48B = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "hidden_act": "silu",
    "initializer_range": 0.02, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
    "max_position_embeddings": 1048576, "tie_word_embeddings": False, "use_cache": True,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "num_nextn_predict_layers": 0, "num_experts": 256, "num_experts_per_token": 8,
    "moe_intermediate_size": 1024, "num_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "routed_scaling_factor": 2.446, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
    "linear_attn_config": {
        "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
    },
}

_K3_FULL = [4 * i for i in range(1, 24)] + [93]
_KIMI_K3 = {
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 33792, "num_hidden_layers": 93,
    "num_attention_heads": 96, "num_key_value_heads": 96, "hidden_act": "situ", "initializer_range": 0.02,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576, "tie_word_embeddings": False, "use_cache": True,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "mla_use_output_gate": True, "num_nextn_predict_layers": 0,
    "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "routed_scaling_factor": 1.0,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 12, "dtype": "bfloat16",
    "linear_attn_config": {
        "head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "kda_layers": [i for i in range(1, 94) if i not in _K3_FULL], "full_attn_layers": _K3_FULL,
    },
}

PRESETS: Dict[str, Dict[str, Any]] = {
    "kimi-linear-48b-a3b": _KIMI_LINEAR_48B,
    "kimi-k3": _KIMI_K3,
}

_ROUTER_FUNCS = ("sigmoid", "softmax")
_ACTS = ("silu", "situ")


class KimiHybridConfig(PretrainedConfig):
    r"""Configuration for :class:`KimiHybridForCausalLM` (Kimi-Linear and the Kimi K3 text backbone).

    Field names follow the released Kimi-Linear ``config.json`` (docs/checkpoint-format.md section 1) and the K3
    ``text_config`` (docs/k3.md section 1). Layer plan:

    * ``layer_types``: list of "linear_attention" (KDA) / "full_attention" (MLA), one per layer (0-based). If absent
      it is read from the released 1-based ``linear_attn_config["kda_layers"]`` / ``["full_attn_layers"]``.
    * ``mlp_layer_types``: "dense" / "sparse" per layer; default from ``first_k_dense_replace`` and
      ``moe_layer_freq`` (``i >= first_k_dense_replace and i % moe_layer_freq == 0`` is sparse).

    KDA: ``linear_attn_config = {head_dim, num_heads, short_conv_kernel_size, [gate_lower_bound],
    [use_full_rank_gate]}``. MLA (NoPE): ``q_lora_rank`` (None = single q_proj), ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``mla_use_output_gate`` (K3).
    MoE: ``num_experts``, ``num_experts_per_token``, ``moe_intermediate_size``, ``num_shared_experts``,
    ``routed_scaling_factor``, ``moe_router_activation_func``, ``num_expert_group``, ``topk_group``,
    ``moe_renormalize``, ``routed_expert_hidden_size`` (K3 latent MoE; None = off), ``latent_moe_use_norm``.
    K3: ``hidden_act="situ"`` with ``activation_situ_beta`` / ``activation_situ_linear_beta``,
    ``attn_res_block_size`` (AttnRes; 0 = off).

    Raises:
        ValueError: naming the field, when the layer lists do not cover every layer exactly once, a head dim does
            not match, or the activation / router function is unknown.
    """

    model_type = "kimi_hybrid"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"model_max_length": "max_position_embeddings"}

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 2304,
        intermediate_size: int = 9216,
        num_hidden_layers: int = 27,
        num_attention_heads: int = 32,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        hidden_act: str = "silu",
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rope_scaling: Optional[dict] = None,
        max_position_embeddings: int = 1048576,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        bos_token_id: Optional[int] = 163584,
        eos_token_id: Optional[int] = 163586,
        pad_token_id: Optional[int] = 163839,
        q_lora_rank: Optional[int] = None,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = False,
        num_nextn_predict_layers: int = 0,
        num_experts: Optional[int] = 256,
        num_experts_per_token: int = 8,
        moe_intermediate_size: int = 1024,
        num_shared_experts: int = 1,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        routed_scaling_factor: float = 2.446,
        moe_router_activation_func: str = "sigmoid",
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        moe_renormalize: bool = True,
        topk_method: Optional[str] = None,
        routed_expert_hidden_size: Optional[int] = None,
        latent_moe_use_norm: bool = False,
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float = 25.0,
        attn_res_block_size: int = 0,
        linear_attn_config: Optional[dict] = None,
        layer_types: Optional[List[str]] = None,
        mlp_layer_types: Optional[List[str]] = None,
        mla_absorb_max_q_len: int = 16,
        kda_record_max_tokens: int = 64,
        **kwargs,
    ):
        # the released config.json stores the dtype under "dtype" and the context under "model_max_length"
        if "model_max_length" in kwargs:
            max_position_embeddings = kwargs.pop("model_max_length")
        kwargs.pop("auto_map", None) if kwargs.get("model_type") == "kimi_linear" else None
        kwargs.pop("model_type", None)
        for field, value in (("num_hidden_layers", num_hidden_layers), ("hidden_size", hidden_size),
                             ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size / num_attention_heads
        if float(self.head_dim).is_integer():
            self.head_dim = int(self.head_dim)
        self.hidden_act = hidden_act
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        # NoPE: the released config carries rope_theta / rope_scaling (unused). They are kept under other names so
        # transformers' RoPE validation does not treat this model as rotary; export writes them back.
        self.released_rope_theta = rope_theta
        self.released_rope_scaling = rope_scaling
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_router_activation_func = moe_router_activation_func
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.moe_renormalize = moe_renormalize
        self.topk_method = topk_method
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.attn_res_block_size = attn_res_block_size
        self.mla_absorb_max_q_len = mla_absorb_max_q_len
        self.kda_record_max_tokens = kda_record_max_tokens

        lac = copy.deepcopy(linear_attn_config) if linear_attn_config else {}
        lac.setdefault("head_dim", 128)
        lac.setdefault("num_heads", 32)
        lac.setdefault("short_conv_kernel_size", 4)
        self.layer_types = list(layer_types) if layer_types is not None else self._layer_types_from_lists(lac)
        if mlp_layer_types is None:
            mlp_layer_types = [
                "sparse" if (num_experts and i >= first_k_dense_replace and i % max(moe_layer_freq, 1) == 0)
                else "dense"
                for i in range(num_hidden_layers)
            ]
        self.mlp_layer_types = list(mlp_layer_types)
        # keep the released 1-based lists in sync with layer_types (export writes them back)
        lac["kda_layers"] = [i + 1 for i, t in enumerate(self.layer_types) if t == LINEAR]
        lac["full_attn_layers"] = [i + 1 for i, t in enumerate(self.layer_types) if t == FULL]
        self.linear_attn_config = lac
        self.validate_kimi()  # before transformers' own validators, so our errors name the field
        super().__init__(
            bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs,
        )

    # -- derived views -------------------------------------------------------------------------------------------
    @property
    def linear_head_dim(self) -> int:
        """KDA head dim K (= V), ``linear_attn_config['head_dim']``."""
        return int(self.linear_attn_config["head_dim"])

    @property
    def linear_num_heads(self) -> int:
        """KDA heads H, ``linear_attn_config['num_heads']``."""
        return int(self.linear_attn_config["num_heads"])

    @property
    def linear_conv_kernel_size(self) -> int:
        """Short-conv width W, ``linear_attn_config['short_conv_kernel_size']``."""
        return int(self.linear_attn_config["short_conv_kernel_size"])

    @property
    def gate_lower_bound(self) -> Optional[float]:
        """K3 lower bound of the KDA decay gate (e.g. -5.0), or None for the Kimi-Linear softplus gate."""
        lb = self.linear_attn_config.get("gate_lower_bound")
        return None if lb is None else float(lb)

    @property
    def use_full_rank_gate(self) -> bool:
        """K3: full-rank ``g_proj`` output gates instead of Kimi-Linear's low-rank ``g_a/g_b``."""
        return bool(self.linear_attn_config.get("use_full_rank_gate", False))

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key head dim: ``qk_nope_head_dim + qk_rope_head_dim`` (192 for Kimi-Linear)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_mla_layers(self) -> int:
        """Number of MLA (full_attention) layers."""
        return sum(t == FULL for t in self.layer_types)

    @property
    def num_kda_layers(self) -> int:
        """Number of KDA (linear_attention) layers."""
        return sum(t == LINEAR for t in self.layer_types)

    def _layer_types_from_lists(self, lac: dict) -> List[str]:
        n = self.num_hidden_layers
        kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
        if kda is None and full is None:
            # default plan: every fourth layer (1-based 4, 8, ...) is MLA, the last layer too
            return [FULL if ((i + 1) % 4 == 0 or i == n - 1) else LINEAR for i in range(n)]
        kda = list(kda or [])
        full = list(full or [])
        if not kda and not full:
            raise ValueError("linear_attn_config: kda_layers and full_attn_layers are both empty")
        seen: Dict[int, str] = {}
        for name, lst in (("kda_layers", kda), ("full_attn_layers", full)):
            for one_based in lst:
                if not isinstance(one_based, int) or not 1 <= one_based <= n:
                    raise ValueError(
                        f"linear_attn_config.{name}: layer {one_based!r} is outside 1..{n} (the lists are 1-based)")
                if one_based in seen:
                    raise ValueError(
                        f"linear_attn_config.{name}: layer {one_based} is listed twice (also in {seen[one_based]})")
                seen[one_based] = name
        missing = [i for i in range(1, n + 1) if i not in seen]
        if missing:
            raise ValueError(
                f"linear_attn_config: layers {missing} (1-based) are in neither kda_layers nor full_attn_layers; "
                f"every one of the {n} layers must be listed exactly once")
        return [LINEAR if seen[i + 1] == "kda_layers" else FULL for i in range(n)]

    def validate_kimi(self) -> None:
        """Check the layer plan, head dims and function names; raise ValueError naming the field."""
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {n}")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise ValueError(f"layer_types: unknown values {bad}; use '{LINEAR}' (KDA) or '{FULL}' (MLA)")
        if len(self.mlp_layer_types) != n:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries but num_hidden_layers is {n}")
        bad = sorted({t for t in self.mlp_layer_types if t not in ("dense", "sparse")})
        if bad:
            raise ValueError(f"mlp_layer_types: unknown values {bad}; use 'dense' or 'sparse'")
        if "sparse" in self.mlp_layer_types:
            if not self.num_experts:
                raise ValueError("mlp_layer_types has 'sparse' layers but num_experts is not set")
            if not 1 <= self.num_experts_per_token <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_token={self.num_experts_per_token} must be in 1..num_experts={self.num_experts}")
            if self.num_experts % self.num_expert_group:
                raise ValueError(
                    f"num_expert_group={self.num_expert_group} must divide num_experts={self.num_experts}")
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(f"topk_group={self.topk_group} must be in 1..num_expert_group={self.num_expert_group}")
        if self.moe_router_activation_func not in _ROUTER_FUNCS:
            raise ValueError(
                f"moe_router_activation_func={self.moe_router_activation_func!r} is not supported; use one of "
                f"{_ROUTER_FUNCS}")
        if self.hidden_act not in _ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; use one of {_ACTS}")
        if LINEAR in self.layer_types:
            hd, nh = self.linear_head_dim, self.linear_num_heads
            if hd <= 0 or nh <= 0:
                raise ValueError(f"linear_attn_config: head_dim={hd} and num_heads={nh} must be positive")
            if self.linear_conv_kernel_size < 1:
                raise ValueError("linear_attn_config.short_conv_kernel_size must be >= 1")
            lb = self.gate_lower_bound
            if lb is not None and not lb < 0:
                raise ValueError(f"linear_attn_config.gate_lower_bound={lb} must be negative (K3 uses -5.0)")
        if FULL in self.layer_types:
            if not self.mla_use_nope:
                raise ValueError("mla_use_nope=False (rotary MLA) is not supported: Kimi's MLA layers are NoPE")
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if not getattr(self, f) or getattr(self, f) <= 0:
                    raise ValueError(f"{f}={getattr(self, f)!r} must be a positive int for MLA layers")
            if self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(
                    f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                    f"{self.num_attention_heads} (MLA has one latent shared by all heads)")
        if self.attn_res_block_size < 0:
            raise ValueError(f"attn_res_block_size={self.attn_res_block_size} must be >= 0 (0 disables AttnRes)")
        if self.routed_expert_hidden_size is not None and self.routed_expert_hidden_size <= 0:
            raise ValueError("routed_expert_hidden_size must be a positive int or None")

    # -- construction helpers ------------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "KimiHybridConfig":
        """Named configs: "kimi-linear-48b-a3b" (the released values) and "kimi-k3" (K3 text backbone); or the path
        of a ``.json`` file holding constructor arguments (e.g. a small random model for a smoke run).

        Raises:
            KeyError: for an unknown name (the message lists the known ones).
        """
        if name.endswith(".json") and os.path.isfile(name):
            with open(name, encoding="utf-8") as f:
                kw = json.load(f)
            kw.update(overrides)
            return cls(**kw)
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)} (or a .json file of "
                           "constructor arguments)")
        kw = copy.deepcopy(PRESETS[name])
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_released_dict(cls, d: Dict[str, Any]) -> "KimiHybridConfig":
        """Read a released Kimi-Linear ``config.json`` dict (``model_type`` "kimi_linear"), or a K3 top-level
        config (its ``text_config`` is used)."""
        d = copy.deepcopy(d)
        if d.get("model_type") == "kimi_k3" or "text_config" in d:
            d = d["text_config"]
        for k in ("architectures", "auto_map", "transformers_version", "quantization_config", "model_type"):
            d.pop(k, None)
        if "torch_dtype" in d and "dtype" not in d:
            d["dtype"] = d.pop("torch_dtype")
        return cls(**d)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Load our config, or a released Kimi-Linear / K3 ``config.json`` from a local folder (read as released)."""
        path = os.path.join(str(pretrained_model_name_or_path), "config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            if raw.get("model_type") in ("kimi_linear", "kimi_k3"):
                cfg = cls.from_released_dict(raw)
                for k, v in kwargs.items():
                    setattr(cfg, k, v)
                return cfg
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
