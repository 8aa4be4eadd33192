# coding=utf-8
"""The decoding engine of KimiHybrid, apart from the model math: CUDA-graph decode steps inside ``generate``, the
explicit graph decoder, static-cache conversion and prefix reuse.

At batch 1 a decode step of this model is a few hundred small kernels; launched one by one from Python they take
tens of milliseconds, far above the time the GPU needs to read the weights. Capturing the step once in a
``torch.cuda.CUDAGraph`` and replaying it removes the Python and launch overhead.

``generate`` on CUDA (:class:`DecodeGraphs`): the prefill runs eagerly into the request's cache; at the first decode
step the cache's state is copied into a static workspace cache of a capacity bucket (a power of two, at least
``min_bucket`` tokens) and the decode step of that (batch, bucket) is captured once and replayed per token. The
workspace is what ``generate`` holds until it returns (beam search reorders it in place; a full bucket moves to the
next one, capturing at most one new graph per bucket); then its state is copied back into the request's cache, so the
caller's cache (or the one in the returned output) holds the result exactly as on the eager path. Graphs and their
workspaces stay cached on the model across calls (``model.cuda_graphs_memory()`` states their bytes,
``model.release_cuda_graphs()`` frees them).

A decode step takes the eager path where a graph would be wrong: output flags (``output_attentions``,
``output_hidden_states``, ``output_router_logits``), more than one new token (prefill, assisted verification), a
cache recording its rollback history (assisted / prompt-lookup decoding: KDA rollback records are written on the
host), a transformers cache that is not a :class:`KimiHybridCache`, ``inputs_embeds``, labels, packing keywords.

The graph object is injectable (:attr:`DecodeGraphs.capture`): :class:`CudaGraphCapture` on CUDA, and
:class:`EagerCapture` (a "capture" that records the step and a "replay" that runs it on the static buffers) lets the
whole machinery run on CPU in the tests.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .cache_kimi_hybrid import KimiHybridCache
from .compat_kimi_hybrid import GENERATION_CACHE_NAME

_CACHE_NAMES = ("past_key_values", "cache")  # generate's cache keyword / output field, by transformers release

__all__ = ["CudaGraphCapture", "DecodeGraphs", "EagerCapture", "GraphDecoder", "check_cache_extends",
           "generate_from_prefix", "generate_with_graphs", "prefill_prefix", "prefill_to_static", "to_static_cache"]


# ----------------------------------------------------------------------------------------------------------------
# static-cache conversion
# ----------------------------------------------------------------------------------------------------------------

def to_static_cache(cache: KimiHybridCache, max_cache_len: int) -> KimiHybridCache:
    """A new static cache of ``max_cache_len`` positions holding the state of the filled ``cache`` (same batch,
    dtype and device; :meth:`KimiHybridCache.to_static`). Raises ValueError if the cache holds more tokens than
    ``max_cache_len``."""
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
        out = model(input_ids[:, s:s + step], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return to_static_cache(cache, max_cache_len), out.logits[:, -1]


# ----------------------------------------------------------------------------------------------------------------
# the graph object (injectable)
# ----------------------------------------------------------------------------------------------------------------

class CudaGraphCapture:
    """Capture ``fn`` (no arguments, returns a tensor) in a ``torch.cuda.CUDAGraph``: ``warmup`` runs on a side
    stream first (Triton autotuning, cuBLAS handles), then the capture. ``__call__(fn, device)`` returns
    ``(replay, output, nbytes)``: ``replay()`` reruns the captured kernels, ``output`` is the static tensor they
    write, ``nbytes`` the device memory the capture took (its private pool)."""

    def __init__(self, warmup: int = 2):
        self.warmup = int(warmup)

    @staticmethod
    def supports(device: torch.device) -> bool:
        """Graphs are captured on CUDA devices only."""
        return device.type == "cuda"

    def __call__(self, fn: Callable[[], torch.Tensor], device: torch.device):
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(max(self.warmup, 1)):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = fn()
        torch.cuda.synchronize(device)
        return graph.replay, out, max(torch.cuda.memory_reserved(device) - before, 0)


class EagerCapture:
    """A stand-in for :class:`CudaGraphCapture` on any device: the "capture" runs ``fn`` once and keeps it, the
    "replay" runs it again on the same static buffers and copies its result into the static output. Every part of
    the graph machinery except ``torch.cuda.CUDAGraph`` itself runs with it (the CPU tests use it)."""

    @staticmethod
    def supports(device: torch.device) -> bool:
        """Any device."""
        return True

    def __call__(self, fn: Callable[[], torch.Tensor], device: torch.device):
        with torch.no_grad():
            out = fn().clone()

        def replay():
            with torch.no_grad():
                out.copy_(fn())

        return replay, out, 0


# ----------------------------------------------------------------------------------------------------------------
# graph decoding inside generate
# ----------------------------------------------------------------------------------------------------------------

class _GraphSlot:
    """One captured decode step: a static workspace cache of ``capacity`` tokens for ``batch`` rows, the input ids
    buffer ``[batch, 1]`` and the captured step writing logits ``[batch, 1, V]``."""

    def __init__(self, model, key: Tuple, batch: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 capture):
        self.key, self.capacity = key, capacity
        self.cache = KimiHybridCache(model.config, max_cache_len=capacity, batch_size=batch, dtype=dtype,
                                     device=device)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        # the step starts from a state with history (warm-up and capture write garbage into it; reset afterwards)
        self.cache.seen_tokens = 1

        def step() -> torch.Tensor:
            return model(input_ids=self.ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits

        self.replay, self.logits, self.graph_bytes = capture(step, device)
        self.cache.reset()

    def nbytes(self) -> int:
        """Bytes held: the workspace cache, the buffers and the graph's pool."""
        return (self.cache.memory_report()["total_bytes"] + self.ids.nbytes + self.logits.nbytes
                + self.graph_bytes)


