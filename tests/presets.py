"""Tiny configs for the tests: every branch of the model in a few layers and small widths, both layer orders
(KDA first / MLA first), and the K3 switches. Tests build them with :func:`preset_config`, which also accepts the
shipped full-size presets (``KimiHybridConfig.from_preset``: "kimi-linear-48b-a3b", "kimi-k3").

Imported as a plain module: pytest puts tests/ on the path (pyproject's ``pythonpath``), so ``kernels/tests`` uses
it too.
"""

from __future__ import annotations

import copy
from typing import Any, Dict

from kimi_hybrid import KimiHybridConfig

LINEAR = "linear_attention"
FULL = "full_attention"


def _tiny(layer_types, mlp_types, **over):
    n = len(layer_types)
    base = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": n,
        "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True, "num_experts": 8,
        "num_experts_per_token": 2, "moe_intermediate_size": 32, "num_shared_experts": 1,
        "first_k_dense_replace": mlp_types.count("dense"), "routed_scaling_factor": 2.446,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 2, "topk_group": 1,
        "moe_renormalize": True, "layer_types": layer_types, "mlp_layer_types": mlp_types,
        "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4},
    }
    base.update(over)
    return base


_TINY_K3 = dict(
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0, q_lora_rank=24,
    mla_use_output_gate=True, routed_expert_hidden_size=48, latent_moe_use_norm=True, num_shared_experts=2,
    routed_scaling_factor=1.0, attn_res_block_size=2, num_expert_group=1,
)

TINY_PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny-kda-first": _tiny([LINEAR, LINEAR, LINEAR, FULL], ["dense", "sparse", "sparse", "sparse"]),
    "tiny-mla-first": _tiny([FULL, LINEAR, LINEAR, FULL], ["dense", "sparse", "dense", "sparse"]),
    "tiny-k3": _tiny(
        [LINEAR, LINEAR, LINEAR, FULL, LINEAR, FULL], ["dense"] + ["sparse"] * 5,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                            "use_full_rank_gate": True},
        **_TINY_K3,
    ),
    "tiny-k3-softplus": _tiny(
        [FULL, LINEAR, LINEAR, FULL], ["dense", "sparse", "sparse", "sparse"],
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "use_full_rank_gate": True},
        **_TINY_K3,
    ),
    # AttnRes block size 4 does not divide the 6 layers (a partial last block); latent MoE without its norm
    "tiny-k3-block4": _tiny(
        [LINEAR, FULL, LINEAR, LINEAR, FULL, FULL], ["dense"] + ["sparse"] * 5,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                            "use_full_rank_gate": True},
        **{**_TINY_K3, "attn_res_block_size": 4, "latent_moe_use_norm": False},
    ),
}


def preset_config(name: str, **overrides) -> KimiHybridConfig:
    """``KimiHybridConfig`` of a tiny test preset (:data:`TINY_PRESETS`) or of a shipped preset, with ``overrides``
    applied on top. Raises KeyError for an unknown name (listing both sets)."""
    if name in TINY_PRESETS:
        kw = copy.deepcopy(TINY_PRESETS[name])
        kw.update(overrides)
        return KimiHybridConfig(**kw)
    try:
        return KimiHybridConfig.from_preset(name, **overrides)
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; tiny test presets: {sorted(TINY_PRESETS)}") from None
