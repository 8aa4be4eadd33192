"""Bind a config-derived plan to the tensors actually present in a checkpoint, and the per-piece math.

`bind` is where a checkpoint is refused: unknown names, missing names, wrong shapes and wrong dtypes are all
collected first and reported together, each with the full list of names (and expected / got shapes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layouts import Plan, PlanError
from .mxfp4 import dequantize_mxfp4
from .safetensors_io import DTYPES, numel

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


class CheckpointError(ValueError):
    """The checkpoint does not match what its config says (unknown / missing keys, shapes, dtypes)."""


def _fmt_list(title: str, items: list[str]) -> str:
    return f"{title} ({len(items)}):\n  " + "\n  ".join(items)


@dataclass
class Bound:
    plan: Plan
    actual: dict[str, str]  # canonical source key -> name found in the checkpoint
    src_info: dict[str, tuple[str, tuple[int, ...]]]  # canonical source key -> (dtype, shape)
    dst_dtype: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)  # checkpoint name -> reason

    def canonical_of(self) -> dict[str, str]:
        return {v: k for k, v in self.actual.items()}


def bind(plan: Plan, present: dict[str, tuple[str, tuple[int, ...]]], dequant_dtype: str = "BF16",
         dtype_overrides: dict[str, str] | None = None) -> Bound:
    """Match plan.sources against `present` ({name: (dtype, shape)}) and choose every destination dtype.

    Raises CheckpointError listing every unknown name, missing name, wrong shape and wrong dtype at once.
    """
    errors: list[str] = []
    actual: dict[str, str] = {}
    claimed: set[str] = set()
    missing: list[str] = []
    dup: list[str] = []
    for key, spec in plan.sources.items():
        found = [n for n in (key, *spec.aliases) if n in present]
        if not found:
            missing.append(key if not spec.aliases else f"{key} (or {', '.join(spec.aliases)})")
            continue
        if len(found) > 1:
            dup.append(" and ".join(found))
        actual[key] = found[0]
        claimed.update(found)
    skipped: dict[str, str] = {}
    unknown: list[str] = []
    for name in present:
        if name in claimed:
            continue
        pre = next((p for p in plan.skip_prefixes if name.startswith(p)), None)
        if pre is not None:
            skipped[name] = f"not part of the text backbone ({pre.rstrip('.')})"
        else:
            unknown.append(name)
    if unknown:
        errors.append(_fmt_list(f"unknown keys (not expected for a {plan.src_format} checkpoint with this config)",
                                sorted(unknown)))
    if missing:
        errors.append(_fmt_list("missing keys (required by the config)", missing))
    if dup:
        errors.append(_fmt_list("keys present under two accepted names", dup))
    bad_shape: list[str] = []
    bad_dtype: list[str] = []
    src_info: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, name in actual.items():
        spec = plan.sources[key]
        dtype, shape = present[name]
        shape = tuple(int(s) for s in shape)
        if shape not in spec.shapes:
            exp = " or ".join(str(list(s)) for s in spec.shapes)
            bad_shape.append(f"{name}: expected {exp}, got {list(shape)}")
        if spec.dtype is not None and dtype != spec.dtype:
            bad_dtype.append(f"{name}: expected {spec.dtype}, got {dtype}")
        elif spec.dtype is None and dtype not in FLOAT_DTYPES:
            bad_dtype.append(f"{name}: expected a floating dtype, got {dtype}")
        src_info[key] = (dtype, shape)
    if bad_shape:
        errors.append(_fmt_list("wrong shapes", bad_shape))
    if bad_dtype:
        errors.append(_fmt_list("wrong dtypes", bad_dtype))
    if errors:
        raise CheckpointError("checkpoint does not match its config:\n" + "\n".join(errors))

    overrides = dtype_overrides or {}
    dst_dtype: dict[str, str] = {}
    mixed: list[str] = []
    for dkey, d in plan.dests.items():
        if dkey in overrides:
            dst_dtype[dkey] = overrides[dkey]
            continue
        if d.dtype_rule == "fp32":
            dst_dtype[dkey] = "F32"
        elif d.dtype_rule == "dequant":
            dst_dtype[dkey] = dequant_dtype
        else:
            dts = {src_info[s][0] for pc in d.pieces for s in pc.srcs}
            if len(dts) != 1:
                mixed.append(f"{dkey}: sources have dtypes {sorted(dts)}")
                continue
            dst_dtype[dkey] = dts.pop()
    if mixed:
        raise CheckpointError(_fmt_list("cannot fuse tensors of different dtypes", mixed))
    return Bound(plan, actual, src_info, dst_dtype, skipped)


def check_coverage(plan: Plan) -> None:
    """Every destination element is written exactly once (pieces tile the destination)."""
    bad = []
    for dkey, d in plan.dests.items():
        spans = sorted((pc.dst_el, pc.dst_el + pc.numel) for pc in d.pieces)
        pos = 0
        for b, e in spans:
            if b != pos:
                bad.append(f"{dkey}: element {pos} {'overlaps' if b < pos else 'is not covered'}")
                break
            pos = e
        else:
            if pos != numel(d.shape):
                bad.append(f"{dkey}: pieces cover {pos} of {numel(d.shape)} elements")
    if bad:
        raise PlanError(_fmt_list("internal: plan does not tile its destinations", bad))


def piece_values(op: str, srcs: list[torch.Tensor], pc, dst_dtype: str) -> torch.Tensor:
    """Compute the flat destination values of a non-byte-copy piece.

    srcs: the full source tensors, in pc.srcs order. Returns a 1-D tensor of pc.numel elements in dst_dtype.
    Down-casts are refused unless exact (the converters never lose information silently).
    """
    tdt = DTYPES[dst_dtype][0]
    if op == "copy":
        flat = srcs[0].reshape(-1)[pc.src_el: pc.src_el + pc.numel]
        out = flat.to(tdt)
        if out.dtype != flat.dtype and not torch.allclose(out.to(flat.dtype), flat, rtol=0, atol=0, equal_nan=True):
            raise CheckpointError(f"casting {pc.srcs[0]} from {flat.dtype} to {tdt} would change its values")
        return out
    if op == "zero_tail":
        flat = srcs[0].reshape(-1)
        tail = flat[pc.src_el + pc.numel:]
        head = flat[: pc.src_el]
        if tail.numel() and bool((tail != 0).any()):
            bad = int((tail != 0).sum())
            raise CheckpointError(f"{pc.srcs[0]}: shape {list(srcs[0].shape)} is padded beyond the {pc.numel} heads of "
                                  f"the config, but {bad} padding values are not zero; refusing to drop them")
        if head.numel() and bool((head != 0).any()):
            raise CheckpointError(f"{pc.srcs[0]}: unexpected non-zero leading padding")
        return flat[pc.src_el: pc.src_el + pc.numel].to(tdt)
    if op == "mxfp4":
        packed, scale = srcs
        w = dequantize_mxfp4(packed, scale, dtype=tdt)
        return w.reshape(-1)
    raise PlanError(f"unknown piece op {op!r}")
