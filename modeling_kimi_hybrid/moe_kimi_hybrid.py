# coding=utf-8
"""MLPs of the Kimi hybrid models: the dense gated MLP and the sparse MoE block (router, fused experts) with its
device paths.

The routed experts run, by size and device:

* decode on CUDA (at most ``MOE_GEMV_MAX_PAIRS`` token-expert pairs, no grad, SiLU-GLU): the Triton expert GEMVs of
  ``kimi_hybrid.kernels.moe_gemv`` when the package and triton are installed;
* otherwise pairs are sorted by expert and run as two grouped GEMMs on CUDA (``torch.nn.functional.grouped_mm`` /
  ``torch._grouped_mm``, eligibility in ``_grouped_mm_ok``), as batched products gathered per row while a CUDA
  graph is captured, or as a loop over the experts that received tokens (CPU, fp32, odd widths: the reference).

Router and expert math follow DeepSeek-V3 / Kimi-Linear (arXiv 2510.26692); K3's latent MoE and SiTU-GLU follow
Kimi K3 (arXiv 2607.24653).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .configuration_kimi_hybrid import KimiHybridConfig
from .kda_kimi_hybrid import _compiling
from .norms_kimi_hybrid import KimiRMSNorm

# Our Triton expert GEMVs are used by the installed package only: a Hub copy of this file (loaded by transformers as
# remote code) stays self-contained and never imports kimi_hybrid, even where it is installed. (A try block, not
# only `if`: transformers' remote-code loader requires every import outside try blocks to be installed; CPU-only
# installs have no triton.)
moe_decode_gemv = None
_MOE_TRITON = False
if __name__.startswith("kimi_hybrid."):
    try:
        from kimi_hybrid.kernels.moe_gemv import moe_decode_gemv

        _MOE_TRITON = True
    except Exception:  # noqa: BLE001
        pass

__all__ = ["KimiMLP", "KimiRouter", "KimiExperts", "KimiMoE", "glu_act", "MOE_GEMV_MAX_PAIRS"]

MOE_GEMV_MAX_PAIRS = 32  # token-expert pairs; above this the grouped GEMM reads each hit expert once instead
_MOE_TRITON_ENABLED = os.environ.get("KIMI_HYBRID_DISABLE_MOE_GEMV", "0") != "1"


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

def _moe_gemv_applies(config, x, gate_up, down, pairs) -> bool:
    return (_MOE_TRITON and _MOE_TRITON_ENABLED and x.is_cuda and pairs <= MOE_GEMV_MAX_PAIRS
            and config.hidden_act == "silu" and not (torch.is_grad_enabled() and
                                                     (gate_up.requires_grad or down.requires_grad or x.requires_grad))
            and gate_up.is_contiguous() and down.is_contiguous())


def _grouped_gemm_fn():
    """``torch.nn.functional.grouped_mm`` (torch >= 2.10) or ``torch._grouped_mm`` (2.8 / 2.9), else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_ok(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the CUDA grouped GEMM applies: bf16 operands (the dtype its CUTLASS kernels serve on every torch
    of our window), every row stride a multiple of 16 bytes (D and F multiples of 8) and 16-byte aligned bases,
    compute capability >= 8.0 (9.0 for torch < 2.9)."""
    if not (xs.is_cuda and xs.dtype == torch.bfloat16 and gate_up.dtype == torch.bfloat16
            and down.dtype == torch.bfloat16):
        return False
    D, F_ = down.shape[1], down.shape[2]
    if D % 8 or F_ % 8:
        return False
    # (data_ptr is opaque to torch.compile; traced tensors come from the caching allocator, 512-byte aligned)
    if not _compiling() and any(t.data_ptr() % 16 for t in (xs, gate_up, down)):
        return False
    if not (gate_up.stride(-1) == 1 and down.stride(-1) == 1):
        return False
    major, minor = torch.cuda.get_device_capability(xs.device)
    return (major, minor) >= (8, 0) if hasattr(F, "grouped_mm") or _torch_at_least(2, 9) else major == 9


def _torch_at_least(major: int, minor: int) -> bool:
    v = torch.__version__.split("+")[0].split(".")
    try:
        return (int(v[0]), int(v[1])) >= (major, minor)
    except ValueError:  # pragma: no cover
        return True


def _grouped_expert_mlp(config, xs, gate_up, down, counts, F_):
    """Routed experts on token-expert pairs sorted by expert.

    Args:
        xs: ``[M, D]`` inputs, rows sorted by expert (expert e owns ``counts[e]`` consecutive rows).
        gate_up: ``[E, 2F, D]`` fused w1 | w3. down: ``[E, D, F]`` (w2). counts: ``[E]`` int64 on xs.device.
        F_: expert intermediate width F.

    Returns:
        ``[M, D]`` in xs.dtype: ``down_e(act(gate_e(x), up_e(x)))`` for each row's expert.

    On CUDA with bf16 weights this is two grouped GEMMs (``F.grouped_mm``/``torch._grouped_mm``, one CUTLASS launch
    each over all experts; empty experts cost nothing and read no weights), with the group ends ``offs`` kept on the
    device: no host synchronisation, so batch-1 decode neither loops over experts in Python nor blocks, and the step
    can be CUDA-graph captured. Elsewhere (CPU, fp32, odd widths) a loop over the experts that received tokens only.
    """
    gm = _grouped_gemm_fn()
    if gm is not None and xs.shape[0] > 0 and _grouped_mm_ok(xs, gate_up, down):
        offs = counts.cumsum(0).to(torch.int32)
        h = gm(xs, gate_up.transpose(1, 2), offs=offs)  # [M, 2F]
        h = glu_act(config, h[:, :F_], h[:, F_:])
        return gm(h.contiguous(), down.transpose(1, 2), offs=offs)  # [M, D]
    if xs.is_cuda and (_compiling() or torch.cuda.is_current_stream_capturing()):
        # (under torch.compile too: the graph that a compiled CUDA-graph step warms up must be the one captured)
        # CUDA-graph capture without the grouped GEMM (fp32, odd widths): no host read is allowed, so gather each
        # row's expert weights and use batched products (decode-sized M only: it reads M expert matrices)
        M = xs.shape[0]
        eid = torch.repeat_interleave(torch.arange(counts.numel(), device=xs.device), counts, output_size=M)
        h = torch.bmm(gate_up.index_select(0, eid).to(xs.dtype), xs.unsqueeze(-1)).squeeze(-1)  # [M, 2F]
        h = glu_act(config, h[:, :F_], h[:, F_:])
        return torch.bmm(down.index_select(0, eid).to(h.dtype), h.unsqueeze(-1)).squeeze(-1)
    out = torch.empty(xs.shape[0], down.shape[1], dtype=xs.dtype, device=xs.device)
    n_of = counts.tolist()  # one host read; then only the experts that received tokens run
    start = 0
    for e, n in enumerate(n_of):
        if n == 0:
            continue
        seg = xs[start:start + n]
        h = seg @ gate_up[e].t().to(seg.dtype)
        h = glu_act(config, h[:, :F_], h[:, F_:])
        out[start:start + n] = h @ down[e].t().to(h.dtype)
        start += n
    return out


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
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if c.moe_router_activation_func == "sigmoid" else logits.softmax(-1)
        choice = scores + self.e_score_correction_bias.float()
        G = c.num_expert_group if c.use_grouped_topk else 1
        if G > 1:
            grouped = choice.view(-1, G, self.num_experts // G)
            top = min(2, grouped.shape[-1])
            group_scores = grouped.topk(top, dim=-1).values.sum(-1)
            keep = group_scores.topk(c.topk_group, dim=-1).indices
            gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~gmask.repeat_interleave(self.num_experts // G, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.top_k > 1 and c.moe_renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, w * c.routed_scaling_factor, idx


class KimiExperts(nn.Module):
    """Routed experts stored fused: ``gate_up_proj [E, 2F, D_e]`` (rows [:F] = w1 gate, [F:] = w3 up) and
    ``down_proj [E, D_e, F]`` (w2). Token-expert pairs are sorted by expert and each expert that received tokens
    runs one GEMM on its contiguous slice (a grouped GEMM on CUDA when ``torch._grouped_mm`` is available); the
    combine multiplies by the routing weight and sums in fp32, as the official code does.

    Input ``x [N, D_e]``, ``topk_idx / topk_w [N, k]``; output ``[N, D_e]`` in x.dtype.
    """

    def __init__(self, config: KimiHybridConfig, in_dim: int):
        super().__init__()
        self.config = config
        E, F_ = config.num_experts, config.moe_intermediate_size
        self.num_experts, self.intermediate = E, F_
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, in_dim))
        self.down_proj = nn.Parameter(torch.empty(E, in_dim, F_))

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        N, k = topk_idx.shape
        gate_up = self.gate_up_proj  # read once: PEFT target_parameters returns the adapted tensor here
        down = self.down_proj
        if _moe_gemv_applies(self.config, x, gate_up, down, N * k):
            return moe_decode_gemv(x, topk_idx, topk_w, gate_up, down)
        flat = topk_idx.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // k
        xs = x[token_of]
        # scatter_add, not bincount: bincount synchronises with the host on CUDA (it reads max()), which would
        # break CUDA-graph capture of a decode step
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        ys = _grouped_expert_mlp(self.config, xs, gate_up, down, counts, self.intermediate)
        ys = ys.float() * topk_w.reshape(-1)[order].unsqueeze(-1).float()
        out = torch.zeros(N, x.shape[-1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, ys)
        return out.to(x.dtype)


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
        y = self.experts(z, idx, w)
        if self.latent:
            if self.config.latent_moe_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.config.num_shared_experts:
            y = y + self.shared_experts(flat)
        return y.view(shape)
