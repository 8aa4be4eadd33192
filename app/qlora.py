"""QLoRA on KimiHybrid: PEFT LoRA over an FP8 base (``kimi_hybrid.quantization_kimi_hybrid``).

Recipe::

    model = KimiHybridForCausalLM.from_pretrained(path, dtype=torch.bfloat16)   # or built layer by layer
    quantize_model_fp8_(model)                       # linears + routed experts -> FP8 block-scaled, frozen
    peft_model = get_peft_model(model, qlora_config(model.config, r=16))
    ...train (gradient checkpointing, Trainer)...
    merged = merge_into_bf16(peft_model)            # dequantize to a bf16 copy, then PEFT's merge_and_unload

The attention / shared-expert / dense linears get PEFT's own ``Linear`` LoRA on :class:`KimiFP8Linear`. The routed
experts cannot use PEFT's ``target_parameters`` over FP8 weights (PEFT would add ``B A`` to the float8 tensor and
cast the adapters to float8), so :class:`KimiFP8ExpertsLora` is registered as a PEFT custom module: per-expert
factors applied as split low-rank products inside :meth:`KimiFP8Experts.forward`; PEFT creates, saves, loads and
merges them.
"""

from __future__ import annotations

import math
from typing import List

import torch
import torch.nn as nn
from peft.tuners.lora import LoraLayer

from ..moe_kimi_hybrid import KimiExperts
from ..quantization_kimi_hybrid import KimiFP8Experts, dequantize_model_
from .lora import recommended_lora_config

__all__ = ["KimiFP8ExpertsLora", "qlora_config", "merge_into_bf16", "EXPERT_MODULES"]

#: the routed-expert modules, as PEFT ``target_modules`` (suffix match)
EXPERT_MODULES = ("mlp.experts",)
_FACTORS = ("lora_gate_up_A", "lora_gate_up_B", "lora_down_A", "lora_down_B")


class KimiFP8ExpertsLora(nn.Module, LoraLayer):
    """PEFT LoRA layer for :class:`KimiFP8Experts` (and, after :func:`dequantize_model_`, ``KimiExperts``).

    Per adapter: ``lora_gate_up_A [E, r, D]``, ``lora_gate_up_B [E, 2F, r]``, ``lora_down_A [E, r, F]``,
    ``lora_down_B [E, D, r]`` in fp32 (cast to the activation dtype per product); expert e's weights become ``W_e + scaling * B_e A_e``
    (``scaling = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA). ``init_lora_weights=True``: A Kaiming-uniform,
    B zero (the adapter starts as the identity); ``False``: both random (tests).
    """

    adapter_layer_names = _FACTORS
    other_param_names = ("r", "lora_alpha", "scaling")

    def __init__(self, base_layer, adapter_name: str, config=None, r: int = 8, lora_alpha: int = 8, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        for name in _FACTORS:
            setattr(self, name, nn.ParameterDict())
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config=None, **kwargs) -> None:
        if r <= 0:
            raise ValueError(f"`r` should be a positive integer value but the value passed is {r}")
        dropout = getattr(config, "lora_dropout", kwargs.get("lora_dropout", 0.0))
        if dropout:
            raise ValueError("lora_dropout must be 0 for the routed experts (split low-rank products)")
        base = self.get_base_layer()
        E, F2, D = base.gate_up_proj.shape
        F_ = base.down_proj.shape[-1]
        dtype = torch.float32  # as PEFT's autocast_adapter_dtype keeps half-precision models' adapters
        dev = base.gate_up_proj.device
        shapes = {"lora_gate_up_A": (E, r, D), "lora_gate_up_B": (E, F2, r), "lora_down_A": (E, r, F_),
                  "lora_down_B": (E, D, r)}
        init = getattr(config, "init_lora_weights", kwargs.get("init_lora_weights", True))
        for name, shape in shapes.items():
            t = torch.empty(shape, dtype=torch.float32)
            if name.endswith("_A") or init is False:
                nn.init.kaiming_uniform_(t.view(-1, shape[-1]), a=math.sqrt(5))
            else:
                nn.init.zeros_(t)
            getattr(self, name)[adapter_name] = nn.Parameter(t.to(device=dev, dtype=dtype))
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        rs = getattr(config, "use_rslora", kwargs.get("use_rslora", False))
        self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if rs else r)
        self.set_adapter(self.active_adapters)

    def _factors(self, name: str):
        return tuple(getattr(self, f)[name] for f in _FACTORS) + (self.scaling[name],)

    def get_delta_weight(self, adapter_name: str):
        """``(delta_gate_up [E, 2F, D], delta_down [E, D, F])``: ``scaling * B_e A_e`` per expert."""
        a_gu, b_gu, a_d, b_d, s = self._factors(adapter_name)
        return torch.bmm(b_gu, a_gu) * s, torch.bmm(b_d, a_d) * s

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        base = self.get_base_layer()
        if isinstance(base, KimiFP8Experts):
            raise ValueError("cannot merge LoRA into FP8 experts: the merged weights need a bf16 copy. Call "
                             "kimi_hybrid.app.qlora.merge_into_bf16(peft_model) (dequantizes, then merges)")
        names = adapter_names if adapter_names is not None else [a for a in self.active_adapters if a in self.r]
        for name in names:
            d_gu, d_d = self.get_delta_weight(name)
            new_gu = base.gate_up_proj.data + d_gu.to(base.gate_up_proj.dtype)
            new_d = base.down_proj.data + d_d.to(base.down_proj.dtype)
            if safe_merge and not (torch.isfinite(new_gu).all() and torch.isfinite(new_d).all()):
                raise ValueError(f"NaNs detected in the merged weights; the adapter {name} seems to be broken")
            base.gate_up_proj.data, base.down_proj.data = new_gu, new_d
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        base = self.get_base_layer()
        while self.merged_adapters:
            d_gu, d_d = self.get_delta_weight(self.merged_adapters.pop())
            base.gate_up_proj.data -= d_gu.to(base.gate_up_proj.dtype)
            base.down_proj.data -= d_d.to(base.down_proj.dtype)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, *args, **kwargs):
        base = self.get_base_layer()
        if self.disable_adapters and self.merged:
            self.unmerge()
        active: List[str] = [] if self.disable_adapters or self.merged else [
            a for a in self.active_adapters if a in self.r]
        if not active:
            return base(x, topk_idx, topk_w, *args, **kwargs)
        factors = [self._factors(a) for a in active]
        if isinstance(base, KimiFP8Experts):
            return base(x, topk_idx, topk_w, adapters=factors)
        return _dense_experts_with_adapters(base, x, topk_idx, topk_w, factors)


