"""Decoding-cache memory planner for KimiHybrid models (``kimi-hybrid memory``).

For a model config and a GPU memory size it gives the bytes :class:`KimiHybridCache` holds per token and per
sequence, the largest context that fits at batch 1 and the largest batch at a given context after the weights, and
compares the hybrid with two caches of the same model depth:

* **all-MLA**: every layer a latent-MLA layer (``kv_lora_rank + qk_rope_head_dim`` values per token and layer);
* **plain MHA**: every layer caching per-head keys and values, ``num_attention_heads x (qk_head_dim + v_head_dim)``
  values per token and layer, with ``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``.

The hybrid figures are those of our cache, byte for byte what ``KimiHybridCache.memory_report()`` sums from its
tensors (tested on real tensors). For a batch of ``B`` rows holding ``T`` tokens each:

* KDA layers, constant: ``B x n_kda x (H x K x K x 4`` (fp32 recurrent state) ``+ 3 x H x K x W x s)``
  (short-conv window of q, k, v), with ``H`` heads of size ``K``, conv kernel ``W`` and ``s`` the cache dtype size;
* MLA layers, per token: ``B x T x n_mla x (kv_lora_rank + qk_rope_head_dim) x s``;
* key-padding mask: ``B x T`` bytes (bool);
* dynamic cache only: the last hidden state of each row, ``B x hidden_size x s`` (kept for padded continuation).
  A static cache (``max_cache_len``) holds no hidden state and allocates the latents and the mask for
  ``max_cache_len`` tokens.

The all-MLA and MHA columns count the attention state only (no mask, no hidden state). Weights are counted as the
parameter count of the model built on the meta device times the ``--weights-dtype`` size (a few small fp32
parameters, e.g. ``A_log``, are counted at that size too). Activations and allocator overhead are not modelled:
pass them as ``--reserve``.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from kimi_hybrid.conversion.config_io import PRESET_ALIASES, RELEASED_PRESETS

DTYPE_BYTES = {"float32": 4.0, "fp32": 4.0, "bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "fp16": 2.0,
               "float8": 1.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "mxfp4": 4.25 / 8, "none": 0.0}
CACHE_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
# the presets users plan for: the converter's list (``kimi-hybrid-convert inventory --preset`` takes the same names)
PRESET_NAMES = tuple(RELEASED_PRESETS)

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9,
               "t": 10**12}


class PlanError(ValueError):
    """A planner input the user has to fix (unknown preset, bad size, unreadable config); the message says how."""


def parse_size(text: str) -> int:
    """``"141GB"`` -> 141_000_000_000, ``"80GiB"`` -> 85_899_345_920, ``"1.5TB"``, ``"4096"`` (bytes).

    Decimal units (kB, MB, GB, TB; also k, M, G, T) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers
    of 1024; case-insensitive. Returns bytes (int, rounded down). Raises PlanError for anything else or a negative
    size."""
    if re.fullmatch(r"\s*-\s*[0-9.].*", str(text)):
        raise PlanError(f"the size must be positive (got {text!r}); write e.g. 141GB, 80GiB, 512MiB")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise PlanError(f"cannot read the size {text!r}; write a number with a unit, e.g. 141GB, 80GiB, 512MiB")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def dtype_bytes(name: str, what: str) -> float:
    """Bytes per value of a dtype name (``bfloat16``/``bf16``, ``float16``, ``float32``, and for weights also
    ``fp8``, ``int8``, ``int4``, ``mxfp4`` = 4.25 bits, ``none`` = not counted). Raises PlanError naming ``what``."""
    key = str(name).lower().replace("torch.", "")
    allowed = CACHE_DTYPES if what == "--cache-dtype" else tuple(DTYPE_BYTES)
    if key not in allowed:
        raise PlanError(f"unknown {what} {name!r}; use one of {', '.join(allowed)}")
    return DTYPE_BYTES[key]


# ---------------------------------------------------------------------------------------------------------------
# the table of one cache's memory_report()
# ---------------------------------------------------------------------------------------------------------------

def _binary_human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_memory_report(report: Dict[str, Any]) -> str:
    """A small table of ``KimiHybridCache.memory_report()`` (the dict it returns): bytes per layer type, the
    total, and the formula parts (constant KDA state, MLA bytes per token); the table ``kimi-hybrid generate``
    prints."""
    per_layer: List[Tuple[str, int]] = list(report.get("per_layer", []))
    n_kda = sum(t == "linear_attention" for t, _ in per_layer)
    n_mla = sum(t == "full_attention" for t, _ in per_layer)
    rows = [
        ("KDA conv + fp32 state", str(n_kda), report["kda_bytes"], "constant"),
        ("MLA latent", str(n_mla), report["mla_bytes"], f"{report['mla_bytes_per_token']} B/token"),
        ("key-padding mask", "-", report["mask_bytes"], "1 B/token"),
    ]
    if report.get("hidden_bytes"):
        rows.append(("last hidden state", "-", report["hidden_bytes"], "1 per row"))
    if report.get("rollback_bytes"):
        rows.append(("rollback records", "-", report["rollback_bytes"], "assisted decoding"))
    rows.append(("total", str(n_kda + n_mla), report["total_bytes"], ""))
    head = (f"cache memory (KimiHybridCache.memory_report): {report['seen_tokens']} tokens, "
            f"batch {report['batch_size']}")
    w0 = max(len(r[0]) for r in rows + [("layer type", "", 0, "")])
    lines = [head, f"  {'layer type':<{w0}}  {'layers':>6}  {'bytes':>12}  {'human':>10}  note",
             f"  {'-' * w0}  {'-' * 6}  {'-' * 12}  {'-' * 10}  {'-' * 16}"]
    for name, layers, nbytes, note in rows:
        lines.append(f"  {name:<{w0}}  {layers:>6}  {nbytes:>12,}  {_binary_human(nbytes):>10}  {note}")
    return "\n".join(lines)


def print_memory_report(cache_or_report, file=None) -> None:
    """Print :func:`format_memory_report` of a ``KimiHybridCache`` (its ``memory_report()``) or of such a report
    dict, e.g. ``print_memory_report(cache)`` after ``model.generate(..., cache=cache)``."""
    import sys

    report = cache_or_report.memory_report() if hasattr(cache_or_report, "memory_report") else cache_or_report
    print(format_memory_report(report), file=file or sys.stdout)


# ---------------------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------------------

def load_config(preset: Optional[str] = None, config: Optional[str] = None, model: Optional[str] = None):
    """A ``KimiHybridConfig`` from exactly one of: a preset name (``PRESET_NAMES``, or ``k3``), a config.json path
    (ours, released Kimi-Linear or K3), or a model folder (its config.json). Raises PlanError when none or several
    are given, the name is unknown, or the file cannot be read as a KimiHybrid config."""
    from kimi_hybrid import KimiHybridConfig

    given = [x for x in (preset, config, model) if x]
    if len(given) != 1:
        raise PlanError("give exactly one of --preset NAME, --config CONFIG.json, --model FOLDER "
                        f"(presets: {', '.join(PRESET_NAMES)})")
    if preset:
        from kimi_hybrid.conversion.config_io import ConfigError, preset_name

        try:
            name = preset_name(preset)
        except ConfigError:
            raise PlanError(f"unknown preset {preset!r}; the presets are {', '.join(PRESET_NAMES)} (aliases: "
                            f"{', '.join(PRESET_ALIASES)}; or pass --config CONFIG.json / --model FOLDER)") from None
        return KimiHybridConfig.from_preset(RELEASED_PRESETS[name])
    if model:
        folder = Path(model).expanduser()
        if not (folder / "config.json").is_file():
            raise PlanError(f"{folder} is not a model folder with a config.json; pass --model FOLDER, "
                            "--config CONFIG.json or --preset NAME")
        return _config_from_file(folder / "config.json")
    path = Path(config).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"no such config file: {path}")
    return _config_from_file(path)


def _config_from_file(path: Path):
    """A ``KimiHybridConfig`` from a config.json, checked by the converter's reader (``kimi-hybrid-convert inventory
    --config`` refuses the same files): the format from ``model_type`` (ours, released or native Kimi-Linear, K3),
    then the model's config class. Raises PlanError naming the file and the reason."""
    from kimi_hybrid.conversion import config_io
    from kimi_hybrid.conversion.model_glue import to_model_config

    try:
        raw = config_io.load_json(str(path))
    except (OSError, config_io.ConfigError) as e:
        raise PlanError(f"{path} is not a readable JSON config ({e})") from None
    try:
        return to_model_config(config_io.to_ours(raw, config_io.detect_format(raw)))
    except (config_io.ConfigError, TypeError, ValueError, KeyError) as e:
        raise PlanError(f"{path} is not a KimiHybrid / Kimi-Linear / K3 config: {e}") from None


