"""Key / shape plans between the checkpoint layouts (docs/LAYOUT.md is the contract for "ours").

A plan is computed from a normalised config alone (no tensor data). It lists

- every expected SOURCE tensor (`SrcSpec`: name, accepted aliases, accepted shapes, required dtype), and
- every DESTINATION tensor (`DstSpec`: name, shape, dtype rule) together with its `Piece`s. A piece says "these
  elements of the destination come from these source tensors through this op":
    * `copy`  -- elements [src_el, src_el + numel) of one source, verbatim (a byte copy; dtypes must match unless
                 the destination dtype rule forces fp32, then it becomes an exact up-cast);
    * `zero_tail` -- `copy` of the first `numel` elements, after checking that every other element is exactly 0
                 (K3 `A_log` stored [128] for 96 heads);
    * `mxfp4` -- dequantize (weight_packed, weight_scale) into the destination dtype (K3 routed experts).

Fusions are all expressible as element ranges because they only stack / concatenate along leading dims:
`gate_up_proj[e, :F] <- w1_e`, `gate_up_proj[e, F:] <- w3_e`, `down_proj[e] <- w2_e`, native fused
`conv1d[0:P] -> q_conv1d` ..., `A_log [1,1,H,1] <-> [H]` (same bytes). Hence released <-> ours is byte-exact.

Layouts:
  released -- Kimi-Linear remote-code names (moonshotai/Kimi-Linear-48B-A3B-*), docs/checkpoint-format.md section 2;
              the name table is the bundle's (``kimi_hybrid.conversion_kimi_hybrid``: ``released_key``,
              ``released_expert_key``, ``released_a_log_shape``), the one transformers' loading mapping is built from.
  native   -- transformers 5.x `kimi_linear` in-memory names (`self_attn.conv1d`, `self_attn.forget_gate.*`,
              `mlp.experts.gate_up_proj`). `save_pretrained` of transformers >= 5 writes the checkpoint back in the
              released names except that dense layers get `block_sparse_moe.{gate,up,down}_proj`; the "native"
              reader accepts that variant too (`native-saved`).
  k3       -- Kimi K3 text backbone: `language_model.` prefix, MXFP4 experts, A_log [128] padded, K3-only keys.
  ours     -- docs/LAYOUT.md. A folder of ours written by ``save_pretrained`` carries the released tensor names (the
              checkpoint-conversion mapping of ``kimi_hybrid.conversion_kimi_hybrid``) with our config.json: the
              export reads it as variant "saved".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kimi_hybrid.conversion_kimi_hybrid import (
    RELEASED_EXPERT_DOWN,
    RELEASED_EXPERT_GATE_UP,
    RELEASED_MOE_MODULE,
    released_a_log_shape,
    released_expert_key,
    released_key,
)

from .safetensors_io import numel

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class PlanError(ValueError):
    """The checkpoint does not match the plan computed from its config."""


@dataclass
class SrcSpec:
    key: str
    shapes: tuple[tuple[int, ...], ...]
    aliases: tuple[str, ...] = ()
    dtype: str | None = None  # required safetensors dtype, None = any float

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shapes[0]


@dataclass
class Piece:
    op: str  # "copy" | "zero_tail" | "mxfp4"
    srcs: tuple[str, ...]
    src_el: int
    numel: int
    dst_el: int
    meta: tuple = ()


@dataclass
class DstSpec:
    key: str
    shape: tuple[int, ...]
    dtype_rule: str  # "same" | "fp32" | "dequant"
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Plan:
    src_format: str
    dst_format: str
    config: dict
    sources: dict[str, SrcSpec] = field(default_factory=dict)
    dests: dict[str, DstSpec] = field(default_factory=dict)
    skip_prefixes: tuple[str, ...] = ()
    variant: str = ""

    def add_src(self, key, shape, aliases=(), dtype=None, shapes=None):
        if key in self.sources:
            raise PlanError(f"internal: source {key} planned twice")
        self.sources[key] = SrcSpec(key, tuple(tuple(s) for s in (shapes or [shape])), tuple(aliases), dtype)

    def add_dst(self, key, shape, rule="same"):
        if key in self.dests:
            raise PlanError(f"internal: destination {key} planned twice")
        d = DstSpec(key, tuple(shape), rule)
        self.dests[key] = d
        return d


# ----------------------------------------------------------------------------------------------------------------
# Logical tensors in OUR naming (docs/LAYOUT.md). kind: plain | fp32 | alog | conv | gate_up | down
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Logical:
    key: str  # our name
    shape: tuple[int, ...]
    kind: str = "plain"
    layer: int = -1
    sub: str = ""  # name inside the layer, e.g. "self_attn.q_proj.weight"


def dims(cfg: dict) -> dict:
    d = dict(
        D=cfg["hidden_size"], V=cfg["vocab_size"], H=cfg["linear_num_heads"], d=cfg["linear_head_dim"],
        K=cfg["linear_conv_kernel_size"], Hm=cfg["num_attention_heads"], nope=cfg["qk_nope_head_dim"],
        rope=cfg["qk_rope_head_dim"], v=cfg["v_head_dim"], rkv=cfg["kv_lora_rank"], rq=cfg.get("q_lora_rank"),
        E=cfg.get("num_experts") or 0, F=cfg.get("moe_intermediate_size") or 0,
        Fd=cfg.get("dense_ffn_hidden") or cfg["intermediate_size"], S=cfg.get("num_shared_experts") or 0,
        L=cfg.get("routed_expert_hidden_size"),
    )
    d["P"] = d["H"] * d["d"]
    d["De"] = d["L"] or d["D"]
    return d


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_WEIGHTS = "|".join(RELEASED_EXPERT_GATE_UP + (RELEASED_EXPERT_DOWN,))
_RELEASED_EXPERT = re.compile(rf"\.experts\.\d+\.({_EXPERT_WEIGHTS})\.weight$")


def logical_tensors(cfg: dict) -> list[Logical]:
    """All tensors of our layout for this config, in the model's ``state_dict`` order.

    Read from ``KimiHybridForCausalLM`` built on the meta device (no memory, no init cost) for the config the model
    reads from ``cfg``: names and shapes are the model's own, so the plan never restates it. Kinds: ``alog``
    (``self_attn.A_log``) and ``fp32`` (the model's other ``_keep_in_fp32_modules_strict`` parameters: ``dt_bias``,
    ``e_score_correction_bias``) are written in fp32; ``conv`` (the KDA short-conv kernels), ``gate_up`` / ``down``
    (the fused experts) are assembled from several released tensors; the rest are ``plain``. A tied ``lm_head`` is
    left out (it is the embedding).
    """
    key = json.dumps(cfg, sort_keys=True, default=str)
    if key not in _LOGICAL_CACHE:
        _LOGICAL_CACHE.clear()  # one config at a time is all a conversion needs
        _LOGICAL_CACHE[key] = _logical_tensors_of_model(cfg)
    return list(_LOGICAL_CACHE[key])


_LOGICAL_CACHE: dict[str, list[Logical]] = {}


def _logical_tensors_of_model(cfg: dict) -> list[Logical]:
    from .model_glue import meta_model

    model = meta_model(cfg)
    fp32_names = set(type(model)._keep_in_fp32_modules_strict or ())
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if model.config.tie_word_embeddings else set()
    out: list[Logical] = []
    for name, t in model.state_dict(keep_vars=True).items():
        if name in tied:
            continue
        m = _LAYER_KEY.match(name)
        layer, sub = (int(m.group(1)), m.group(2)) if m else (-1, "")
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if sub == "self_attn.A_log":
            kind = "alog"
        elif leaf in fp32_names:
            kind = "fp32"
        elif sub.startswith("self_attn.") and sub.endswith("_conv1d.weight"):
            kind = "conv"
        elif sub.endswith("experts.gate_up_proj"):
            kind = "gate_up"
        elif sub.endswith("experts.down_proj"):
            kind = "down"
        else:
            kind = "plain"
        out.append(Logical(name, tuple(t.shape), kind, layer, sub))
    return out


def _rule(lt: Logical) -> str:
    return "fp32" if lt.kind in ("fp32", "alog") else "same"


def plan_to_ours(cfg: dict, src_format: str, variant: str = "") -> Plan:
    """Plan a conversion released / native / k3 -> ours.

    variant: for native, "fused" (in-memory names, default) or "saved" (released names written by transformers'
    save_pretrained); for k3, a combination of "prefixed" / "mxfp4" (default "prefixed+mxfp4").
    """
    if src_format not in ("released", "native", "k3"):
        raise PlanError(f"no plan from {src_format!r} to ours")
    if src_format == "native" and not variant:
        variant = "fused"
    if src_format == "k3" and not variant:
        variant = "prefixed+mxfp4"
    plan = Plan(src_format, "ours", cfg, variant=variant)
    g = dims(cfg)
    prefix = "language_model." if (src_format == "k3" and "prefixed" in variant) else ""
    mxfp4 = src_format == "k3" and "mxfp4" in variant
    fused_native = src_format == "native" and variant == "fused"
    if src_format == "k3":
        plan.skip_prefixes = VISION_PREFIXES
    for lt in logical_tensors(cfg):
        sparse = cfg["mlp_layer_types"][lt.layer] == "sparse" if lt.layer >= 0 else False
        lp = f"{prefix}model.layers.{lt.layer}."
        dst = plan.add_dst(lt.key, lt.shape, _rule(lt))
        n = numel(lt.shape)
        if fused_native:
            if lt.kind == "conv":
                src = lp + "self_attn.conv1d.weight"
                j = "qkv".index(lt.sub[len("self_attn."):][0])
                if src not in plan.sources:
                    plan.add_src(src, (3 * g["P"], 1, g["K"]))
                dst.pieces.append(Piece("copy", (src,), j * n, n, 0))
                continue
            name = lt.key
            for s in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                if lt.sub == "self_attn." + s:
                    name = lp + "self_attn.forget_gate." + s
            shape = released_a_log_shape(g["H"]) if lt.kind == "alog" else lt.shape
            plan.add_src(name, shape)
            dst.pieces.append(Piece("copy", (name,), 0, n, 0))
            continue
        # released-style names (released, native-saved, k3)
        if lt.kind in ("gate_up", "down"):
            E, F, De = lt.shape[0], g["F"], g["De"]
            per = F * De
            gate_w, up_w = RELEASED_EXPERT_GATE_UP
            for e in range(E):
                parts = ((gate_w, 2 * e), (up_w, 2 * e + 1)) if lt.kind == "gate_up" else ((RELEASED_EXPERT_DOWN, e),)
                for w, slot in parts:
                    shp = (F, De) if w != RELEASED_EXPERT_DOWN else (De, F)
                    k = released_expert_key(lp, e, w)
                    if mxfp4:
                        kp, ks = k[:-len(".weight")] + ".weight_packed", k[:-len(".weight")] + ".weight_scale"
                        out_f, in_f = shp
                        if in_f % 32:
                            raise PlanError(f"MXFP4 needs the input width ({in_f}) to be a multiple of 32")
                        plan.add_src(kp, (out_f, in_f // 2), dtype="U8")
                        plan.add_src(ks, (out_f, in_f // 32), dtype="U8")
                        dst.pieces.append(Piece("mxfp4", (kp, ks), 0, per, slot * per, (out_f, in_f)))
                    else:
                        plan.add_src(k, shp)
                        dst.pieces.append(Piece("copy", (k,), 0, per, slot * per))
            if mxfp4:
                dst.dtype_rule = "dequant"
            continue
        name = prefix + released_key(lt.key)
        aliases: tuple[str, ...] = ()
        if src_format == "native" and lt.layer >= 0 and not sparse and lt.sub.startswith("mlp."):
            # transformers' save_pretrained renames every `.mlp.` back to `.block_sparse_moe.`, dense ones included
            aliases = (f"{lp}{RELEASED_MOE_MODULE}." + lt.sub[len("mlp."):],)
        if lt.kind == "alog":
            H = g["H"]
            if src_format == "k3":
                padded = -(-H // 128) * 128
                shapes = [(padded,)] + ([(H,)] if padded != H else []) + [released_a_log_shape(H)]
                plan.add_src(name, None, shapes=shapes)
                dst.pieces.append(Piece("zero_tail", (name,), 0, H, 0))
            else:
                plan.add_src(name, released_a_log_shape(H))
                dst.pieces.append(Piece("copy", (name,), 0, H, 0))
            continue
        plan.add_src(name, lt.shape, aliases)
        dst.pieces.append(Piece("copy", (name,), 0, n, 0))
    return plan


def plan_ours_to_released(cfg: dict, variant: str = "") -> Plan:
    """Exact inverse of the released -> ours plan: ours (sources) -> released remote-code names (destinations).

    variant "saved": the source folder is ours by its config but its tensors already carry the released names and
    shapes (what ``save_pretrained`` writes through the registered checkpoint-conversion mapping), so every tensor is
    copied under its own name. In either variant ``A_log`` is accepted as ``[H]`` or ``[1, 1, H, 1]`` (same bytes).
    """
    fwd = plan_to_ours(cfg, "released")
    plan = Plan("ours", "released", cfg, variant=variant)
    H = dims(cfg)["H"]
    if variant == "saved":
        for rkey, spec in fwd.sources.items():
            shapes = [spec.shape] + ([(H,)] if rkey.endswith("self_attn.A_log") else [])
            plan.add_src(rkey, None, shapes=shapes)
            rd = plan.add_dst(rkey, spec.shape, "same")
            rd.pieces.append(Piece("copy", (rkey,), 0, numel(spec.shape), 0))
        return plan
    for lt in logical_tensors(cfg):
        plan.add_src(lt.key, None, shapes=[lt.shape] + ([released_a_log_shape(H)] if lt.kind == "alog" else []))
    for dkey, d in fwd.dests.items():
        for pc in d.pieces:
            (rkey,) = pc.srcs
            spec = fwd.sources[rkey]
            rd = plan.add_dst(rkey, spec.shape, "same")
            rd.pieces.append(Piece("copy", (dkey,), pc.dst_el, pc.numel, pc.src_el))
    # keep the released key order of the forward plan
    plan.dests = {k: plan.dests[k] for k in fwd.sources}
    return plan


def plan_for(cfg: dict, src_format: str, dst_format: str = "ours", variant: str = "") -> Plan:
    if dst_format == "ours":
        return plan_to_ours(cfg, src_format, variant)
    if src_format == "ours" and dst_format == "released":
        return plan_ours_to_released(cfg, variant)
    raise PlanError(f"no conversion from {src_format!r} to {dst_format!r}")


def detect_variant(src_format: str, keys) -> str:
    """Pick the key-naming variant of a source from its tensor names."""
    keys = list(keys)
    if src_format == "native":
        fused = any(k.endswith("self_attn.conv1d.weight") or ".forget_gate." in k or k.endswith("experts.gate_up_proj")
                    for k in keys)
        return "fused" if fused else "saved"
    if src_format == "ours":
        # released names written by save_pretrained (the registered checkpoint-conversion mapping) vs our own layout
        saved = any(f".{RELEASED_MOE_MODULE}." in k or _RELEASED_EXPERT.search(k) for k in keys)
        return "saved" if saved else ""
    if src_format == "k3":
        parts = []
        if any(k.startswith("language_model.") for k in keys):
            parts.append("prefixed")
        if any(k.endswith(".weight_packed") for k in keys):
            parts.append("mxfp4")
        return "+".join(parts) or "plain"
    return ""
