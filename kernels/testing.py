"""Helpers for the GPU test suites.

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
