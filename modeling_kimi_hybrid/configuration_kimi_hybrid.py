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
from transformers.utils import logging

from .compat_kimi_hybrid import has_expert_dispatch
from .conversion_kimi_hybrid import register_checkpoint_conversion

# transformers' checkpoint-conversion mapping released Kimi-Linear names <-> ours, registered at import in installed
# and remote-code use alike (every model load imports this file first)
register_checkpoint_conversion()

logger = logging.get_logger(__name__)

LINEAR = "linear_attention"
FULL = "full_attention"

# Kimi-Linear-48B-A3B (Base / Instruct) is the config of the class defaults: every default of
# KimiHybridConfig.__init__ is the released value, and the default layer plan (every fourth layer and the last one
# MLA) gives its kda_layers / full_attn_layers.
_KIMI_LINEAR_48B: Dict[str, Any] = {}

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

# -- the released config.json format (Kimi-Linear remote code; K3 text_config; transformers-native kimi_linear) --
# The 43 top-level keys of the released Kimi-Linear-48B-A3B config.json, sorted.
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
# Defaults of the released remote `configuration_kimi.py` for the keys a released config.json may omit.
RELEASED_DEFAULTS = {
    "vocab_size": 163840, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "rms_norm_eps": 1e-6, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "mla_use_nope": False, "num_shared_experts": 0, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
    "moe_layer_freq": 1, "q_lora_rank": None, "num_experts": None, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
    "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "hidden_act": "silu",
}
# K3-only text_config fields (the released Kimi-Linear format cannot express them)
K3_KEYS = ("mla_use_output_gate", "routed_expert_hidden_size", "latent_moe_use_norm", "activation_situ_beta",
           "activation_situ_linear_beta", "attn_res_block_size", "topk_method")
# attribute aliases of transformers' native KimiLinearConfig -> the released names
NATIVE_ALIASES = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
                  "n_shared_experts": "num_shared_experts", "n_group": "num_expert_group",
                  "norm_topk_prob": "moe_renormalize"}
# native-only keys that carry nothing our config needs (derived, unused, or read above)
_NATIVE_ONLY = ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "qk_head_dim", "pretraining_tp",
                "attention_bias", "attention_dropout", "output_router_logits", "max_position_embeddings",
                "num_local_experts", "num_experts_per_tok", "n_shared_experts", "n_group", "norm_topk_prob")
# not model fields: bookkeeping of the released file and of transformers' PretrainedConfig.to_dict()
_NOT_CONFIG = ("architectures", "auto_map", "transformers_version", "quantization_config", "model_type",
               "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
               "is_encoder_decoder", "id2label", "label2id", "problem_type", "_name_or_path", "torchscript",
               "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
               "finetuning_task", "add_cross_attention", "tie_encoder_decoder", "architectures_",
               "_attn_implementation_autoset", "_commit_hash", "cross_attention_hidden_size", "is_decoder",
               "pruned_heads", "tf_legacy_loss", "use_bfloat16")


