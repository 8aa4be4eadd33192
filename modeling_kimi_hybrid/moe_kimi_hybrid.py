# coding=utf-8
"""MLPs of the Kimi hybrid models: the dense gated MLP and the sparse MoE block (router, fused experts) with its
device paths.

The routed experts run, by size and device:

* ``"kimi_hybrid_gemv"``: decode on CUDA (at most ``MOE_GEMV_MAX_PAIRS`` token-expert pairs, no grad, SiLU-GLU):
  the Triton expert GEMVs of ``kimi_hybrid.kernels.moe_decode`` where ``load_kernel`` finds them;
* ``"kimi_hybrid_grouped_mm"``: pairs sorted by expert, two grouped GEMMs on CUDA where transformers'
  ``_can_use_grouped_mm`` and the GEMM's dtype / width rules allow (:func:`grouped_mm_applies`), batched products
  gathered per row while a CUDA graph is captured, or a loop over the experts that received tokens (CPU, fp32, odd
  widths: the reference).

Both are registered in transformers' ``ExpertsInterface`` (``experts_implementation="kimi_hybrid_gemv"`` picks one
for a whole model); the default ``"eager"`` picks per call by the number of pairs.

Router and expert math follow DeepSeek-V3 / Kimi-Linear (arXiv 2510.26692); K3's latent MoE and SiTU-GLU follow
Kimi K3 (arXiv 2607.24653).
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .configuration_kimi_hybrid import KimiHybridConfig

from transformers.integrations.moe import (
    ExpertsInterface,
    _can_use_grouped_mm,
    use_experts_implementation,
)

from .kda_kimi_hybrid import _compiling
from .kernels_kimi_hybrid import load_kernel
from .lora_experts_kimi_hybrid import expert_adapters
from .norms_kimi_hybrid import KimiRMSNorm

__all__ = ["KimiMLP", "KimiRouter", "KimiExperts", "KimiMoE", "glu_act", "MOE_GEMV_MAX_PAIRS", "grouped_mm_applies",
           "gemv_experts_forward", "grouped_experts_forward", "combine_pairs", "EXPERTS_FUNCTIONS", "route_topk",
           "route_weights"]

MOE_GEMV_MAX_PAIRS = 32  # token-expert pairs; above this the grouped GEMM reads each hit expert once instead


def glu_act(config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of every MLP: SiLU-GLU ``silu(g) * u`` (Kimi-Linear) or SiTU-GLU (K3, fp32):
    ``beta*tanh(g/beta)*sigmoid(g) * beta_lin*tanh(u/beta_lin)`` (beta_lin None: plain u)."""
    if config.hidden_act == "silu":
        return F.silu(gate) * up
    b = config.activation_situ_beta if config.activation_situ_beta is not None else 1.0
    bl = config.activation_situ_linear_beta
    g, u = gate.float(), up.float()
    left = b * torch.tanh(g / b) * torch.sigmoid(g)
    right = u if bl is None else bl * torch.tanh(u / bl)
    return (left * right).to(gate.dtype)


class KimiMLP(nn.Module):
    """Dense gated MLP (layer 0, and the shared experts): ``down(act(gate(x), up(x)))``. ``[..., D] -> [..., D]``."""

    def __init__(self, config: KimiHybridConfig, intermediate_size: Optional[int] = None):
        super().__init__()
        self.config = config
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_act(self.config, self.gate_proj(x), self.up_proj(x)))


# ----------------------------------------------------------------------------------------------------------------
# expert device paths: which one applies, and the grouped / looped expert MLP
# ----------------------------------------------------------------------------------------------------------------

