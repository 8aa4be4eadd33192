"""transformers-native ``kimi_linear`` state dict -> ours (in memory).

Native layout (transformers >= 5.17, ``models/kimi_linear``): ``self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias,
A_log [1,1,H,1]}``, one fused conv ``self_attn.conv1d.weight [3P, 1, W]`` (q | k | v), MoE under ``mlp.`` with
fused ``experts.gate_up_proj [E, 2F, D]`` / ``experts.down_proj [E, D, F]`` and ``gate.weight`` /
``gate.e_score_correction_bias``. Ours: docs/LAYOUT.md. Every tensor is moved, never altered (A_log is reshaped
to ``[H]``, the conv is split into three ``[P, 1, W]`` views of the same values).
"""

from __future__ import annotations

import re
from typing import Dict

import torch

_FORGET = re.compile(r"^(model\.layers\.\d+\.self_attn\.)forget_gate\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$")
_CONV = re.compile(r"^(model\.layers\.\d+\.self_attn\.)conv1d\.weight$")


def native_state_dict_views(sd: Dict[str, torch.Tensor], config=None) -> Dict[str, torch.Tensor]:
    """Map a ``KimiLinearForCausalLM.state_dict()`` to our key names and shapes, as views of the native tensors.

    With a ``config`` (the native ``KimiLinearConfig`` or its dict) this is the strict, plan-based converter of
    ``conversion.state_dict.native_state_dict_to_ours`` (refuses unknown / missing keys and wrong shapes,
    A_log / dt_bias / e_score_correction_bias made fp32). Without one, the permissive rename below is used.

    Args:
        sd: native state dict (tensors on any device / dtype; values are not changed).
        config: the native ``KimiLinearConfig`` (or its dict): use the strict converter. Without it the tensors are
            mapped as views of the native ones (no copy, no dtype change), which the benchmarks use to run both
            models on one set of weights without doubling GPU memory.

    Returns:
        A new dict with our keys. Raises ValueError naming any key it does not understand or a fused conv whose
        channel count is not divisible by 3.
    """
    if config is not None:
        from .state_dict import native_state_dict_to_ours as strict

        return strict(sd, config)
    out: Dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        m = _FORGET.match(key)
        if m:
            name = m.group(2)
            out[m.group(1) + name] = t.reshape(-1) if name == "A_log" else t
            continue
        m = _CONV.match(key)
        if m:
            if t.shape[0] % 3:
                raise ValueError(f"{key}: fused conv has {t.shape[0]} channels, not divisible by 3 (q|k|v)")
            q, k, v = t.chunk(3, dim=0)
            out[m.group(1) + "q_conv1d.weight"] = q
            out[m.group(1) + "k_conv1d.weight"] = k
            out[m.group(1) + "v_conv1d.weight"] = v
            continue
        out[key] = t
    return out