class DecodeGraphs:
    """The CUDA-graph decode steps of one model, cached per (batch, capacity bucket, dtype, device).

    ``capture``: the graph object (:class:`CudaGraphCapture` by default; :class:`EagerCapture` runs the machinery on
    any device). ``min_bucket``: the smallest capacity in tokens; buckets are powers of two above it up to
    ``bucket_step``, multiples of ``bucket_step`` beyond (see :meth:`bucket`). A request that outgrows its bucket
    moves to the next one and frees the smaller slot of its batch size (one workspace per long request).
    """

    def __init__(self, model, capture=None, min_bucket: int = 1024, bucket_step: int = 16384):
        self.model = model
        self.capture = capture if capture is not None else CudaGraphCapture()
        self.min_bucket = int(min_bucket)
        self.bucket_step = int(bucket_step)
        # size the first bucket for the request's max_length (generate states it), so it never grows mid-request
        self.size_for_request = True
        self._expected: Optional[int] = None
        self._weights: Optional[Tuple] = None  # the parameters the cached graphs were captured over
        self.slots: Dict[Tuple, _GraphSlot] = {}
        self._active = False  # inside a generate call
        self._inside = False  # running the step itself (capture / replay): the forward must not re-enter
        self._origin: Optional[KimiHybridCache] = None
        self._slot: Optional[_GraphSlot] = None
        self._position: Optional[int] = None

    # -- public --------------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True inside a ``generate`` call that decodes with graphs."""
        return self._active

    def supports(self, device: torch.device) -> bool:
        """Whether this device gets graph decode steps."""
        return self.capture.supports(device)

    def bucket(self, tokens: int) -> int:
        """The capacity bucket for ``tokens`` positions: the smallest power of two >= ``tokens`` and ``min_bucket``
        up to ``bucket_step``, above it the next multiple of ``bucket_step`` (a 128K context does not double)."""
        pow2 = max(self.min_bucket, 1 << max(int(tokens) - 1, 0).bit_length())
        if pow2 <= self.bucket_step:
            return pow2
        return -(-int(tokens) // self.bucket_step) * self.bucket_step

    def memory(self) -> Dict[str, Any]:
        """``{"graphs": n, "total_bytes": ..., "slots": [{"batch", "capacity", "dtype", "bytes"}, ...]}``: what the
        cached graphs and their workspaces hold (the graph pool as measured at capture; 0 off CUDA)."""
        slots = [{"batch": k[0], "capacity": k[1], "dtype": str(k[2]), "bytes": s.nbytes()}
                 for k, s in self.slots.items()]
        return {"graphs": len(slots), "total_bytes": sum(s["bytes"] for s in slots), "slots": slots}

    def release(self) -> int:
        """Free every cached graph and workspace; returns the bytes they held. Refused (RuntimeError) inside a
        ``generate`` call."""
        if self._active:
            raise RuntimeError("release_cuda_graphs() inside generate: call it after generate returns")
        freed = self.memory()["total_bytes"]
        self.slots.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    # -- one generate call ---------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a generate call: decode steps may take graphs from now on. Graphs captured over other weights
        (parameters replaced, moved or wrapped since, e.g. by ``model.to`` or an adapter, or another train / eval
        mode) are dropped first: a graph reads the weights at the addresses it was captured with."""
        weights = self._weights_key()
        if weights != self._weights:
            self.slots.clear()
            self._weights = weights
        self._active, self._origin, self._slot, self._position, self._expected = True, None, None, None, None

    def _weights_key(self) -> Tuple:
        model = self.model
        return (model.training, tuple((n, t.data_ptr(), t.dtype) for n, t in model.named_parameters()),
                tuple((n, t.data_ptr()) for n, t in model.named_buffers()))

    def expect_length(self, max_length: Optional[int]) -> None:
        """The generate call's ``max_length`` (prompt + new tokens): the cache holds at most ``max_length - 1``
        tokens, and the first bucket is sized for them (when ``size_for_request``)."""
        if self._active and max_length is not None and self.size_for_request:
            self._expected = int(max_length) - 1

    def end(self) -> Optional[KimiHybridCache]:
        """End a generate call: copy the workspace's state back into the request's cache, which is returned (None
        when no step took a graph)."""
        origin, slot = self._origin, self._slot
        self._active, self._origin, self._slot, self._position = False, None, None, None
        if origin is not None:
            origin.copy_state_from(slot.cache)
            slot.cache.reset()
        return origin

    def workspace(self, cache: Any) -> bool:
        """True for one of this engine's workspace caches."""
        return any(cache is s.cache for s in self.slots.values())

    def step(self, input_ids, cache, eligible: bool):
        """The graph decode step of a forward call, or None where the forward runs eagerly.

        ``eligible``: the forward's other arguments allow a graph (no output flags, labels, embeddings or packing
        keywords; see the module doc). Returns ``(logits [B, 1, V], cache)`` with the workspace cache that
        ``generate`` continues with."""
        if not self._active or self._inside:
            return None
        ok = (eligible and input_ids is not None and input_ids.dim() == 2 and input_ids.shape[1] == 1
              and isinstance(cache, KimiHybridCache) and not cache.is_recording_past() and not cache.offloading
              and self.supports(input_ids.device))
        if not ok:
            if self.workspace(cache):
                self._position = None  # an eager forward moved the workspace: read its length again
            return None
        slot = self._enter(cache, input_ids)
        if slot is None:
            return None
        slot.ids.copy_(input_ids)
        self._inside = True
        try:
            slot.replay()
        finally:
            self._inside = False
        self._position += 1
        return slot.logits, slot.cache

    def _enter(self, cache: KimiHybridCache, input_ids: torch.Tensor) -> Optional[_GraphSlot]:
        """The slot whose workspace holds ``cache``'s state with room for one more token (copying it in at the
        first step, moving to the next bucket when full), or None (eager) for an empty or full static cache."""
        if not self.workspace(cache):
            if self._origin is not None and cache is not self._origin:
                return None  # a second cache in one call (not ours to take over)
            held = cache.seen_tokens  # one host read per generate call
            if held == 0:
                return None
            cap = cache.max_cache_len if cache.is_compileable else self.bucket(max(held + 1, self._expected or 0))
            if held + 1 > cap:
                return None  # the eager step raises the static cache's overflow error
            self._origin, self._position = cache, held
            self._slot = self._get(input_ids.shape[0], cap, input_ids.device)
            self._slot.cache.copy_state_from(cache)
            return self._slot
        if self._position is None:
            self._position = cache.seen_tokens
        slot = self._slot
        if self._position + 1 > slot.capacity:
            if self._origin.is_compileable:
                return None
            new = self._get(input_ids.shape[0], self.bucket(self._position + 1), input_ids.device)
            new.cache.copy_state_from(slot.cache)
            del self.slots[slot.key]  # outgrown: its workspace would only hold memory during this request
            self._slot = slot = new
        return slot

    def _get(self, batch: int, capacity: int, device: torch.device) -> _GraphSlot:
        dtype = self.model.get_input_embeddings().weight.dtype
        key = (batch, capacity, dtype, str(device))
        if key not in self.slots:
            self._inside = True
            try:
                self.slots[key] = _GraphSlot(self.model, key, batch, capacity, dtype, device, self.capture)
            finally:
                self._inside = False
        return self.slots[key]


def _replace_cache(result: Any, work: Callable[[Any], bool], origin: KimiHybridCache) -> Any:
    """``generate``'s result with any workspace cache in it replaced by the request's own cache."""
    for name in _CACHE_NAMES:
        if work(getattr(result, name, None)):
            setattr(result, name, origin)
            if isinstance(result, dict):
                result[name] = origin
    return result


def check_mask_length(ids: torch.Tensor, kwargs: dict) -> None:
    """Refuse a 2-D ``attention_mask`` whose shape is neither the ids' ``[B, T]`` nor, with a filled
    :class:`KimiHybridCache` of P tokens, the whole sequence's ``[B, P + T]`` (checked here: transformers >= 5.24 drops an all-ones mask before the
    forward could see its length).

    Raises:
        ValueError: the mask's shape fits neither form.
    """
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), None)
    if cache is not None and not isinstance(cache, KimiHybridCache):
        return  # (a transformers cache of linear layers reports no length: the forward checks what it can)
    held = cache.get_seq_length() if cache is not None else 0
    B, T = ids.shape
    if mask.shape[0] != B or mask.shape[1] not in (T, held + T):
        forms = f"[{B}, {T}]" + (f" or, with the {held} cached tokens, [{B}, {held + T}]" if held else "")
        raise ValueError(f"generate: attention_mask has shape {tuple(mask.shape)} but the input ids {(B, T)}; it "
                         f"needs one 0/1 column per input token and the input's batch: shape {forms}")