def _dense_experts_with_adapters(base: KimiExperts, x, topk_idx, topk_w, factors):
    """The bf16 ``KimiExperts`` with the adapters folded into a temporary copy of its weights (after
    :func:`dequantize_model_`, unmerged): the reference that merging must reproduce."""
    from ..moe_kimi_hybrid import grouped_experts_forward

    gu, dn = base.gate_up_proj, base.down_proj
    for a_gu, b_gu, a_d, b_d, s in factors:
        gu = gu + s * torch.bmm(b_gu, a_gu).to(gu.dtype)
        dn = dn + s * torch.bmm(b_d, a_d).to(dn.dtype)
    tmp = _ExpertsView(base, gu, dn)
    return grouped_experts_forward(tmp, x, topk_idx, topk_w)


class _ExpertsView:
    """What ``grouped_experts_forward`` reads from an experts module, with substituted weights."""

    def __init__(self, base, gate_up, down):
        self.config, self.num_experts = base.config, base.num_experts
        self.gate_up_proj, self.down_proj = gate_up, down
        self.local_routes = base.local_routes


def qlora_config(config, r: int = 16, alpha: int = 32, include_experts: bool = True, **kwargs):
    """:func:`recommended_lora_config` for an FP8 base: the same linear targets, and the routed experts as the
    custom module :class:`KimiFP8ExpertsLora` (``target_modules`` gains ``mlp.experts``; no ``target_parameters``).
    Pass the returned config to ``get_peft_model`` and to ``PeftModel.from_pretrained(..., config=...)``."""
    cfg = recommended_lora_config(config, r=r, alpha=alpha, include_experts=False, **kwargs)
    has_moe = "sparse" in list(getattr(getattr(config, "config", config), "mlp_layer_types", []) or [])
    if include_experts and has_moe:
        cfg.target_modules = set(cfg.target_modules) | set(EXPERT_MODULES)
        cfg._register_custom_module({KimiFP8Experts: KimiFP8ExpertsLora, KimiExperts: KimiFP8ExpertsLora})
    return cfg


def merge_into_bf16(peft_model):
    """Dequantize the FP8 base of ``peft_model`` to its compute dtype (a bf16 copy; FP8 storage released) and
    merge every adapter with PEFT's ``merge_and_unload``. Returns the plain merged model."""
    dequantize_model_(peft_model.get_base_model())
    return peft_model.merge_and_unload()
