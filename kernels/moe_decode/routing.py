"""The MoE routing decision in one Triton launch: sigmoid (or softmax) scores, the correction bias, grouped top-k,
renormalisation and scaling, one program per token.

Reference: :func:`kimi_hybrid.moe_kimi_hybrid.route_topk` (``naive.naive_route_topk``). Tests:
kernels/tests/test_moe_decode.py (CUDA), tests/test_triton_interpreter.py (interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["route_topk_triton", "route_topk_supports"]


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, scaling, E: tl.constexpr, K: tl.constexpr,
                  G: tl.constexpr, TOPG: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr):
    """Program n: ``logits[n] [E]`` fp32 -> ``w[n] [K]`` fp32, ``idx[n] [K]`` int64, in descending choice order
    (ties: the lower expert id first)."""
    n = tl.program_id(0)
    offs = tl.arange(0, E)
    lg = tl.load(logits_ptr + n * E + offs)
    if SIGMOID:
        scores = tl.sigmoid(lg)
    else:
        ex = tl.exp(lg - tl.max(lg, axis=0))
        scores = ex / tl.sum(ex, axis=0)
    choice = scores + tl.load(bias_ptr + offs)
    if G > 1:
        EG: tl.constexpr = E // G
        grouped = tl.reshape(choice, [G, EG])
        cols = tl.arange(0, EG)
        first = tl.max(grouped, axis=1)
        if EG > 1:
            at = tl.argmax(grouped, axis=1)
            second = tl.max(tl.where(cols[None, :] == at[:, None], float("-inf"), grouped), axis=1)
            group_score = first + second
        else:
            group_score = first
        gids = tl.arange(0, G)
        keep = gids < 0
        for _ in tl.static_range(TOPG):
            best = tl.argmax(tl.where(keep, float("-inf"), group_score), axis=0)
            keep = keep | (gids == best)
        grouped = tl.where(keep[:, None], grouped, float("-inf"))
        choice = tl.reshape(grouped, [E])
    ks = tl.arange(0, K)
    w = tl.zeros([K], dtype=tl.float32)
    ids = tl.zeros([K], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.argmax(choice, axis=0)
        picked = offs == best
        w = tl.where(ks == j, tl.sum(tl.where(picked, scores, 0.0), axis=0), w)
        ids = tl.where(ks == j, best.to(tl.int64), ids)
        choice = tl.where(picked, float("-inf"), choice)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(w_ptr + n * K + ks, w * scaling)
    tl.store(idx_ptr + n * K + ks, ids)


def route_topk_supports(logits: torch.Tensor, *, top_k: int, num_groups: int, topk_group: int, **_) -> bool:
    """Whether :func:`route_topk_triton` serves this routing: ``logits [N, E]`` fp32 with E, k and the group count
    powers of two (k <= E, topk_group <= G)."""
    E = logits.shape[-1]
    pow2 = all(v >= 1 and v & (v - 1) == 0 for v in (E, top_k, num_groups))
    return (logits.dim() == 2 and logits.dtype == torch.float32 and pow2 and top_k <= E and E % num_groups == 0
            and 1 <= topk_group <= num_groups)


def route_topk_triton(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, num_groups: int, topk_group: int,
                      sigmoid: bool, renormalize: bool, scaling: float):
    """The routing of :func:`kimi_hybrid.moe_kimi_hybrid.route_topk` in one launch: ``logits [N, E]`` fp32, ``bias
    [E]`` -> ``(topk_weights [N, k] fp32, topk_idx [N, k] int64)``. No host synchronisation.

    Raises:
        ValueError: a routing it does not serve (see :func:`route_topk_supports`).
    """
    if not route_topk_supports(logits, top_k=top_k, num_groups=num_groups, topk_group=topk_group):
        raise ValueError(f"route_topk_triton: logits {tuple(logits.shape)} {logits.dtype}, k {top_k}, {num_groups} "
                         f"groups (keep {topk_group}): needs fp32 [N, E] with E, k and the group count powers of two")
    N, E = logits.shape
    logits = logits.contiguous()
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        _route_kernel[(N,)](logits, bias.float().contiguous(), w, idx, float(scaling), E=E, K=top_k, G=num_groups,
                            TOPG=topk_group, SIGMOID=bool(sigmoid), RENORM=bool(renormalize and top_k > 1),
                            num_warps=4 if E >= 256 else 1)
    return w, idx