def _expert_parallel_plan() -> Optional[Dict[str, str]]:
    """The expert-parallel plan (``base_model_ep_plan``) where the installed transformers ships expert dispatch
    (:func:`compat_kimi_hybrid.has_expert_dispatch`): whole experts per rank, ``gate_up_proj [E, 2F, D_e]`` and
    ``down_proj [E, D_e, F]`` sharded on the expert dim (``grouped_gemm``), tokens dispatched through the experts
    module (``ep_dispatch_experts``); :class:`KimiExperts` skips the off-rank routes marked with the id
    ``num_experts``. None (no plan declared) where it has none."""
    if not has_expert_dispatch():
        return None
    return {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm", "layers.*.mlp.experts.down_proj": "grouped_gemm",
            "layers.*.mlp.experts": "ep_dispatch_experts"}


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
    Training: ``output_router_logits`` (return each MoE layer's router logits and the load-balancing loss by
    default) and ``router_aux_loss_coef`` (the loss's weight in the LM loss; 0.001, transformers' MoE default).

    Raises:
        ValueError: naming the field, when the layer lists do not cover every layer exactly once, a head dim does
            not match, or the activation / router function is unknown.
    """

    model_type = "kimi_hybrid"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # Tensor parallelism (transformers' ``DistributedConfig(tp_size=N)``), over the module names of
    # modeling_kimi_hybrid.py: the MLPs only, as transformers' own kimi_linear / deepseek_v3 plans do (the KDA and MLA
    # layers stay replicated: correct, not split). Routed experts ``gate_up_proj [E, 2F, D_e]`` (gate rows | up rows)
    # split their F on both halves at once (``packed_colwise``), ``down_proj [E, D_e, F]`` splits F (``rowwise``), and
    # the experts module sums the ranks' partial outputs (``moe_tp_experts``); the dense MLP of the first layers and
    # the shared experts are plain column / row splits. transformers adds ``embed_tokens: embedding_rowwise``; the
    # LM head's entry is ``KimiHybridForCausalLM._tp_plan``. Routers, norms, K3's latent projections and AttnRes stay
    # replicated.
    base_model_tp_plan = {
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    # Expert parallelism (``DistributedConfig(ep_size=N)``): whole experts per rank; see _expert_parallel_plan.
    base_model_ep_plan = _expert_parallel_plan()
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
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
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
        if isinstance(router_aux_loss_coef, bool) or not isinstance(router_aux_loss_coef, (int, float)) \
                or router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be a number >= 0, got {router_aux_loss_coef!r}")
        self.output_router_logits = bool(output_router_logits)
        self.router_aux_loss_coef = float(router_aux_loss_coef)

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
    def is_k3(self) -> bool:
        """Whether this is the Kimi K3 architecture (any K3-only switch on: full-rank KDA output gates, the
        lower-bounded KDA gate, the MLA output gate, latent MoE, SiTU-GLU or AttnRes). K3's checkpoints keep the
        KDA conv kernels and ``o_norm`` in fp32, so the model keeps them in fp32 too."""
        return bool(self.use_full_rank_gate or self.gate_lower_bound is not None or self.mla_use_output_gate
                    or self.routed_expert_hidden_size is not None or self.hidden_act == "situ"
                    or self.attn_res_block_size > 0)

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
        """The one reader of released config.json files: Kimi-Linear (``model_type`` "kimi_linear", remote code),
        transformers-native ``kimi_linear`` (``KimiLinearConfig.save_pretrained``: ``layer_types``,
        ``linear_head_dim``, ``num_local_experts``, ...) and Kimi K3 (a top-level config whose ``text_config`` is
        read). Keys the file omits take the released remote code's defaults (``RELEASED_DEFAULTS``); the native
        model's ``mlp_layer_types`` is kept as it decides dense vs MoE there.

        Raises:
            ValueError: the config's own checks (naming the field), or a native config without a layer plan.
        """
        d = copy.deepcopy(d)
        if d.get("model_type") == "kimi_k3" or "text_config" in d:
            d = copy.deepcopy(d["text_config"])
        if "layer_types" in d or "linear_head_dim" in d:
            d = _native_to_released(d)
        for k, v in RELEASED_DEFAULTS.items():
            d.setdefault(k, v)
        for k in _NOT_CONFIG:
            d.pop(k, None)
        if "torch_dtype" in d:
            dtype = d.pop("torch_dtype")
            d.setdefault("dtype", dtype)
        return cls(**d)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Load our config, or a released Kimi-Linear / K3 ``config.json`` from a local folder (read as released by
        :meth:`from_released_dict`; other keyword arguments as ``PretrainedConfig.from_pretrained``)."""
        path = os.path.join(str(pretrained_model_name_or_path), "config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            if raw.get("model_type") in ("kimi_linear", "kimi_k3"):
                logger.info(
                    f"{pretrained_model_name_or_path} holds a released {raw['model_type']!r} config.json: read as "
                    "KimiHybridConfig (KimiHybridForCausalLM loads released Kimi-Linear weights through the "
                    "registered checkpoint-conversion mapping; K3, quantized and transformers-native folders need "
                    "kimi-hybrid-convert SRC OUT first)")
                # transformers' own handling of the remaining kwargs (hub options dropped, config attributes set,
                # return_unused_kwargs honoured, as from_pretrained of a model passes it)
                _, kwargs = cls.get_config_dict(pretrained_model_name_or_path, **kwargs)
                return cls.from_dict(cls.from_released_dict(raw).to_dict(), **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    def to_released_dict(self, template: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """The one writer of released config.json files: the 43 keys of the released Kimi-Linear file (sorted,
        ``model_type`` "kimi_linear", 1-based ``linear_attn_config`` lists, ``model_max_length``, ``dtype``), plus
        the K3 fields (``K3_KEYS``, the KDA gate switches in ``linear_attn_config``) when this is a K3 config
        (:attr:`is_k3`), which is then the K3 ``text_config``.

        ``template`` (e.g. the released file the checkpoint came from) supplies ``architectures``, ``auto_map``,
        ``transformers_version`` and ``dtype`` when given.
        """
        t = template or {}
        d = self.to_dict()
        lac = {k: v for k, v in self.linear_attn_config.items()
               if self.is_k3 or k not in ("gate_lower_bound", "use_full_rank_gate")}
        dtype = str(getattr(self, "dtype", None) or t.get("dtype") or "bfloat16").replace("torch.", "")
        special = {
            "architectures": t.get("architectures", ["KimiLinearForCausalLM"]),
            "auto_map": t.get("auto_map", dict(RELEASED_AUTO_MAP)),
            "dtype": dtype,
            "linear_attn_config": {k: lac[k] for k in sorted(lac)},
            "model_max_length": self.max_position_embeddings,
            "model_type": "kimi_linear",
            "rope_scaling": self.released_rope_scaling,
            "rope_theta": self.released_rope_theta,
            "transformers_version": t.get("transformers_version", "4.57.0"),
        }
        out = {k: special[k] if k in special else d.get(k, t.get(k)) for k in RELEASED_KEYS}
        if self.is_k3:
            out.update({k: d.get(k) for k in K3_KEYS})
        return out


def _native_to_released(src: Dict[str, Any]) -> Dict[str, Any]:
    """transformers-native ``kimi_linear`` config dict -> the released field names (1-based layer lists in
    ``linear_attn_config``, released MoE names, ``model_max_length``); its ``mlp_layer_types`` is kept."""
    lac = dict(src.get("linear_attn_config") or {})
    lt = src.get("layer_types")
    if lt:
        lac["kda_layers"] = [i + 1 for i, t in enumerate(lt) if t == LINEAR]
        lac["full_attn_layers"] = [i + 1 for i, t in enumerate(lt) if t == FULL]
    elif not lac.get("kda_layers"):
        raise ValueError("native kimi_linear config has neither layer_types nor linear_attn_config lists")
    lac.setdefault("head_dim", src.get("linear_head_dim", 128))
    lac.setdefault("num_heads", src.get("linear_num_heads", 32))
    lac.setdefault("short_conv_kernel_size", src.get("linear_conv_kernel_dim", 4))
    out = {k: v for k, v in src.items() if k not in _NATIVE_ONLY and k != "layer_types"}
    for alias, name in NATIVE_ALIASES.items():
        if alias in src and name not in src:
            out[name] = src[alias]
    out["linear_attn_config"] = lac
    # the native MLA never rotates (NoPE) and always routes with sigmoid scores
    out.setdefault("mla_use_nope", True)
    out.setdefault("moe_router_activation_func", "sigmoid")
    if "max_position_embeddings" in src and "model_max_length" not in src:
        out["model_max_length"] = src["max_position_embeddings"]
    return out
