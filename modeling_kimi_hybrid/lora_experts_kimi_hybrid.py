# coding=utf-8
"""LoRA on the routed experts as split low-rank products: find PEFT's ``target_parameters`` adapters on the fused
expert weights so the grouped expert path computes ``x W_e^T + s (x A_e^T) B_e^T`` instead of PEFT's forward,
which forms ``W + s B A`` for the whole expert stack on every forward and every checkpoint recompute.

PEFT creates, saves, loads and merges the adapter as it always does; only the forward's arithmetic changes. The
wrappers are recognised through PEFT's public attributes (``base_layer``, ``parameter_name``, ``lora_A``,
``lora_B``, ``active_adapters``, ``merged``, ``disable_adapters``, ``lora_dropout``, ``get_delta_factors``), so
peft is never imported here. Anything this path does not reproduce exactly (dropout, DoRA, a LoRA bias, a merged
adapter that PEFT would unmerge, factor shapes other than ``[E, out, r] x [E, r, in]``) leaves PEFT's forward in
charge.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

__all__ = ["expert_adapters"]

_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _is_param_wrapper(m: nn.Module) -> bool:
    """PEFT's ``ParamWrapper`` (a LoRA on one parameter of ``base_layer``), by its public attributes."""
    return all(hasattr(m, a) for a in ("base_layer", "parameter_name", "lora_A", "lora_B", "active_adapters",
                                       "merged", "disable_adapters", "get_delta_factors"))


def _terms_of(wrapper: nn.Module, param: torch.Tensor) -> Optional[list]:
    """The split terms ``[(a [E, r, in], b [E, out, r], scaling)]`` of ``wrapper``'s active adapters on ``param
    [E, out, in]``, or None where PEFT's forward must run."""
    if wrapper.merged:  # merged adapters live in the weight; PEFT's forward then adds nothing either
        return None if wrapper.disable_adapters else []
    if wrapper.disable_adapters:
        return []
    terms = []
    for name in wrapper.active_adapters:
        if name not in wrapper.lora_A:
            continue
        if not isinstance(wrapper.lora_dropout[name], nn.Identity) or wrapper.lora_B[name].bias is not None:
            return None
        if getattr(wrapper, "use_dora", {}).get(name, False):
            return None
        lhs, rhs, scaling = wrapper.get_delta_factors(name)  # delta = scaling * lhs @ rhs, shaped like param
        E, out_f, in_f = param.shape
        if lhs.shape[0] != E or lhs.shape[1] != out_f or rhs.shape[0] != E or rhs.shape[2] != in_f:
            return None
        # contiguous: the grouped GEMM needs a unit inner stride (PEFT's B view is strided by E); small copies
        terms.append((rhs.contiguous(), lhs.contiguous(), float(scaling)))
    return terms


def expert_adapters(module: nn.Module, experts_cls: type) -> Optional[Tuple[nn.Module, Tuple[tuple, tuple]]]:
    """``(experts, (gate_up_terms, down_terms))`` for ``module``: an ``experts_cls`` instance (no terms) or a chain
    of PEFT ``ParamWrapper``s around one, each term ``(a [E, r, in], b [E, out, r], scaling)`` meaning
    ``W_e + scaling * b_e a_e`` for the wrapped weight. None where PEFT's own forward must run (a wrapper this path
    does not reproduce exactly, or something other than a ``ParamWrapper`` chain)."""
    terms = {name: [] for name in _EXPERT_WEIGHTS}
    m = module
    while not isinstance(m, experts_cls):
        if not _is_param_wrapper(m) or m.parameter_name not in terms:
            return None
        base = m.base_layer
        while not isinstance(base, experts_cls):  # the wrapped parameter lives on the innermost module
            if not _is_param_wrapper(base):
                return None
            base = base.base_layer
        param = getattr(base, m.parameter_name)
        if param.dim() != 3 or not param.dtype.is_floating_point or param.dtype.itemsize < 2:
            return None  # fp8 weights: PEFT adds the delta in a wider dtype
        found = _terms_of(m, param)
        if found is None:
            return None
        terms[m.parameter_name] += found
        m = m.base_layer
    return m, (tuple(terms["gate_up_proj"]), tuple(terms["down_proj"]))