def check_cache_extends(model, args: tuple, kwargs: dict) -> None:
    """Refuse a ``generate`` call whose filled :class:`KimiHybridCache` is not extended by its input: the ids (or
    embeddings) must be the sequence the cache holds plus at least one new token. One host read of the cache's
    length per call; the cache is left untouched when refused.

    Raises:
        ValueError: the input has no more tokens than the cache holds.
    """
    cache = next((kwargs[n] for n in _CACHE_NAMES if kwargs.get(n) is not None), None)
    if not isinstance(cache, KimiHybridCache):
        return
    held = cache.get_seq_length()
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids", kwargs.get("inputs_embeds")))
    if held == 0 or not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        return
    mask = kwargs.get("attention_mask")
    # (transformers' other form: only the new ids, with the mask of the whole sequence)
    length = mask.shape[-1] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else inputs.shape[1]
    if length <= held:
        raise ValueError(
            f"the cache already holds {held} tokens but the input has {length}: generate with a filled cache "
            f"continues it, so pass the whole sequence it holds plus at least one new token (e.g. the sequences the "
            f"previous generate returned, then new ids), or start from a fresh cache (KimiHybridCache(model.config), "
            f"cache.reset(), or a snapshot taken before)")


def generate_with_graphs(model, generate: Callable, args: tuple, kwargs: dict, cuda_graphs: Optional[bool]):
    """Run transformers' ``generate`` (the callable ``generate(*args, **kwargs)``) with graph decode steps when
    ``cuda_graphs`` (None: the generation config's ``cuda_graphs`` field, default True) and the model's device
    supports them; see the module doc."""
    check_cache_extends(model, args, kwargs)
    prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and not prompt.is_floating_point():
        model.get_decoder().check_input_ids(prompt)  # once per call: decode steps read no ids back to the host
        check_mask_length(prompt, kwargs)
    if cuda_graphs is None:
        gc = kwargs.get("generation_config")
        cuda_graphs = getattr(gc, "cuda_graphs", None) if gc is not None else None
        if cuda_graphs is None:
            cuda_graphs = getattr(model.generation_config, "cuda_graphs", None)
    if cuda_graphs is None:
        cuda_graphs = True
    graphs = model.decode_graphs()
    compile_requested = kwargs.get("compile_config") is not None or getattr(
        kwargs.get("generation_config"), "compile_config", None) is not None
    if not cuda_graphs or compile_requested or graphs._active or not graphs.supports(model.device):
        return generate(*args, **kwargs)
    graphs.begin()
    origin = None
    try:
        result = generate(*args, **kwargs)
    finally:
        origin = graphs.end()
    return result if origin is None else _replace_cache(result, graphs.workspace, origin)


