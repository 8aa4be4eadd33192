# coding=utf-8
"""transformers' checkpoint-conversion mapping between the released Kimi-Linear tensor names and ours.

Registered with ``transformers.conversion_mapping.register_checkpoint_conversion_mapping`` for ``model_type
"kimi_hybrid"`` by :func:`register_checkpoint_conversion`, which ``configuration_kimi_hybrid.py`` calls at import (so
the installed package and the Hub files loaded with ``trust_remote_code=True`` both register it; transformers only
applies a mapping to custom code that registered one). With it, transformers' own loading machinery

* loads a released Kimi-Linear folder (``moonshotai/Kimi-Linear-48B-A3B-*``: ``block_sparse_moe.``, per-expert
  ``experts.{e}.w1/w2/w3.weight``, ``A_log [1, 1, H, 1]``; docs/checkpoint-format.md) straight into
  ``KimiHybridForCausalLM``, every tensor moved without a change of value (renames, stacking, a reshape);
* loads our own layout (docs/LAYOUT.md: ``mlp.``, fused ``experts.gate_up_proj`` / ``down_proj``, ``A_log [H]``)
  unchanged: no pattern but the ``A_log`` reshape matches it, and that reshape leaves ``[H]`` as it is;
* writes the released names on ``save_pretrained`` (transformers' default ``save_original_format=True``);
  ``save_pretrained(..., save_original_format=False)`` writes our layout.

The mapping (docs/LAYOUT.md, "Mapping to the released Kimi-Linear layout"):

* ``block_sparse_moe.{gate., shared_experts., experts., routed_expert_}`` <-> ``mlp.{...}``: only the MoE sub-modules
  are renamed, so the dense layers' ``mlp.gate_proj / up_proj / down_proj`` keep their name both ways (transformers'
  native ``kimi_linear`` mapping renames every ``.mlp.`` back to ``.block_sparse_moe.`` on save, dense ones included);
* ``experts.{e}.w1.weight`` / ``w3.weight`` ``[F, D]`` <-> ``experts.gate_up_proj [E, 2F, D]`` (w1 rows first),
  ``experts.{e}.w2.weight [D, F]`` <-> ``experts.down_proj [E, D, F]`` (transformers' ``MergeModulelist`` /
  ``Concatenate`` and their reverse ops);
* ``self_attn.A_log [1, 1, H, 1]`` <-> ``[H]`` (:class:`KimiALogReshape`, a reshape of the same values).

What the mapping cannot load is refused before any weight is read (:func:`refuse_unmapped_folder`), with the
``kimi-hybrid-convert`` command that converts it: Kimi K3 folders (``language_model.`` prefix, MXFP4 experts,
``A_log`` zero-padded to 128), any quantized folder (``quantization_config``), and transformers-native
``kimi_linear`` folders (their ``save_pretrained`` writes the dense layer's MLP as ``block_sparse_moe.gate_proj``,
which a mapping that keeps released folders exact cannot also read).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import torch
from transformers.core_model_loading import (
    ConversionOps,
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
)

from .compat_kimi_hybrid import PATTERN_GROUP_DOT

MODEL_TYPE = "kimi_hybrid"
# model_type values of config.json files written by others (released remote code, transformers-native, K3)
RELEASED_MODEL_TYPES = ("kimi_linear", "kimi_k3")

# The released <-> ours name table, the one both transformers' mapping below and the streaming converter
# (``kimi_hybrid.conversion``) are built from. Every tensor not named here keeps its name and shape.
RELEASED_MOE_MODULE, OUR_MOE_MODULE = "block_sparse_moe", "mlp"  # a sparse layer's MoE block
MOE_SUBMODULES = ("gate.", "shared_experts.", "experts.", "routed_expert_")  # renamed with it (dense MLPs are not)
RELEASED_EXPERT_GATE_UP = ("w1", "w3")  # per expert [F, D] each, stacked in this order into gate_up_proj [E, 2F, D]
RELEASED_EXPERT_DOWN = "w2"  # per expert [D, F], stacked into down_proj [E, D, F]


def released_key(key: str) -> str:
    """The released name of our tensor ``key`` (the MoE sub-modules move from ``mlp.`` to ``block_sparse_moe.``).
    The fused experts are stored per expert there instead: :func:`released_expert_key`."""
    head, sep, tail = key.partition(f".{OUR_MOE_MODULE}.")
    if sep and tail.startswith(MOE_SUBMODULES):
        return f"{head}.{RELEASED_MOE_MODULE}.{tail}"
    return key


def released_expert_key(layer_prefix: str, expert: int, weight: str) -> str:
    """Released name of one expert's ``weight`` (``w1`` / ``w2`` / ``w3``) in the layer ``layer_prefix``
    (``"model.layers.{i}."``)."""
    return f"{layer_prefix}{RELEASED_MOE_MODULE}.experts.{expert}.{weight}.weight"


def released_a_log_shape(num_heads: int) -> tuple:
    """The released shape of ``self_attn.A_log`` (ours: ``[num_heads]``, the same values)."""
    return (1, 1, num_heads, 1)


class KimiALogReshape(ConversionOps):
    """``self_attn.A_log``: the released ``[1, 1, H, 1]`` <-> our ``[H]``, the same values in the same order.

    Loading (``to_released=False``) flattens a ``[1, 1, H, 1]`` tensor to ``[H]``; a tensor already ``[H]`` (our own
    layout) passes as it is, and any other shape passes unchanged too, so that transformers reports the shape
    mismatch instead of a reshape hiding it. Saving (``to_released=True``) turns ``[H]`` into ``[1, 1, H, 1]``.
    """

    def __init__(self, to_released: bool = False):
        self.to_released = to_released

    def __repr__(self):
        return f"{self.__class__.__name__}(to_released={self.to_released})"

    @torch.no_grad()
    def convert(self, input_dict: Dict[str, Any], source_patterns: List[str], target_patterns: List[str],
                **kwargs) -> Dict[str, torch.Tensor]:
        """``input_dict``: ``{source pattern: [tensor]}`` (one ``A_log``); returns ``{target pattern: tensor}``."""
        (tensors,) = input_dict.values()
        t = tensors[0] if isinstance(tensors, list) else tensors
        if self.to_released and t.dim() == 1:
            t = t.reshape(1, 1, -1, 1)
        elif not self.to_released and t.dim() == 4 and t.shape[0] == t.shape[1] == t.shape[3] == 1:
            t = t.reshape(-1)
        return {target_patterns[0]: t}

    @property
    def reverse_op(self) -> ConversionOps:
        """The opposite reshape (used by ``save_pretrained``)."""
        return KimiALogReshape(to_released=not self.to_released)


def checkpoint_conversion_mapping() -> list:
    """A new list of the transforms from the released Kimi-Linear names to ours (transformers reverses them to save).

    transformers runs the renamings first on a checkpoint key, then at most one converter (in reverse on save: the
    converter, then the renamings); the expert patterns hold no ``mlp.`` / ``block_sparse_moe.`` so that they match
    the key in either naming.
    """
    moe_group = "|".join(s.replace(".", PATTERN_GROUP_DOT) for s in MOE_SUBMODULES)
    return [
        # the MoE sub-modules of sparse layers (and K3's latent-MoE projections); dense `mlp.gate_proj` never matches
        WeightRenaming(source_patterns=rf"\.{RELEASED_MOE_MODULE}\.({moe_group})",
                       target_patterns=rf".{OUR_MOE_MODULE}.\1"),
        # w1 (gate) then w3 (up) of every expert -> experts.gate_up_proj [E, 2F, D]
        WeightConverter(source_patterns=[rf"\.experts.*.{w}.weight" for w in RELEASED_EXPERT_GATE_UP],
                        target_patterns=r"\.experts.gate_up_proj",
                        operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
        # w2 (down) of every expert -> experts.down_proj [E, D, F]
        WeightConverter(source_patterns=rf"\.experts.*.{RELEASED_EXPERT_DOWN}.weight",
                        target_patterns=r"\.experts.down_proj", operations=[MergeModulelist(dim=0)]),
        # A_log [1, 1, H, 1] -> [H]
        WeightConverter(source_patterns=r"self_attn.A_log", target_patterns=r"self_attn.A_log",
                        operations=[KimiALogReshape()]),
    ]


def register_checkpoint_conversion() -> None:
    """Register :func:`checkpoint_conversion_mapping` for ``model_type "kimi_hybrid"`` with transformers (idempotent;
    a later import, e.g. the Hub files next to the installed package, replaces it with an equal mapping)."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    register_checkpoint_conversion_mapping(MODEL_TYPE, checkpoint_conversion_mapping(), overwrite=True)


