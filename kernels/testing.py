"""Helpers for the GPU test suites (Triton autotuning limited to one config, error metrics, KDA inputs).

``limit_triton_autotuning``: FLA's kernels are ``triton.autotune``-d over tens of configs and re-tuned for every new
key (head dims, dtypes, and length-dependent values), which costs tens of seconds per test case on a cold machine
(a full kernels/tests run did not finish in 300 s on an H200). Correctness does not depend on the config chosen, so
the test sessions keep only the first config that survives each kernel's own pruning: one compile and no timing
sweep per key. Benchmarks never call this. Set ``KIMI_HYBRID_FULL_AUTOTUNE=1`` to test with full autotuning.
"""

from __future__ import annotations

import os


def limit_triton_autotuning() -> bool:
    """Patch ``triton.runtime.autotuner.Autotuner.prune_configs`` to return at most one config. Returns True if
    patched (False: no triton, or ``KIMI_HYBRID_FULL_AUTOTUNE=1``). Idempotent."""
    if os.environ.get("KIMI_HYBRID_FULL_AUTOTUNE", "0") == "1":
        return False
    try:
        from triton.runtime.autotuner import Autotuner
    except Exception:  # noqa: BLE001 - no triton: nothing is autotuned
        return False
    if getattr(Autotuner.prune_configs, "_kimi_hybrid_one_config", False):
        return True
    original = Autotuner.prune_configs

    def prune_configs(self, *args, **kwargs):
        return list(original(self, *args, **kwargs))[:1]

    prune_configs._kimi_hybrid_one_config = True
    Autotuner.prune_configs = prune_configs
    return True


def rel_err(a, b) -> float:
    """Relative L2 error ``||a - b|| / ||b||`` in fp32 (denominator floored at 1e-12)."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def grad_rel_err(a, b, floor: float = 1e-3) -> float:
    """Relative L2 error of a gradient with an RMS floor: a gradient that is zero in exact arithmetic (dg of the
    first token without an initial state) is rounding noise on both sides, and a plain relative error divides by
    that noise."""
    import torch

    a, b = a.float(), b.float()
    return ((a - b).norm() / torch.maximum(b.norm(), torch.tensor(floor * b.numel() ** 0.5, device=b.device))).item()


def kda_inputs(B, T, H, K, V, seed=0, state=False, N=None, grad=False, device="cuda"):
    """Random KDA inputs at the released checkpoints' gate statistics: ``[q, k, v, g, beta, h0 | None]`` with bf16
    q / k / v / beta, fp32 log-space gate ``g`` (``kda_gate``), fp32 state ``h0 [N or B, H, K, V]`` if ``state``;
    all leaves require grad if ``grad``."""
    import torch

    from kimi_hybrid.kda_kimi_hybrid import kda_gate

    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, K, device=device, generator=g).bfloat16()
    k = torch.randn(B, T, H, K, device=device, generator=g).bfloat16()
    v = torch.randn(B, T, H, V, device=device, generator=g).bfloat16()
    A_log = torch.empty(H, device=device).uniform_(1, 16, generator=g).log()
    dt = torch.empty(H * K, device=device).uniform_(-7, -2, generator=g).exp()
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    gate = kda_gate(torch.randn(B, T, H, K, device=device, generator=g), A_log, dt_bias)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device, generator=g)).bfloat16()
    h0 = torch.randn(N or B, H, K, V, device=device, generator=g) * 0.1 if state else None
    ts = [q, k, v, gate, beta] + ([h0] if state else [])
    if grad:
        for t in ts:
            t.requires_grad_(True)
    return ts if state else ts + [None]