def count_parameters(config) -> int:
    """Parameters of ``KimiHybridForCausalLM(config)``, built on the meta device (no memory; ~1 s for K3)."""
    import torch
    from kimi_hybrid import KimiHybridForCausalLM

    with torch.device("meta"):
        model = KimiHybridForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# the plan
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class CachePlan:
    """Cache sizes of one config at one cache dtype, per sequence (batch row). All sizes in bytes (int).

    ``kda_state`` / ``kda_conv``: the constant KDA part (fp32 recurrent states / conv windows, all KDA layers);
    ``hidden``: the dynamic cache's last hidden state; ``mla_per_token``: latents of all MLA layers per token;
    ``mask_per_token``: the key-padding mask (1); ``all_mla_per_token`` / ``mha_per_token``: the comparison caches
    of the same depth."""

    num_layers: int
    n_kda: int
    n_mla: int
    cache_dtype_bytes: int
    kda_state: int
    kda_conv: int
    hidden: int
    mla_per_token: int
    mask_per_token: int
    all_mla_per_token: int
    mha_per_token: int
    mha_heads: int
    mha_head_values: int

    @classmethod
    def from_config(cls, config, cache_dtype: str = "bfloat16") -> "CachePlan":
        """Sizes for ``config`` (a ``KimiHybridConfig``) with conv windows, latents and hidden state in
        ``cache_dtype`` (the model's activation dtype); the KDA recurrent state is always fp32."""
        s = int(dtype_bytes(cache_dtype, "--cache-dtype"))
        lac = config.linear_attn_config
        H, K, W = int(lac["num_heads"]), int(lac["head_dim"]), int(lac["short_conv_kernel_size"])
        n_kda = list(config.layer_types).count("linear_attention")
        n_mla = list(config.layer_types).count("full_attention")
        L = int(config.num_hidden_layers)
        latent = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        qk = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        heads = int(config.num_attention_heads)
        return cls(num_layers=L, n_kda=n_kda, n_mla=n_mla, cache_dtype_bytes=s,
                   kda_state=n_kda * H * K * K * 4, kda_conv=n_kda * 3 * H * K * W * s,
                   hidden=int(config.hidden_size) * s, mla_per_token=n_mla * latent * s, mask_per_token=1,
                   all_mla_per_token=L * latent * s, mha_per_token=L * heads * (qk + int(config.v_head_dim)) * s,
                   mha_heads=heads, mha_head_values=qk + int(config.v_head_dim))

    # -- what memory_report() gives -------------------------------------------------------------------------------
    def report(self, tokens: int, batch: int = 1, static: bool = False) -> Dict[str, int]:
        """The byte fields of ``KimiHybridCache.memory_report()`` for ``batch`` rows of ``tokens`` tokens (for a
        static cache, ``tokens`` is ``max_cache_len``): ``kda_state_bytes``, ``kda_conv_bytes``, ``kda_bytes``,
        ``mla_bytes``, ``mask_bytes``, ``hidden_bytes``, ``counter_bytes`` (the static cache's int64 device
        position counter), ``total_bytes`` (no rollback records)."""
        kda_state, kda_conv = batch * self.kda_state, batch * self.kda_conv
        out = {"kda_state_bytes": kda_state, "kda_conv_bytes": kda_conv, "kda_bytes": kda_state + kda_conv,
               "mla_bytes": batch * tokens * self.mla_per_token,
               "mask_bytes": batch * tokens * self.mask_per_token,
               "hidden_bytes": 0 if static else batch * self.hidden,
               "counter_bytes": 8 if static else 0}
        out["total_bytes"] = (out["kda_bytes"] + out["mla_bytes"] + out["mask_bytes"] + out["hidden_bytes"]
                              + out["counter_bytes"])
        return out

    # -- per sequence -------------------------------------------------------------------------------------------
    @property
    def fixed(self) -> int:
        """Bytes per sequence whatever its length (KDA state + conv windows + last hidden state)."""
        return self.kda_state + self.kda_conv + self.hidden

    @property
    def per_token(self) -> int:
        """Bytes per token and sequence (MLA latents + mask byte)."""
        return self.mla_per_token + self.mask_per_token

    def variants(self) -> Dict[str, Dict[str, int]]:
        """``{name: {"fixed": bytes, "per_token": bytes}}`` for ``hybrid``, ``all_mla``, ``mha``."""
        return {"hybrid": {"fixed": self.fixed, "per_token": self.per_token},
                "all_mla": {"fixed": 0, "per_token": self.all_mla_per_token},
                "mha": {"fixed": 0, "per_token": self.mha_per_token}}