def checkpoint_format(config: Dict[str, Any]) -> str:
    """Which checkpoint a ``config.json`` (as a dict) belongs to: ``"ours"`` (``model_type "kimi_hybrid"``),
    ``"k3"`` (``kimi_k3``, a ``text_config``, or K3-only fields), ``"native"`` (transformers-native ``kimi_linear``:
    ``layer_types`` / ``linear_head_dim``) or ``"released"`` (Kimi-Linear remote code). Raises ValueError for another
    ``model_type``."""
    mt = config.get("model_type")
    if mt == "kimi_k3" or "text_config" in config:
        return "k3"
    if mt == MODEL_TYPE:
        return "ours"
    if mt == "kimi_linear":
        lac = config.get("linear_attn_config") or {}
        if "gate_lower_bound" in lac or "use_full_rank_gate" in lac or config.get("attn_res_block_size"):
            return "k3"
        if "layer_types" in config or "linear_head_dim" in config:
            return "native"
        return "released"
    raise ValueError(f"unknown model_type {mt!r} (expected kimi_linear, kimi_k3 or kimi_hybrid)")


def unmapped_reason(config: Dict[str, Any]) -> Optional[str]:
    """Why transformers' loading cannot read the checkpoint of this ``config.json`` through the registered mapping,
    or None when it can (our layout in either naming, or a released Kimi-Linear folder)."""
    try:
        fmt = checkpoint_format(config)
    except ValueError:
        return None  # not a Kimi config: transformers and the strict key check report it
    if fmt == "ours":
        return None
    if fmt == "k3":
        return ("a Kimi K3 checkpoint ('language_model.' prefix, MXFP4-quantized experts, A_log padded to 128 heads), "
                "which needs dequantizing")
    if config.get("quantization_config"):
        return "a quantized checkpoint (quantization_config), whose weights need dequantizing"
    if fmt == "native":
        return ("a transformers-native 'kimi_linear' checkpoint, whose dense MLP is saved under 'block_sparse_moe.' "
                "like the experts")
    return None


