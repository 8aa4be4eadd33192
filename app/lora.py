# coding=utf-8
"""PEFT LoRA for KimiHybrid models (Kimi-Linear-48B-A3B, the Kimi K3 text backbone): the recommended
``LoraConfig``, a target check, and the few helpers a training script needs.

Everything here is plain PEFT / transformers; the model code holds no LoRA logic (training
infrastructure stays out of the model code).

What :func:`recommended_lora_config` targets (PEFT matches ``target_modules`` by name suffix):

====================  ===========================================================================================
group                 modules / parameters
====================  ===========================================================================================
KDA                   ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (``[H*K, D]`` / ``[D, H*K]``)
KDA gates (opt-in)    ``f_a_proj``, ``f_b_proj`` (decay gate), ``b_proj`` (beta), ``g_a_proj``, ``g_b_proj``
                      (output gate) or K3's full-rank ``g_proj`` (the K3 MLA output gate is also named ``g_proj``)
MLA                   ``q_proj`` (Kimi-Linear) or ``q_a_proj`` + ``q_b_proj`` (K3 low-rank query),
                      ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``
MLPs                  dense layers and shared experts: ``gate_proj``, ``up_proj``, ``down_proj``
routed experts        ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`` (the fused 3-D
                      expert weights ``[E, 2F, D]`` / ``[E, D, F]``; PEFT's ``ParamWrapper`` gives each expert its
                      own rank-r pair) and, for K3's latent MoE, ``routed_expert_down_proj`` /
                      ``routed_expert_up_proj``
never                 the depthwise short convs ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, the router ``mlp.gate``,
                      ``embed_tokens``, ``lm_head``, norms, ``A_log`` / ``dt_bias``, AttnRes projections
====================  ===========================================================================================

Why never the depthwise conv. (1) PEFT's ``lora.Conv1d`` needs ``r % groups == 0`` for a grouped conv; the KDA conv
is depthwise (``groups == channels == H*K``, 4096 for 48B-A3B), so no useful rank is accepted, and PEFT cannot merge
a grouped conv. (2) The model never calls the conv modules: KDA reads the three kernels as one fused ``[3P, W]``
tensor (``KimiDeltaAttention.conv_weight``) for the FLA / torch short-conv kernels and the single-token decode
update, so a LoRA wrapper around the module would be bypassed silently. (3) It holds ``3*P*W`` numbers per layer
(49k for 48B-A3B): there is nothing to compress. Fine-tune it, if ever, with ``modules_to_save``-style full
training, not LoRA.

Why the gates are opt-in. The gate projections are small (``f_a/g_a``: ``[K, D]``) and steer the recurrence's
forgetting; adapting them is cheap but changes the memory dynamics of every KDA layer, which is rarely what a
task fine-tune wants. ``include_gates=True`` adds them.

Fast paths with an adapter (checked in ``tests/test_lora.py``):

* MLA latent ("absorbed") decode reads ``kv_b_proj.weight`` directly. ``KimiMLAttention`` takes that path only
  when ``kv_b_proj`` is a plain ``nn.Linear``; a PEFT ``lora.Linear`` wrapper (or a quantised layer) makes it fall
  back to decompressing the latent through the module, so the adapter is always applied. After
  ``merge_and_unload()`` the layer is a plain ``nn.Linear`` again holding the merged weight, and the absorbed path
  uses it.
* Routed experts: the MoE block recognises PEFT's ``ParamWrapper`` on ``gate_up_proj`` / ``down_proj`` and runs the
  adapter as split low-rank products in the expert GEMMs (``x W^T + s (x A^T) B^T``, ``W + B A`` never formed;
  ``kimi_hybrid.lora_experts_kimi_hybrid``); configurations it does not reproduce exactly run PEFT's own forward,
  which reads the weights through PEFT's parametrisation (``W + B A``).
* The KDA conv kernels are read directly too, but they are never LoRA targets (above). Likewise K3's AttnRes
  projections (``self_attention_res_proj``, ``mlp_res_proj``, ``output_attn_res_proj``, ``[1, D]``) are read as
  weights by the depth-softmax, so a LoRA wrapper on them would be bypassed; :func:`check_lora_targets` refuses
  them.

Training notes. ``lora_dropout`` must be 0 when the experts are targeted (a PEFT restriction of
``target_parameters``); use weight decay instead. Gradient checkpointing works with ``use_reentrant=False``
(:func:`enable_gradient_checkpointing`). Packed training: ``transformers.DataCollatorWithFlattening`` concatenates
the examples into one row with ``position_ids`` restarting at 0 and ``-100`` labels at each document start; the
model turns position restarts into document boundaries (KDA conv windows and states restart, MLA attends within the
document), so a packed batch gives the same loss and gradients as the documents one by one
(:func:`packing_collator`).

QLoRA (bitsandbytes 4-bit). Not supported / not tested here, for two reasons. (1) bitsandbytes quantises
``nn.Linear`` layers only; the routed experts of 48B-A3B are fused 3-D ``nn.Parameter`` tensors (47.1 B of the
model's parameters), so they would stay in bf16 and a "4-bit" model would save only a few % of the memory; and
``peft.prepare_model_for_kbit_training`` upcasts every non-quantised bf16 parameter to fp32, doubling the experts.
(2) bitsandbytes is not installed on the GPU machine we can test on and needs a matching CUDA wheel. Correctness
would still hold for attention: a quantised ``kv_b_proj`` is not a plain ``nn.Linear``, so MLA decode falls back to
the module call. A useful QLoRA for this model needs expert-aware quantisation (e.g. 4-bit grouped-GEMM experts),
which is future work.

Multi-GPU. Everything here is GPU-count agnostic: ``from_pretrained(..., device_map="auto")`` splits at decoder
layers (``_no_split_modules = ["KimiDecoderLayer"]``) and accelerate's hooks move the layer inputs and its cache
state to the layer's device; ``examples/train_lora_fsdp.py`` + ``examples/accelerate_fsdp2.yaml`` train LoRA with
FSDP2. See ``docs/serving.md`` for export and serving.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

__all__ = [
    "EXPERT_PARAMETERS",
    "KDA_GATE_MODULES",
    "NEVER_TARGET",
    "lora_targets",
    "recommended_lora_config",
    "check_lora_targets",
    "enable_gradient_checkpointing",
    "packing_collator",
    "merge_and_save",
    "triton_autotune_results",
    "notice_cold_autotune",
]

#: fused routed-expert weights, as PEFT ``target_parameters`` (suffix match on ``<module path>.<parameter>``)
EXPERT_PARAMETERS: Tuple[str, ...] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
#: the KDA gate projections (opt-in). ``g_proj`` is K3's full-rank KDA output gate and also K3's MLA output gate.
KDA_GATE_MODULES: Tuple[str, ...] = ("f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "g_proj")
#: module-name suffixes that must never be wrapped (see the module docstring)
NEVER_TARGET: Tuple[str, ...] = ("q_conv1d", "k_conv1d", "v_conv1d", "gate", "lm_head", "embed_tokens",
                                  "self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj")

_ATTN_SHARED = ("q_proj", "k_proj", "v_proj", "o_proj")  # KDA q/k/v/o; MLA reuses q_proj / o_proj names
_MLA = ("kv_a_proj_with_mqa", "kv_b_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_LATENT_MOE = ("routed_expert_down_proj", "routed_expert_up_proj")


def _cfg(config):
    """Accept a config, a model or a PEFT model."""
    cfg = getattr(config, "config", config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def lora_targets(config, include_gates: bool = False, include_experts: bool = True, include_attention: bool = True,
                 include_mlp: bool = True) -> Tuple[List[str], List[str]]:
    """The ``(target_modules, target_parameters)`` lists of :func:`recommended_lora_config` for ``config``.

    Only names that exist in the model described by ``config`` are listed (e.g. ``q_a_proj`` / ``q_b_proj`` only
    when ``q_lora_rank`` is set, ``k_proj`` / ``v_proj`` only when the model has KDA layers)."""
    cfg = _cfg(config)
    layer_types = list(getattr(cfg, "layer_types", []) or [])
    has_kda = "linear_attention" in layer_types
    has_mla = "full_attention" in layer_types
    mlp_types = list(getattr(cfg, "mlp_layer_types", []) or [])
    has_moe = "sparse" in mlp_types
    has_dense = "dense" in mlp_types
    modules: List[str] = []
    if include_attention:
        if has_kda:
            modules += list(_ATTN_SHARED)
        if has_mla:
            if getattr(cfg, "q_lora_rank", None) is None:
                modules.append("q_proj")
            else:
                modules += ["q_a_proj", "q_b_proj"]
            modules += list(_MLA) + ["o_proj"]
        if include_gates:
            full_rank = bool(getattr(cfg, "use_full_rank_gate", False))
            if has_kda:
                modules += ["f_a_proj", "f_b_proj", "b_proj"] + (["g_proj"] if full_rank else ["g_a_proj", "g_b_proj"])
            if has_mla and getattr(cfg, "mla_use_output_gate", False):
                modules.append("g_proj")
    if include_mlp and (has_dense or (has_moe and getattr(cfg, "num_shared_experts", 0))):
        modules += list(_MLP)
    params: List[str] = []
    if include_experts and has_moe:
        params = list(EXPERT_PARAMETERS)
        if getattr(cfg, "routed_expert_hidden_size", None) is not None:
            modules += list(_LATENT_MOE)
    seen = set()
    modules = [m for m in modules if not (m in seen or seen.add(m))]
    return modules, params


def recommended_lora_config(config, r: int = 16, alpha: int = 32, include_gates: bool = False,
                            include_experts: bool = True, include_attention: bool = True, include_mlp: bool = True,
                            dropout: float = 0.0, task_type: str = "CAUSAL_LM", **lora_kwargs):
    """A ``peft.LoraConfig`` for a KimiHybrid model.

    Args:
        config: a ``KimiHybridConfig`` (or a model holding one).
        r, alpha: LoRA rank and ``lora_alpha`` (scale ``alpha / r``); default 16 / 32.
        include_gates: also adapt the KDA gate projections (``f_a/f_b``, ``b_proj``, ``g_a/g_b`` or K3 ``g_proj``)
            and K3's MLA output gate. Default off.
        include_experts: adapt the routed experts through ``target_parameters`` on the fused ``gate_up_proj`` /
            ``down_proj`` (and K3's latent-MoE projections). Default on. Adds ``2 * E * r * (D + F) + ...`` trainable
            numbers per MoE layer (for 48B-A3B at r=16: 31.5 M per MoE layer).
        include_attention: KDA q/k/v/o and MLA q (or q_a/q_b) / kv_a_proj_with_mqa / kv_b_proj / o_proj. Default on.
        include_mlp: the dense MLP of the first layer(s) and the shared experts. Default on.
        dropout: ``lora_dropout``; must be 0 when ``include_experts`` (PEFT restriction of ``target_parameters``).
        task_type: PEFT task type (``"CAUSAL_LM"``).
        **lora_kwargs: passed to ``LoraConfig`` (e.g. ``use_rslora=True``, ``init_lora_weights="gaussian"``,
            ``modules_to_save``).

    Never targets the depthwise convs, the router, the embeddings or ``lm_head`` (see the module docstring).

    Raises:
        ValueError: ``dropout > 0`` with experts; or nothing left to target.
    """
    from peft import LoraConfig

    modules, params = lora_targets(config, include_gates=include_gates, include_experts=include_experts,
                                   include_attention=include_attention, include_mlp=include_mlp)
    if params and dropout:
        raise ValueError("lora_dropout must be 0 when the routed experts are targeted (PEFT target_parameters does "
                         "not support dropout); pass dropout=0.0 or include_experts=False")
    if not modules and not params:
        raise ValueError("nothing to target: every group is switched off")
    lora_kwargs.setdefault("bias", "none")
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules,
                      target_parameters=params or None, task_type=task_type, **lora_kwargs)


def check_lora_targets(model) -> List[str]:
    """Assert that no LoRA layer wraps a module that must not be adapted; return the names of the adapted modules.

    Raises:
        ValueError: a depthwise conv, the router, ``lm_head`` or the embeddings is wrapped.
    """
    from peft.tuners.lora import LoraLayer

    adapted, bad = [], []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapted.append(name)
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(base, nn.Conv1d) or leaf in NEVER_TARGET:
            bad.append(name)
    if bad:
        raise ValueError(f"LoRA must not wrap {bad}: see kimi_hybrid.app.lora for why")
    return adapted


def enable_gradient_checkpointing(model) -> None:
    """Non-reentrant gradient checkpointing over the decoder layers on every transformers version of our window
    (5.23 renamed it ``activation_checkpointing_enable``; 5.17-5.22 only have ``gradient_checkpointing_enable``).
    Works on a base model or a ``PeftModel``."""
    kwargs = {"use_reentrant": False}
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    target.config.use_cache = False
    notice_cold_autotune(target)


def triton_autotune_results(cache_dir: Optional[str] = None) -> int:
    """The number of Triton autotune results (``*.autotune.json``) in ``cache_dir`` (default ``TRITON_CACHE_DIR``,
    else Triton's ``~/.triton/cache``). FLA's kernels write them there (FLA 0.6 passes ``cache_results=True`` to
    ``triton.autotune``; ``FLA_CACHE_RESULTS=0`` turns it off), so a later process reuses them."""
    root = Path(cache_dir or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in root.rglob("*.autotune.json")) if root.is_dir() else 0


def notice_cold_autotune(model) -> bool:
    """Log once (logging, WARNING) when ``model`` is on CUDA and the Triton cache holds no autotune results: the
    first training step then autotunes FLA's forward and backward kernels, which takes minutes on a fresh machine.
    Returns whether it logged. See docs/lora.md ("Training speed") for restoring shipped results."""
    try:
        on_cuda = next(model.parameters()).is_cuda
    except StopIteration:
        return False
    if not on_cuda or not torch.cuda.is_available() or triton_autotune_results() > 0:
        return False
    logger.warning("kimi_hybrid: no Triton autotune results in the Triton cache (TRITON_CACHE_DIR): the first "
                   "training step autotunes FLA's forward and backward kernels and can take minutes; later steps "
                   "and later runs on this machine reuse the results (docs/lora.md, 'Training speed')")
    return True


def packing_collator():
    """``transformers.DataCollatorWithFlattening``: packs the examples of a batch into one row, ``position_ids``
    restarting at 0 per example and ``-100`` as the label of each example's first token (no cross-document
    prediction). Feed examples with ``input_ids`` (and optionally ``labels``, -100 for masked prompt tokens)."""
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)


def merge_and_save(peft_model, out_dir: str, tokenizer=None, safe_serialization: bool = True,
                   max_shard_size: str = "5GB"):
    """``merge_and_unload()`` the adapter(s) into the base weights and ``save_pretrained`` the plain model (with the
    bundle code and ``auto_map``, so the folder loads with ``trust_remote_code=True`` or with the package installed).
    Returns the merged model."""
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=safe_serialization, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return merged