def sequence_bytes(fixed: int, per_token: int, tokens: int) -> int:
    """Cache bytes of one sequence of ``tokens`` tokens."""
    return fixed + per_token * tokens


def largest_context(budget: int, fixed: int, per_token: int) -> int:
    """Most tokens one sequence can hold in ``budget`` bytes (0 if not even the fixed part fits)."""
    if budget < fixed or per_token <= 0:
        return 0
    return (budget - fixed) // per_token


def largest_batch(budget: int, fixed: int, per_token: int, context: int) -> int:
    """Most sequences of ``context`` tokens that fit in ``budget`` bytes (0 if none)."""
    one = sequence_bytes(fixed, per_token, context)
    return max(budget, 0) // one if one > 0 else 0


@dataclass
class MemoryPlan:
    """A full plan: the config's cache sizes, the weights and the GPU budget (bytes), and the answers."""

    name: str
    cache: CachePlan
    parameters: int
    weights_dtype: str
    weights_bytes: int
    gpu_bytes: int
    reserve_bytes: int
    context: int

    @property
    def budget(self) -> int:
        """Bytes left for the cache: GPU - weights - reserve (may be negative)."""
        return self.gpu_bytes - self.weights_bytes - self.reserve_bytes

    def rows(self) -> Dict[str, Dict[str, int]]:
        """Per variant: ``fixed``, ``per_token``, ``at_context`` (one sequence of ``context`` tokens),
        ``max_context`` (batch 1) and ``max_batch`` (at ``context``)."""
        out = {}
        for name, v in self.cache.variants().items():
            out[name] = dict(v, at_context=sequence_bytes(v["fixed"], v["per_token"], self.context),
                             max_context=largest_context(self.budget, v["fixed"], v["per_token"]),
                             max_batch=largest_batch(self.budget, v["fixed"], v["per_token"], self.context))
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "parameters": self.parameters, "weights_dtype": self.weights_dtype,
                "weights_bytes": self.weights_bytes, "gpu_bytes": self.gpu_bytes,
                "reserve_bytes": self.reserve_bytes, "budget_bytes": self.budget, "context": self.context,
                "cache": asdict(self.cache), "variants": self.rows()}