def _gemv_kernel(config, x, gate_up, down, pairs):
    """The Triton expert GEMV (``moe_decode_gemv``) where it serves this call, else None: CUDA, at most
    ``MOE_GEMV_MAX_PAIRS`` pairs, SiLU-GLU, no autograd, contiguous weights, and the kernel present."""
    if not (x.is_cuda and pairs <= MOE_GEMV_MAX_PAIRS and config.hidden_act == "silu"
            and gate_up.is_contiguous() and down.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (gate_up.requires_grad or down.requires_grad or x.requires_grad):
        return None
    ops = load_kernel("moe_decode")
    return None if ops is None else ops.moe_decode_gemv


def _grouped_gemm_fn():
    """``torch.nn.functional.grouped_mm`` (torch >= 2.10) or ``torch._grouped_mm`` (2.8 / 2.9), else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_applies(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offs: torch.Tensor) -> bool:
    """Whether the CUDA grouped GEMM serves ``xs [M, D]`` against ``gate_up [E, 2F, D]`` / ``down [E, D, F]``:
    transformers' ``_can_use_grouped_mm`` (torch build, compute capability, compile rules) and the GEMM's own
    rules: bf16 operands (the dtype its CUDA kernels serve on every torch of our window), D and F multiples of 8
    (16-byte row strides), unit inner strides and 16-byte aligned bases."""
    if not (xs.is_cuda and xs.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        return False
    if down.shape[1] % 8 or down.shape[2] % 8 or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        return False
    # (data_ptr is opaque to torch.compile; traced tensors come from the caching allocator, 512-byte aligned)
    if not _compiling() and any(t.data_ptr() % 16 for t in (xs, gate_up, down)):
        return False
    return _can_use_grouped_mm(xs, gate_up, offs)


def _grouped_expert_mlp(config, xs, gate_up, down, counts, F_, row_w=None, adapters=None):
    """Routed experts on token-expert pairs sorted by expert.

    Args:
        xs: ``[M, D]`` inputs, rows sorted by expert (expert e owns ``counts[e]`` consecutive rows).
        gate_up: ``[E, 2F, D]`` fused w1 | w3. down: ``[E, D, F]`` (w2). counts: ``[E]`` int64 on xs.device.
        F_: expert intermediate width F.
        row_w: ``[M]`` routing weight of each row (any float dtype), multiplied into the activation before the
            down projection (so the combine is a plain sum), or None.
        adapters: ``(gate_up_terms, down_terms)``, each a sequence of LoRA terms ``(a [E, r, in], b [E, out, r],
            scaling)`` added as split low-rank products ``scaling * (x a_e^T) b_e^T`` (W + b a is never formed),
            or None.

    Returns:
        ``[M, D]`` in xs.dtype: ``w * down_e(act(gate_e(x), up_e(x)))`` for each row's expert (w = 1 without
        ``row_w``).

    On CUDA with bf16 weights this is two grouped GEMMs (``F.grouped_mm``/``torch._grouped_mm``, one CUTLASS launch
    each over all experts; empty experts cost nothing and read no weights), plus two thin grouped GEMMs per LoRA
    term, with the group ends ``offs`` kept on the device: no host synchronisation, so batch-1 decode neither loops
    over experts in Python nor blocks, and the step can be CUDA-graph captured. Elsewhere (CPU, fp32, odd widths)
    a loop over the experts that received tokens only.
    """
    gu_terms, dn_terms = adapters if adapters is not None else ((), ())
    gm = _grouped_gemm_fn()
    offs = counts.cumsum(0).to(torch.int32)
    if (gm is not None and xs.shape[0] > 0 and grouped_mm_applies(xs, gate_up, down, offs)
            and _terms_grouped_ok(gu_terms, dn_terms, xs.dtype)):
        h = _grouped_split(gm, xs, gate_up, gu_terms, offs)  # [M, 2F]
        h = _weigh_rows(glu_act(config, h[:, :F_], h[:, F_:]), row_w)
        return _grouped_split(gm, h, down, dn_terms, offs)  # [M, D]
    if _compiling() or (xs.is_cuda and torch.cuda.is_current_stream_capturing()):
        # torch.compile / torch.export (any device) and CUDA-graph capture: no host read of the token counts
        if xs.is_cuda or adapters is not None or (
                torch.is_grad_enabled() and any(t.requires_grad for t in (xs, gate_up, down))):
            # (CUDA: the graph that a compiled CUDA-graph step warms up must be the one captured; with autograd or
            # adapters: differentiable) gather each row's expert weights and use batched products: reads M expert
            # matrices, meant for decode-sized M
            M = xs.shape[0]
            eid = torch.repeat_interleave(torch.arange(counts.numel(), device=xs.device), counts, output_size=M)
            h = _gathered_split(xs, gate_up, gu_terms, eid)  # [M, 2F]
            h = _weigh_rows(glu_act(config, h[:, :F_], h[:, F_:]), row_w)
            return _gathered_split(h, down, dn_terms, eid)
        # CPU inference: the expert loop below as one opaque operator (a custom op: traced as a single node with a
        # shape-only fake implementation), so the graph has no break and computes exactly what eager does
        beta, beta_lin = _situ_betas(config)
        row_w = xs.new_ones(xs.shape[0]) if row_w is None else row_w
        return _routed_experts_op(xs, gate_up, down, counts, row_w, config.hidden_act, beta, beta_lin)
    return _expert_loop(xs, gate_up, down, counts, lambda g, u: glu_act(config, g, u), row_w, gu_terms, dn_terms)


def _weigh_rows(h, row_w):
    """``h [M, F] * row_w [M, 1]`` in h.dtype (``row_w`` None: h)."""
    return h if row_w is None else h * row_w.to(h.dtype).unsqueeze(-1)


def _terms_grouped_ok(gu_terms, dn_terms, dtype) -> bool:
    """Whether the grouped GEMM takes these LoRA terms: factors in ``dtype``, ranks a multiple of 8 (the
    ``[M, r]`` intermediate's 16-byte row stride in bf16) and a unit inner stride."""
    return all(a.dtype == b.dtype == dtype and a.shape[1] % 8 == 0 and a.stride(-1) == 1 and b.stride(-1) == 1
               for a, b, _ in (*gu_terms, *dn_terms))


def _grouped_split(gm, x, w, terms, offs):
    """``x [M, in]`` sorted by expert against ``w [E, out, in]`` plus the split LoRA ``terms``: ``[M, out]``."""
    y = gm(x, w.transpose(1, 2), offs=offs)
    for a, b, scaling in terms:
        t = gm(x, a.transpose(1, 2), offs=offs) * scaling  # [M, r]: the scale on the thin product
        y = y + gm(t, b.transpose(1, 2), offs=offs)
    return y


def _gathered_split(x, w, terms, eid):
    """``_grouped_split`` as batched products over each row's gathered expert matrices (``eid [M]``)."""
    y = torch.bmm(w.index_select(0, eid).to(x.dtype), x.unsqueeze(-1)).squeeze(-1)
    for a, b, scaling in terms:
        t = torch.bmm(a.index_select(0, eid).to(x.dtype), x.unsqueeze(-1)) * scaling  # [M, r, 1]
        y = y + torch.bmm(b.index_select(0, eid).to(x.dtype), t).squeeze(-1)
    return y


def _situ_betas(config):
    """(beta, beta_lin) of SiTU-GLU as floats for the custom op (-1.0 stands for None)."""
    b = config.activation_situ_beta
    bl = config.activation_situ_linear_beta
    return (-1.0 if b is None else float(b)), (-1.0 if bl is None else float(bl))


def _expert_loop(xs, gate_up, down, counts, act, row_w=None, gu_terms=(), dn_terms=()):
    """The reference: one GEMM pair per expert that received tokens (``counts`` read once on the host).
    ``xs [M, D]`` sorted by expert, ``gate_up [E, 2F, D]``, ``down [E, D, F]``, ``act(gate, up)``; ``row_w`` and
    the LoRA terms as in :func:`_grouped_expert_mlp`. Returns ``[M, D]`` in xs.dtype."""
    F_ = down.shape[2]
    out = torch.empty(xs.shape[0], down.shape[1], dtype=xs.dtype, device=xs.device)
    n_of = counts.tolist()  # one host read; then only the experts that received tokens run
    start = 0
    for e, n in enumerate(n_of):
        if n == 0:
            continue
        seg = xs[start:start + n]
        h = _loop_split(seg, gate_up, gu_terms, e)
        h = act(h[:, :F_], h[:, F_:])
        if row_w is not None:
            h = h * row_w[start:start + n].to(h.dtype).unsqueeze(-1)
        out[start:start + n] = _loop_split(h, down, dn_terms, e)
        start += n
    return out


def _loop_split(x, w, terms, e):
    """``x @ w[e]^T`` plus the split LoRA terms of expert e (the loop's form of :func:`_grouped_split`)."""
    y = x @ w[e].t().to(x.dtype)
    for a, b, scaling in terms:
        y = y + ((x @ a[e].t().to(x.dtype)) * scaling) @ b[e].t().to(x.dtype)
    return y


class _ActConfig:
    """The activation fields :func:`glu_act` reads, rebuilt inside the custom op from plain values."""

    def __init__(self, hidden_act, beta, beta_lin):
        self.hidden_act = hidden_act
        self.activation_situ_beta = None if beta < 0 else beta
        self.activation_situ_linear_beta = None if beta_lin < 0 else beta_lin


# one operator name per copy of this file (the installed package and a Hub copy loaded as remote code may both be
# imported in one process, and an operator name can be registered once)
_OP_NAME = "kimi_hybrid_moe::routed_experts_" + re.sub(r"\W", "_", __name__)


def _routed_experts_impl(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor,
                         row_w: torch.Tensor, hidden_act: str, beta: float, beta_lin: float) -> torch.Tensor:
    cfg = _ActConfig(hidden_act, beta, beta_lin)
    return _expert_loop(xs, gate_up, down, counts, lambda g, u: glu_act(cfg, g, u), row_w)


def _routed_experts_fake(xs, gate_up, down, counts, row_w, hidden_act, beta, beta_lin):
    return xs.new_empty(xs.shape[0], down.shape[1])


try:
    _routed_experts_op = torch.library.custom_op(_OP_NAME, mutates_args=())(_routed_experts_impl)
    _routed_experts_op.register_fake(_routed_experts_fake)
except (RuntimeError, ValueError):  # already registered by an earlier import of this very module (reload)
    _routed_experts_op = getattr(getattr(torch.ops, _OP_NAME.split("::")[0]), _OP_NAME.split("::")[1])


# ----------------------------------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------------------------------

class KimiRouter(nn.Module):
    """MoE router (DeepSeek-V3 / Kimi): fp32 logits, sigmoid (or softmax) scores, ``e_score_correction_bias`` added
    for the choice only, grouped top-k, weights = unbiased scores of the chosen experts, renormalised, times
    ``routed_scaling_factor``.

    ``weight [E, D]``, ``e_score_correction_bias [E]`` (fp32 whatever the model dtype).
    Returns ``(router_logits [N, E] fp32, topk_weights [N, k] fp32, topk_idx [N, k] int64)``.
    """

    def __init__(self, config: KimiHybridConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())
        w, idx = self.route(logits)
        return logits, w, idx

    def route(self, logits: torch.Tensor):
        """The routing decision from ``logits [N, E]`` (fp32): ``(topk_weights [N, k] fp32, topk_idx [N, k])``. On
        CUDA (outside ``torch.compile``) the choice is one Triton launch (``kimi_hybrid.kernels.moe_decode``) where
        ``load_kernel`` finds it; with autograd the weights of the chosen experts are then recomputed from the
        logits by :func:`route_weights` (``[N, k]`` elementwise work), so the router's gradient is unchanged.
        Elsewhere :func:`route_topk`."""
        c = self.config
        kw = dict(top_k=self.top_k, num_groups=c.num_expert_group if c.use_grouped_topk else 1,
                  topk_group=c.topk_group, sigmoid=c.moe_router_activation_func == "sigmoid",
                  renormalize=c.moe_renormalize, scaling=c.routed_scaling_factor)
        bias = self.e_score_correction_bias
        kernel = load_kernel("moe_decode") if logits.is_cuda and not _compiling() else None
        if kernel is not None and kernel.route_topk_supports(logits, **kw):
            if not (torch.is_grad_enabled() and logits.requires_grad):
                return kernel.route_topk_triton(logits, bias, **kw)
            with torch.no_grad():
                _, idx = kernel.route_topk_triton(logits.detach(), bias, **kw)
            return route_weights(logits, idx, sigmoid=kw["sigmoid"], renormalize=kw["renormalize"],
                                 scaling=kw["scaling"]), idx
        return route_topk(logits, bias, **kw)


def route_weights(logits: torch.Tensor, idx: torch.Tensor, *, sigmoid: bool, renormalize: bool, scaling: float):
    """The routing weights of the chosen experts ``idx [N, k]`` from ``logits [N, E]`` fp32 (differentiable):
    their unbiased scores (sigmoid, or softmax over all E), divided by their sum (+1e-20) if ``renormalize`` and
    k > 1, times ``scaling``. ``[N, k]`` fp32, as in :func:`route_topk`."""
    w = logits.gather(1, idx).sigmoid() if sigmoid else logits.softmax(-1).gather(1, idx)
    if idx.shape[-1] > 1 and renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling


def route_topk(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, num_groups: int, topk_group: int,
               sigmoid: bool, renormalize: bool, scaling: float):
    """DeepSeek-V3 / Kimi routing: ``logits [N, E]`` fp32 -> ``(topk_weights [N, k] fp32, topk_idx [N, k] int64)``.

    Scores ``sigmoid(logits)`` (or softmax); the choice adds ``bias [E]`` (``e_score_correction_bias``); with
    ``num_groups`` G > 1 only the ``topk_group`` groups with the largest sum of their top-2 choice scores compete;
    the weights are the unbiased scores of the chosen experts (in descending choice order), divided by their sum
    (+1e-20) if ``renormalize`` and k > 1, times ``scaling`` (:func:`route_weights`)."""
    E = logits.shape[-1]
    scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
    choice = scores + bias.float()
    if num_groups > 1:
        grouped = choice.view(-1, num_groups, E // num_groups)
        top = min(2, grouped.shape[-1])
        group_scores = grouped.topk(top, dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    idx = choice.topk(top_k, dim=-1).indices
    return route_weights(logits, idx, sigmoid=sigmoid, renormalize=renormalize, scaling=scaling), idx


@use_experts_implementation
class KimiExperts(nn.Module):
    """Routed experts stored fused: ``gate_up_proj [E, 2F, D_e]`` (rows [:F] = w1 gate, [F:] = w3 up) and
    ``down_proj [E, D_e, F]`` (w2). Input ``x [N, D_e]``, ``topk_idx / topk_w [N, k]``; output ``[N, D_e]`` in
    x.dtype.

    ``config.experts_implementation`` (transformers' switch) picks the forward from transformers'
    ``ExpertsInterface``: ``"eager"`` (the default: this model's per-call choice), ``"kimi_hybrid_gemv"`` /
    ``"kimi_hybrid_grouped_mm"`` (this file's two implementations), or transformers' ``"batched_mm"`` /
    ``"grouped_mm"`` over the same weights (:meth:`_apply_gate` gives them this model's GLU).
    """

    def __init__(self, config: KimiHybridConfig, in_dim: int):
        super().__init__()
        self.config = config
        E, F_ = config.num_experts, config.moe_intermediate_size
        self.num_experts, self.intermediate = E, F_
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, in_dim))
        self.down_proj = nn.Parameter(torch.empty(E, in_dim, F_))

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        """This model's GLU on ``[S, 2F]`` (gate | up) for transformers' expert implementations: ``[S, F]``.
        F is read from the tensor: under tensor parallelism each rank holds ``2F / tp`` columns (its gate | up
        slices)."""
        F_ = gate_up_out.shape[-1] // 2
        return glu_act(self.config, gate_up_out[..., :F_], gate_up_out[..., F_:])

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """``"eager"``: this model's choice per call, the expert GEMVs for decode-sized calls (at most
        ``MOE_GEMV_MAX_PAIRS`` token-expert pairs), the grouped path otherwise."""
        impl = "kimi_hybrid_gemv" if topk_idx.numel() <= MOE_GEMV_MAX_PAIRS else "kimi_hybrid_grouped_mm"
        return EXPERTS_FUNCTIONS[impl](self, x, topk_idx, topk_w)

    def local_routes(self, topk_idx: torch.Tensor, topk_w: torch.Tensor):
        """``(topk_idx, topk_w)`` with the routes to another rank's experts (transformers' expert-parallel sentinel
        id ``num_experts``, weight 0) sent to local expert 0 with weight 0, so every id indexes this rank's
        weights; unchanged without expert parallelism."""
        if not getattr(self, "_is_expert_parallel", False):
            return topk_idx, topk_w
        off_rank = topk_idx >= self.num_experts
        return topk_idx.masked_fill(off_rank, 0), topk_w.masked_fill(off_rank, 0.0)


def grouped_experts_forward(experts: KimiExperts, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_w: torch.Tensor, adapters=None) -> torch.Tensor:
    """Routed experts with pairs sorted by expert (``"kimi_hybrid_grouped_mm"``): ``x [N, D]``, ``topk_idx`` /
    ``topk_w [N, k]`` -> ``[N, D]`` in x.dtype. Two grouped GEMMs on CUDA, the expert loop elsewhere
    (:func:`_grouped_expert_mlp`); each pair's routing weight multiplies its activation before the down projection,
    and each token's k output rows are summed through a gather (:func:`combine_pairs`). ``adapters``: split LoRA
    terms (see :func:`_grouped_expert_mlp`; :func:`~.lora_experts_kimi_hybrid.expert_adapters` finds PEFT's). No
    host synchronisation on CUDA."""
    N, k = topk_idx.shape
    topk_idx, topk_w = experts.local_routes(topk_idx, topk_w)
    gate_up, down = experts.gate_up_proj, experts.down_proj  # read once: PEFT target_parameters adapts them here
    # the widths come from the weights, not the config: tensor parallelism leaves each rank gate_up [E, 2F/tp, D]
    # (its slice of the gate rows, then of the up rows) and down [E, D, F/tp]
    F_ = gate_up.shape[1] // 2
    flat = topk_idx.reshape(-1)
    order = flat.argsort(stable=True)
    xs = x[order // k]
    # scatter_add, not bincount: bincount synchronises with the host on CUDA (it reads max()), which would break
    # CUDA-graph capture of a decode step
    counts = torch.zeros(experts.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    ys = _grouped_expert_mlp(experts.config, xs, gate_up, down, counts, F_, row_w=topk_w.reshape(-1)[order],
                             adapters=adapters)
    return combine_pairs(ys, order, k)


def combine_pairs(ys: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's sum of its k expert rows: ``ys [N*k, D]`` (rows in expert order, ``order [N*k]`` the pair
    index of each row, pair ``n*k + j`` = token n's j-th choice) -> ``[N, D]`` in ys.dtype. The inverse
    permutation gathers every token's rows next to each other, then one reduction sums them (fp32 accumulation
    inside the reduction on CUDA), so there is no atomic scatter and no fp32 buffer of the rows."""
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return ys.index_select(0, inv).view(-1, k, ys.shape[-1]).sum(1)


def gemv_experts_forward(experts: KimiExperts, x: torch.Tensor, topk_idx: torch.Tensor,
                         topk_w: torch.Tensor) -> torch.Tensor:
    """Routed experts as Triton expert GEMVs reading each chosen expert in place (``"kimi_hybrid_gemv"``), where
    they serve the call (see :func:`_gemv_kernel`); :func:`grouped_experts_forward` otherwise. Same contract."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    kernel = _gemv_kernel(experts.config, x, gate_up, down, topk_idx.numel())
    if kernel is None:
        return grouped_experts_forward(experts, x, topk_idx, topk_w)
    topk_idx, topk_w = experts.local_routes(topk_idx, topk_w)
    return kernel(x, topk_idx, topk_w, gate_up, down)


# this model's expert implementations, also registered in transformers' registry (``experts_implementation=...``)
EXPERTS_FUNCTIONS = {"kimi_hybrid_gemv": gemv_experts_forward, "kimi_hybrid_grouped_mm": grouped_experts_forward}
for _name, _fn in EXPERTS_FUNCTIONS.items():
    ExpertsInterface.register(_name, _fn)


class KimiMoE(nn.Module):
    """Sparse MoE block (``block_sparse_moe`` in the released checkpoints, ``mlp`` here).

    ``y = sum_k w_k expert_{e_k}(x) + shared(x)``; with K3's latent MoE (``routed_expert_hidden_size`` set) the
    routed experts run on ``z = routed_expert_down_proj(x)`` and their combined output goes through
    ``routed_expert_norm`` (if ``latent_moe_use_norm``) and ``routed_expert_up_proj`` before the shared experts are
    added. ``[B, T, D] -> [B, T, D]``.
    """

    def __init__(self, config: KimiHybridConfig):
        super().__init__()
        self.config = config
        L = config.routed_expert_hidden_size
        self.latent = L is not None
        self.gate = KimiRouter(config)
        self.experts = KimiExperts(config, L if self.latent else config.hidden_size)
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, L, bias=False)
            self.routed_expert_up_proj = nn.Linear(L, config.hidden_size, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = KimiRMSNorm(L, eps=config.rms_norm_eps)
        if config.num_shared_experts:
            self.shared_experts = KimiMLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, w, idx = self.gate(flat)
        z = self.routed_expert_down_proj(flat) if self.latent else flat
        y = self._routed_experts(z, idx, w)
        if self.latent:
            if self.config.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.config.num_shared_experts:
            y = y + self.shared_experts(flat)
        return y.view(shape)

    def _routed_experts(self, z, idx, w):
        """The routed experts on ``z [N, D_e]``: PEFT LoRA adapters on the expert weights (``target_parameters``)
        as split low-rank products in the grouped path where :func:`expert_adapters` finds them and this model's
        expert implementation runs; otherwise the module as it is (PEFT's own ``ParamWrapper`` forward)."""
        found = expert_adapters(self.experts, KimiExperts)
        impl = self.config._experts_implementation  # transformers' switch, as its ``use_experts_implementation``
        if found is None or not any(found[1]) or impl not in (None, "eager", *EXPERTS_FUNCTIONS):
            return self.experts(z, idx, w)
        experts, adapters = found
        return grouped_experts_forward(experts, z, idx, w, adapters=adapters)
