"""Dry run: list the source and target tensors of a conversion from a config.json alone (no weights needed).

Shapes come from the plan; each tensor is materialised as a `meta` tensor (no storage) to count elements and bytes.
Source dtypes are assumed from the config's `dtype` plus the dtype facts of each released format (docs/checkpoint-format.md
section 2, docs/k3.md sections 4 and 6): fp32 `A_log`, `dt_bias`, `e_score_correction_bias` (and for K3 the q/k/v convs
and `o_norm`); uint8 MXFP4 `weight_packed` / `weight_scale`.
"""

from __future__ import annotations

import torch

from . import config_io
from .binding import bind, check_coverage
from .layouts import plan_for
from .safetensors_io import CONFIG_DTYPE_TO_ST, DTYPES

K3_FP32_SUFFIXES = ("conv1d.weight", "o_norm.weight")


def assumed_source_dtypes(plan, model_dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    present = {}
    for key, spec in plan.sources.items():
        if spec.dtype is not None:
            dt = spec.dtype
        elif key.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
            dt = "F32"
        elif plan.src_format == "k3" and key.endswith(K3_FP32_SUFFIXES):
            dt = "F32"
        else:
            dt = model_dtype
        present[key] = (dt, spec.shape)
    return present


def inventory(config: dict, src_format: str = "auto", dst_format: str | None = None, variant: str = "",
              dequant_dtype: str = "BF16", with_keys: bool = True) -> dict:
    fmt = config_io.detect_format(config) if src_format == "auto" else src_format
    if dst_format is None:
        dst_format = "released" if fmt == "ours" else "ours"
    ours = config_io.to_ours(config, fmt)
    plan = plan_for(ours, fmt, dst_format, variant)
    check_coverage(plan)
    model_dtype = CONFIG_DTYPE_TO_ST.get(str(ours.get("dtype", "bfloat16")).replace("torch.", ""), "BF16")
    present = assumed_source_dtypes(plan, model_dtype)
    bound = bind(plan, present, dequant_dtype=dequant_dtype)

    def meta(shape, dt):
        return torch.empty(tuple(shape), dtype=DTYPES[dt][0], device="meta")

    src_rows, dst_rows = [], []
    s_params = s_bytes = d_params = d_bytes = 0
    for key, (dt, shape) in present.items():
        t = meta(shape, dt)
        s_params += t.numel()
        s_bytes += t.numel() * t.element_size()
        src_rows.append({"key": key, "shape": list(shape), "dtype": dt})
    for key, d in plan.dests.items():
        t = meta(d.shape, bound.dst_dtype[key])
        d_params += t.numel()
        d_bytes += t.numel() * t.element_size()
        dst_rows.append({"key": key, "shape": list(d.shape), "dtype": bound.dst_dtype[key],
                         "sources": len({s for pc in d.pieces for s in pc.srcs})})
    out = {
        "source_format": fmt,
        "destination_format": dst_format,
        "variant": plan.variant,
        "layers": {"linear_attention": ours["layer_types"].count("linear_attention"),
                   "full_attention": ours["layer_types"].count("full_attention"),
                   "dense_mlp": ours["mlp_layer_types"].count("dense"),
                   "sparse_mlp": ours["mlp_layer_types"].count("sparse")},
        "source": {"tensors": len(src_rows), "elements": s_params, "bytes": s_bytes},
        "target": {"tensors": len(dst_rows), "parameters": d_params, "bytes": d_bytes},
    }
    if with_keys:
        out["source"]["keys"] = src_rows
        out["target"]["keys"] = dst_rows
    return out


def format_inventory(inv: dict, max_rows: int | None = 40) -> str:
    lines = [
        f"{inv['source_format']} -> {inv['destination_format']}  layers: {inv['layers']}",
        f"source: {inv['source']['tensors']:,} tensors, {inv['source']['elements']:,} elements, "
        f"{inv['source']['bytes']:,} bytes ({inv['source']['bytes'] / 2**30:.2f} GiB)",
        f"target: {inv['target']['tensors']:,} tensors, {inv['target']['parameters']:,} parameters, "
        f"{inv['target']['bytes']:,} bytes ({inv['target']['bytes'] / 2**30:.2f} GiB)",
    ]
    for side in ("source", "target"):
        rows = inv[side].get("keys") or []
        if not rows:
            continue
        lines.append(f"--- {side} keys ---")
        shown = rows if max_rows is None else rows[:max_rows]
        for r in shown:
            lines.append(f"{r['key']}  {r['shape']}  {r['dtype']}")
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} more (use --all)")
    return "\n".join(lines)