def make_plan(config, name: str, gpu_bytes: int, context: int, weights_dtype: str = "bfloat16",
              cache_dtype: str = "bfloat16", reserve_bytes: int = 0,
              parameters: Optional[int] = None) -> MemoryPlan:
    """Build a :class:`MemoryPlan`. ``parameters``: the parameter count if known (else counted on the meta
    device). Raises PlanError for an unknown dtype or a context < 1."""
    if context < 1:
        raise PlanError(f"--context must be >= 1 token (got {context})")
    wb = dtype_bytes(weights_dtype, "--weights-dtype")
    cache = CachePlan.from_config(config, cache_dtype)
    n = count_parameters(config) if parameters is None else parameters
    return MemoryPlan(name=name, cache=cache, parameters=n, weights_dtype=weights_dtype,
                      weights_bytes=int(math.ceil(n * wb)), gpu_bytes=gpu_bytes, reserve_bytes=reserve_bytes,
                      context=context)


# ---------------------------------------------------------------------------------------------------------------
# text and plot
# ---------------------------------------------------------------------------------------------------------------

def human(n: float) -> str:
    """Bytes as decimal units (``8.46 GB``), the unit GPU vendors quote."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


VARIANT_LABELS = {"hybrid": "hybrid (ours: KDA + MLA)", "all_mla": "same model, all MLA",
                  "mha": "same model, plain MHA"}


def format_plan(plan: MemoryPlan) -> str:
    """The planner's printed report (see the module doc for what each figure counts)."""
    c = plan.cache
    lines = [
        f"{plan.name}: {c.num_layers} layers = {c.n_kda} KDA + {c.n_mla} MLA; cache dtype "
        f"{_dtype_name(c.cache_dtype_bytes)} (KDA recurrent state fp32)",
        f"weights: {plan.parameters:,} parameters x {plan.weights_dtype} = {human(plan.weights_bytes)}",
        f"GPU {human(plan.gpu_bytes)} - weights {human(plan.weights_bytes)} - reserve {human(plan.reserve_bytes)} "
        + (f"= {human(plan.budget)} for the cache" if plan.budget > 0 else
           f"leaves nothing for the cache ({human(-plan.budget)} short)"),
        "",
        "cache per sequence (KimiHybridCache, dynamic; equals memory_report()):",
        f"  KDA fixed part    {c.kda_state + c.kda_conv:>16,} B  ({c.n_kda} layers: fp32 state {c.kda_state:,} B "
        f"+ conv windows {c.kda_conv:,} B)",
        f"  last hidden state {c.hidden:>16,} B",
        f"  MLA per token     {c.mla_per_token:>16,} B  ({c.n_mla} layers x latent)",
        f"  mask per token    {c.mask_per_token:>16,} B",
        f"  => bytes(T) = {c.fixed:,} + {c.per_token:,} x T;  at {plan.context:,} tokens: "
        f"{human(sequence_bytes(c.fixed, c.per_token, plan.context))}",
        "",
    ]
    if plan.budget <= 0:
        lines.append(f"the weights alone ({human(plan.weights_bytes)}) do not fit in {human(plan.gpu_bytes)}: "
                     "no room for a cache on one GPU (shard the weights, or pass --weights-dtype none to plan the "
                     "cache of one GPU that holds no weights)")
        lines.append("")
    # "fixed part" and "total @ N tok" are two columns: a bare "fixed" next to "at N tok" read as one header
    at_ctx = f"total @ {plan.context:,} tok"
    w_at = max(15, len(at_ctx) + 2)
    head = f"  {'cache':<26} {'per token':>11} {'fixed part':>12} {at_ctx:>{w_at}} " \
           f"{'max context (batch 1)':>22} {'max batch @ ctx':>16}"
    lines += [f"comparison (cache dtype {_dtype_name(c.cache_dtype_bytes)}; MHA: {c.mha_heads} heads x "
              f"{c.mha_head_values} K+V values per layer):", head, "  " + "-" * (len(head) - 2)]
    for name, r in plan.rows().items():
        lines.append(f"  {VARIANT_LABELS[name]:<26} {r['per_token']:>9,} B {human(r['fixed']):>12} "
                     f"{human(r['at_context']):>{w_at}} {r['max_context']:>22,} {r['max_batch']:>16,}")
    return "\n".join(lines)


