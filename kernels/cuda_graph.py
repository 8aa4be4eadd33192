# coding=utf-8
"""CUDA-graph decoding for KimiHybrid: one decode step captured with a static cache, replayed per token.

At batch 1 a decode step of this model is a few hundred small kernels (GEMVs, norms, the KDA recurrence, a
grouped expert GEMM); launched one by one from Python they take tens of milliseconds, far above the few hundred
microseconds the GPU needs to read the weights. Capturing the step once in a ``torch.cuda.CUDAGraph`` and replaying
it removes the Python and launch overhead.

Requirements (all met by the model's decode path on CUDA): a static :class:`KimiHybridCache` (every buffer at a
fixed address, positions in a device counter), no host synchronisation inside the step (MoE counts with
``scatter_add_``, grouped GEMM offsets on the device, FLA's ``fused_recurrent_kda``), and kernels autotuned before
capture (warm-up steps run first, then the cache is restored in place).

    cache = prefill_to_static(model, prompt_ids, max_cache_len)     # or any filled static cache
    dec = GraphDecoder(model, cache)                                 # warm-up + capture (compile=True: fused)
    logits = dec.step(next_ids)                                      # [B, V]; the static output buffer

The static cache's length lives in its device counter (``cache.seen_tokens`` reads it, a host
synchronisation); the replayed graph advances it on the device. ``GraphDecoder`` keeps its own host count of the
positions used (``dec.position``), so ``step`` checks the room left without synchronising.
"""

from __future__ import annotations

from typing import Optional

import torch

from kimi_hybrid.cache_kimi_hybrid import KimiHybridCache

__all__ = ["to_static_cache", "prefill_to_static", "GraphDecoder"]


def to_static_cache(cache, max_cache_len: int):
    """Copy a filled dynamic cache into a new static cache of ``max_cache_len`` positions
    (:meth:`KimiHybridCache.to_static`). Raises ValueError if the cache holds more tokens than ``max_cache_len``."""
    return cache.to_static(max_cache_len)


@torch.no_grad()
def prefill_to_static(model, input_ids: torch.Tensor, max_cache_len: int, chunk_size: Optional[int] = None):
    """Prefill ``input_ids [B, T]`` through a dynamic cache (flash / fused kernels, no dense masks), optionally in
    pieces of ``chunk_size`` tokens (bounded activation memory for long prompts), then move it into a static cache.

    Returns ``(static_cache, last_logits [B, V])``."""
    cache = KimiHybridCache(model.config)
    T = input_ids.shape[1]
    step = chunk_size or T
    out = None
    for s in range(0, T, step):
        out = model(input_ids[:, s:s + step], cache=cache, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    st = to_static_cache(cache, max_cache_len)
    del cache
    return st, logits


class GraphDecoder:
    """Replay one captured decode step.

    Args:
        model: a :class:`KimiHybridForCausalLM` on CUDA in eval mode.
        cache: a filled static :class:`KimiHybridCache` on the same device.
        warmup: steps run before capture (Triton autotuning, cuBLAS handles, compilation); the cache is restored
            after.
        compile: run the step through ``torch.compile`` (inductor, default mode) before capturing it. Inductor fuses
            the elementwise work between the GEMMs (norms, conv update, gates, the KDA recurrence itself, which is
            traced from the torch reference under compile) into a few Triton kernels, so the captured graph holds
            far fewer, larger kernels. Costs a compilation on the first warm-up step (tens of seconds).

    Raises:
        ValueError: the cache is not static, is empty, or is full.
    """

    def __init__(self, model, cache, warmup: int = 2, compile: bool = False):
        if not cache.is_compileable:
            raise ValueError("GraphDecoder needs a static KimiHybridCache (max_cache_len=...)")
        if cache.seen_tokens == 0:
            raise ValueError("prefill the cache before capturing a decode step")
        self.model, self.cache = model, cache
        B = cache.batch_size
        dev = next(model.parameters()).device
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        snap = cache.snapshot()
        seen = cache.seen_tokens

        def one_step(ids):
            return model(ids, cache=cache, use_cache=True).logits[:, -1]

        self.compiled = bool(compile)
        fn = torch.compile(one_step, dynamic=False) if compile else one_step
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(max(warmup, 2 if compile else 1)):
                fn(self.ids)
        torch.cuda.current_stream(dev).wait_stream(s)
        cache.restore(snap)  # in place: same buffers and the position counter, the state before the warm-up
        del snap
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self.logits = fn(self.ids)
        cache.seen_tokens = seen  # capture ran no kernel; the Python side of the forward is reset as well
        self.position = seen
        if seen + 1 > cache.max_cache_len:
            raise ValueError("the static cache is full")

    def sync_position(self) -> int:
        """Re-read the cache's device counter into ``position`` (after the cache was restored or written by other
        code than this decoder). One host synchronisation. Returns the position."""
        self.position = self.cache.seen_tokens
        self.cache.seen_tokens = self.position  # the cache's host count too
        return self.position

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed ``input_ids [B, 1]``; returns the logits ``[B, V]`` (a buffer overwritten by the next step).
        No host synchronisation. Raises ValueError when the static cache has no position left."""
        if self.position >= self.cache.max_cache_len:
            raise ValueError(f"the static cache is full ({self.cache.max_cache_len} positions)")
        self.ids.copy_(input_ids)
        self.graph.replay()
        self.cache.count_replayed_tokens(1)
        self.position += 1
        return self.logits