def refuse_unmapped_folder(source, subfolder: str, cls_name: str) -> None:
    """Raise ValueError, before any weight is read, when ``source`` is a local folder whose ``config.json`` says its
    weights are in a layout the registered mapping does not read (:func:`unmapped_reason`), with the command that
    converts it. Released Kimi-Linear folders and ours pass. Reads config.json only."""
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        return
    path = os.path.join(source, subfolder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # no readable config here: transformers reports that itself
    if not isinstance(config, dict):
        return
    why = unmapped_reason(config)
    if why is None:
        return
    src = os.path.join(str(source), subfolder) if subfolder else str(source)
    out = src.rstrip("/\\") + "-kimi-hybrid"
    raise ValueError(
        f"{src!r} holds a {config.get('model_type')!r} checkpoint that {cls_name} cannot load directly: {why}; no "
        f"weight was loaded. Convert it once (streaming, verified) and load the output folder:\n"
        f"    kimi-hybrid-convert {src} {out}")


__all__ = ["KimiALogReshape", "MODEL_TYPE", "MOE_SUBMODULES", "OUR_MOE_MODULE", "RELEASED_EXPERT_DOWN",
           "RELEASED_EXPERT_GATE_UP", "RELEASED_MODEL_TYPES", "RELEASED_MOE_MODULE", "checkpoint_conversion_mapping",
           "checkpoint_format", "refuse_unmapped_folder", "register_checkpoint_conversion", "released_a_log_shape",
           "released_expert_key", "released_key", "unmapped_reason"]
