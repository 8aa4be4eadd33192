"""In-memory conversions (state dict -> state dict) with the same plans and checks as the streaming converter.

Used by tests and by code that already holds a model, e.g. `native_state_dict_to_ours(KimiLinearForCausalLM
.state_dict(), config)`. Byte copies are exact; every op is the one the streaming converter runs.
"""

from __future__ import annotations

import torch

from . import config_io
from .binding import bind, check_coverage, piece_values
from .layouts import detect_variant, plan_for
from .safetensors_io import DTYPES, TORCH_TO_ST, numel


def _config_dict(config) -> dict:
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a dict or a PretrainedConfig, got {type(config)}")


def convert_state_dict(sd: dict[str, torch.Tensor], config, src_format: str, dst_format: str | None = None,
                       dequant_dtype: str = "BF16", dtype_overrides: dict[str, str] | None = None
                       ) -> dict[str, torch.Tensor]:
    """Convert a state dict between layouts ("released", "native", "k3" -> "ours"; "ours" -> "released").

    `config` is the SOURCE config (dict or PretrainedConfig) in the source's own format.
    Raises CheckpointError for unknown / missing keys, wrong shapes or dtypes (all listed).
    """
    cfg = _config_dict(config)
    if dst_format is None:
        dst_format = "released" if src_format == "ours" else "ours"
    ours = config_io.to_ours(cfg, src_format)
    plan = plan_for(ours, src_format, dst_format, detect_variant(src_format, sd))
    check_coverage(plan)
    present = {k: (TORCH_TO_ST[v.dtype], tuple(v.shape)) for k, v in sd.items()}
    bound = bind(plan, present, dequant_dtype=dequant_dtype, dtype_overrides=dtype_overrides)
    out: dict[str, torch.Tensor] = {}
    for dk, d in plan.dests.items():
        tdt = DTYPES[bound.dst_dtype[dk]][0]
        flat = torch.empty(numel(d.shape), dtype=tdt)
        for pc in d.pieces:
            srcs = [sd[bound.actual[s]].detach().cpu().contiguous() for s in pc.srcs]
            if pc.op == "copy" and srcs[0].dtype == tdt:
                flat[pc.dst_el: pc.dst_el + pc.numel] = srcs[0].reshape(-1)[pc.src_el: pc.src_el + pc.numel]
            else:
                flat[pc.dst_el: pc.dst_el + pc.numel] = piece_values(pc.op, srcs, pc, bound.dst_dtype[dk])
        out[dk] = flat.reshape(d.shape)
    return out


def native_state_dict_to_ours(sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """transformers `KimiLinearForCausalLM.state_dict()` (native names) -> our layout. `config`: its KimiLinearConfig
    (or the dict of it)."""
    return convert_state_dict(sd, config, "native")


def released_state_dict_to_ours(sd, config):
    """Released Kimi-Linear state dict (``block_sparse_moe.experts.{e}.w1/w2/w3``, ``A_log [1,1,H,1]``) -> ours.
    ``config``: the released config dict. Raises CheckpointError listing unknown / missing keys or bad shapes."""
    return convert_state_dict(sd, config, "released")


def k3_state_dict_to_ours(sd, config, dequant_dtype: str = "BF16"):
    """K3 text state dict (``language_model.`` prefix, MXFP4 experts dequantised to ``dequant_dtype``) -> ours.
    Raises CheckpointError on unknown / missing keys, bad shapes, non-zero ``A_log`` padding."""
    return convert_state_dict(sd, config, "k3", dequant_dtype=dequant_dtype)


def ours_state_dict_to_released(sd, config):
    """`config`: our config dict (model_type kimi_hybrid) or KimiHybridConfig."""
    return convert_state_dict(sd, config, "ours", "released")
