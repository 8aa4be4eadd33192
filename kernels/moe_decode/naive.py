"""Plain-PyTorch references of the expert decode kernels: the experts' loop, one (token, expert) pair at a time, and
the bundle's routing (``moe_kimi_hybrid.route_topk``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimi_hybrid.moe_kimi_hybrid import route_topk as naive_route_topk

__all__ = ["naive_moe_decode", "naive_route_topk"]


def naive_moe_decode(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
    """``y[n] = sum_j topk_w[n, j] * down[e] @ (silu(g) * u)``, ``[g | u] = gate_up[e] @ x[n]``, ``e = topk_idx[n, j]``.

    ``x [N, D]``, ``topk_idx / topk_w [N, k]``, ``gate_up [E, 2F, D]``, ``down [E, D, F]``. The products are
    accumulated in fp32 and rounded to x.dtype where the grouped GEMM path rounds them (gate / up outputs, the GLU,
    the down output); the routing weight and the sum over the k choices are fp32. Returns ``[N, D]`` in x.dtype.
    """
    N, k = topk_idx.shape
    F_ = gate_up.shape[1] // 2
    dt = x.dtype
    out = torch.zeros(N, down.shape[1], dtype=torch.float32, device=x.device)
    for n in range(N):
        for j in range(k):
            e = int(topk_idx[n, j])
            h = (gate_up[e].float() @ x[n].float()).to(dt).float()
            glu = (F.silu(h[:F_]) * h[F_:]).to(dt).float()
            y = (down[e].float() @ glu).to(dt).float()
            out[n] += topk_w[n, j].float() * y
    return out.to(dt)