def _dtype_name(size: int) -> str:
    return {2: "bf16/fp16", 4: "fp32"}.get(size, f"{size} B")


def require_matplotlib() -> None:
    """Raise PlanError (with the pip line) if matplotlib, which :func:`plot_plan` needs, is not installed."""
    from importlib import import_module

    try:
        import_module("matplotlib")
    except ImportError:
        raise PlanError('the plot needs matplotlib: pip install -e ".[bench]" (or pip install matplotlib)') from None


def plot_plan(plan: MemoryPlan, path: str, max_context: int = 1 << 20) -> str:
    """Write a PNG of the cache bytes of one sequence (batch 1) against context for the three caches, log-log,
    with the room the GPU leaves for the cache (GPU - weights - reserve) as a horizontal line and each cache's
    size at ``max_context`` written at the right end; returns the path. Needs matplotlib
    (``pip install -e ".[bench]"``); raises PlanError without it."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    ctx: List[int] = []
    t = 1024
    while t < max_context:
        ctx.append(t)
        t *= 2
    ctx.append(max_context)
    fig, ax = plt.subplots(figsize=(8.5, 5), dpi=110)
    styles = {"hybrid": ("tab:green", "-"), "all_mla": ("tab:blue", "--"), "mha": ("tab:red", ":")}
    rows = plan.rows()
    for name, v in plan.cache.variants().items():
        ys = [sequence_bytes(v["fixed"], v["per_token"], n) / 1e9 for n in ctx]
        color, ls = styles[name]
        ax.plot(ctx, ys, ls, color=color, lw=2.2, label=f"{VARIANT_LABELS[name]}: {v['per_token']:,} B/token"
                + (f" + {human(v['fixed'])} fixed" if v["fixed"] else "")
                + f"; fits {rows[name]['max_context']:,} tokens")
        ax.annotate(human(ys[-1] * 1e9), (ctx[-1], ys[-1]), textcoords="offset points", xytext=(6, -3),
                    color=color, fontsize=9)
    if plan.budget > 0:
        ax.axhline(plan.budget / 1e9, color="black", lw=1.2,
                   label=f"room for the cache: GPU {human(plan.gpu_bytes)} - weights {human(plan.weights_bytes)} "
                         f"({plan.weights_dtype})" + (f" - reserve {human(plan.reserve_bytes)}"
                                                      if plan.reserve_bytes else "")
                         + f" = {human(plan.budget)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(ctx[0], ctx[-1] * 2.2)
    ax.set_xlabel("context (tokens, batch 1)")
    ax.set_ylabel("cache of one sequence (GB)")
    ax.set_title(f"{plan.name}: decoding cache against context")
    ticks = [1 << k for k in range(10, 41, 2) if (1 << k) < max_context] + [max_context]
    ax.set_xticks(ticks)
    ax.set_xticklabels([_short_tokens(x) for x in ticks])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _short_tokens(n: float) -> str:
    n = int(n)
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n >= 1024 else str(n)
