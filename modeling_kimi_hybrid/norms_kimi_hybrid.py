# coding=utf-8
"""RMS norms of the Kimi hybrid models (shared by the attention layers, the decoder and the latent MoE)."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["KimiRMSNorm", "KimiGatedRMSNorm"]


class KimiRMSNorm(nn.Module):
    """T5-style RMSNorm: variance in fp32, cast back to the input dtype, then times the weight. ``[..., D]``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class KimiGatedRMSNorm(nn.Module):
    """KDA output norm: ``RMSNorm(o) * weight * sigmoid(gate)`` over the head dim, all in fp32, cast back.
    ``o``, ``gate``: ``[..., H, K]``."""

    def __init__(self, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.variance_epsilon = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = gate.dtype
        h = o.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = h * self.weight.float() * torch.sigmoid(gate.float())
        return h.to(dtype)