# ----------------------------------------------------------------------------------------------------------------
# prefix reuse
# ----------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def prefill_prefix(model, prefix_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None
                   ) -> KimiHybridCache:
    """The cache of ``prefix_ids [1 | B, P]`` (see ``KimiHybridForCausalLM.prefill_prefix``)."""
    cache = KimiHybridCache(model.config)
    model(input_ids=prefix_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    return cache


@torch.no_grad()
def generate_from_prefix(model, prefix_cache: KimiHybridCache, prefix_ids: torch.LongTensor,
                         suffixes: List[torch.LongTensor], **generate_kwargs):
    """``generate`` for the prompts ``prefix + suffix_i`` from a forked prefix cache (see
    ``KimiHybridForCausalLM.generate_from_prefix``)."""
    if prefix_ids.dim() != 2 or prefix_ids.shape[0] != 1:
        raise ValueError(f"prefix_ids must be [1, P], got {tuple(prefix_ids.shape)}")
    P = prefix_ids.shape[1]
    if prefix_cache.get_seq_length() != P or prefix_cache.batch_size != 1:
        raise ValueError(f"prefix_cache holds {prefix_cache.get_seq_length()} tokens of batch "
                         f"{prefix_cache.batch_size}; expected the cache of prefix_ids ({P} tokens, batch 1)")
    if not suffixes or any(s.dim() != 1 or s.numel() == 0 for s in suffixes):
        raise ValueError("suffixes must be a non-empty list of non-empty 1-D id tensors")
    n, S = len(suffixes), max(int(s.numel()) for s in suffixes)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.full((n, P + S), pad, dtype=prefix_ids.dtype, device=prefix_ids.device)
    mask = torch.zeros(n, P + S, dtype=torch.long, device=prefix_ids.device)
    ids[:, :P] = prefix_ids
    mask[:, :P] = 1
    for i, s in enumerate(suffixes):
        ids[i, P + S - s.numel():] = s.to(ids.device)
        mask[i, P + S - s.numel():] = 1
    generate_kwargs.setdefault("pad_token_id", pad)
    generate_kwargs[GENERATION_CACHE_NAME] = prefix_cache.fork(n)
    return model.generate(ids, attention_mask=mask, **generate_kwargs)


# ----------------------------------------------------------------------------------------------------------------
# the explicit graph decoder
# ----------------------------------------------------------------------------------------------------------------

class GraphDecoder:
    """Replay one captured decode step over a filled static cache (a greedy loop, a server's own scheduler).

        cache, logits = prefill_to_static(model, prompt_ids, max_cache_len)
        dec = GraphDecoder(model, cache)            # warm-up + capture (compile=True: inductor-fused first)
        logits = dec.step(next_ids)                 # [B, V]; the static output buffer

    Args:
        model: a :class:`KimiHybridForCausalLM` on CUDA in eval mode.
        cache: a filled static :class:`KimiHybridCache` on the same device.
        warmup: steps run before capture (Triton autotuning, cuBLAS handles, compilation); the cache is restored
            after.
        compile: run the step through ``torch.compile`` (inductor, default mode) before capturing it: far fewer,
            larger kernels, for a compilation on the first warm-up step (tens of seconds).
        capture: the graph object (default :class:`CudaGraphCapture`; :class:`EagerCapture` on any device).

    The cache's device counter advances on replay; ``position`` is the decoder's host count of the positions used,
    so :meth:`step` checks the room left without synchronising.

    Raises:
        ValueError: the cache is not static, is empty, or is full.
    """

    def __init__(self, model, cache: KimiHybridCache, warmup: int = 2, compile: bool = False, capture=None):
        if not cache.is_compileable:
            raise ValueError("GraphDecoder needs a static KimiHybridCache (max_cache_len=...)")
        seen = cache.seen_tokens
        if seen == 0:
            raise ValueError("prefill the cache before capturing a decode step")
        if seen + 1 > cache.max_cache_len:
            raise ValueError("the static cache is full")
        self.model, self.cache = model, cache
        device = next(model.parameters()).device
        self.ids = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=device)
        snap = cache.snapshot()

        def one_step():
            return model(self.ids, past_key_values=cache, use_cache=True).logits[:, -1]

        self.compiled = bool(compile)
        fn = torch.compile(one_step, dynamic=False) if compile else one_step
        capture = capture if capture is not None else CudaGraphCapture(warmup=max(warmup, 2 if compile else 1))
        self._replay, self.logits, self.graph_bytes = capture(fn, device)
        cache.restore(snap)  # in place: the buffers and the counter as before the warm-up and capture
        self.position = seen

    def sync_position(self) -> int:
        """Re-read the cache's device counter into ``position`` (after the cache was restored or written by other
        code than this decoder). One host synchronisation. Returns the position."""
        self.position = self.cache.seen_tokens
        return self.position

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Feed ``input_ids [B, 1]``; returns the logits ``[B, V]`` (a buffer overwritten by the next step).
        No host synchronisation. Raises ValueError when the static cache has no position left."""
        if self.position >= self.cache.max_cache_len:
            raise ValueError(f"the static cache is full ({self.cache.max_cache_len} positions)")
        self.ids.copy_(input_ids)
        self._replay()
        self.position += 1
        return self.logits
