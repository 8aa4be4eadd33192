# coding=utf-8
"""``KimiHybridCache``: the hybrid decoding cache of Kimi-Linear / Kimi K3, on transformers' cache layer API.

One layer object per decoder layer (``cache.layers[i]``), each a transformers cache layer that owns its tensors and
its update / reorder / batch operations, laid out as transformers' own caches for this architecture are (so its cache
checks, tools and a ``DynamicCache`` / ``StaticCache`` of native ``kimi_linear`` see the same shapes):

* KDA layers (``linear_attention``): transformers' ``LinearAttentionLayer`` itself (one state, ``state_idx`` 0) holds
  a fixed-size state whatever the context length: the short-conv window of the last ``W`` pre-conv q|k|v inputs,
  ``conv_states[0] [B, 3*H*K, W]`` in the model dtype (the convolution of the next token reads the newest ``W-1``;
  FLA's ``causal_conv1d`` and native ``kimi_linear`` keep the same window), and the delta-rule ``recurrent_states[0]
  [B, H, K, V]`` in float32. Its buffers are allocated once and written in place (:func:`kda_store`).
* MLA layers (``full_attention``): :class:`DynamicMLALayer` (a ``DynamicLayer``) or :class:`StaticMLALayer` (a
  ``StaticLayer``) hold only the compressed latent of each token: the RMS-normalised ``c_kv`` (``kv_lora_rank``)
  and the shared ``k_pe`` (``qk_rope_head_dim``) in one buffer, ``latent [B, T, kv_lora_rank + rope]`` (576 values
  per token for Kimi-Linear), never per-head K/V. transformers reads it as ``keys = c_kv [B, 1, T, r]`` and
  ``values = k_pe [B, 1, T, rope]`` (views of the latent).

The containers are transformers' own classes: ``KimiHybridCache(config)`` is a :class:`KimiHybridDynamicCache` (a
``DynamicCache``), ``KimiHybridCache(config, max_cache_len=N)`` a :class:`KimiHybridStaticCache` (a
``StaticCache``); both are built through ``Cache.__init__``.

Every stored tensor owns exactly its bytes: KDA states are copied into their buffers, and an MLA latent that is a
view of a larger buffer is copied (the torch short-conv returns its window as a slice of the whole padded prefill
input, which would otherwise stay alive behind a few columns). ``memory_report()`` sums the storages actually held
(each counted once), so nothing hidden behind a view can escape it.

The sequence length comes from one position counter held by the container (``seen_tokens``), never from layer 0
(often a KDA layer). Modes, chosen by the layer classes: dynamic (latents grow by concatenation) and static
(``max_cache_len`` given, or ``generate(..., cache_implementation="static")``): every buffer is pre-allocated at the
first forward (or by ``early_initialization``) and updated in place at positions taken from a device counter
``_pos`` (``seen_tokens`` reads it; every ``StaticMLALayer`` shares that same tensor as its ``cumulative_length``),
so a decode step has fixed shapes and addresses and no Python int that changes per step: it compiles to one graph
(``torch.compile``) or can be CUDA-graph captured. Zeroed KDA buffers are the "no state yet" state. Batch-changing
operations (``batch_repeat_interleave``, ``batch_select_indices``) need a dynamic cache.

Rollback for assisted / speculative decoding (``crop``): a recurrent state cannot be un-applied, so while
``activate_past_recording()`` is on the container keeps, for each KDA layer, a *record* (:class:`KDARecord`, in
``cache.records``; the layer's own ``record_past`` stays off, so its window keeps its fixed width): the recurrent state and conv window at an anchor
position plus, for every later token up to the current length, the post-conv q/k/v, the decay g, beta, the pre-conv
q|k|v input and a validity flag. Records chain across forward calls (an assistant model drafts one token per call and
is then rolled back over several calls; ``generate`` switches recording on for the main cache and, through
``KimiHybridForCausalLM._prepare_cache_for_generation``, for the draft's). ``crop`` to any length inside
``[anchor, length]`` replays the recurrence from the anchor over the kept tokens; the record then ends at the new
length and keeps chaining. Padded forwards are recorded in position order with their pads neutral (k = g = beta = 0:
the state is untouched, and pads never enter the conv window), since transformers' draft model treats a generated
pad-token id as padding. A forward without recording (or a packed one) drops the record; a crop then raises.

With R = ``config.kda_record_max_tokens`` (default 64), P = H*K, per KDA layer and batch row:

* rollback depth: at least ``min(R, tokens recorded since recording started)`` tokens back, always;
* memory: one state copy ``H*K*V`` fp32 + one conv window ``3P*W`` + at most ``2R`` recorded tokens, each
  ``6P`` values in the model dtype (q, k, v, x) + ``P + H`` fp32 (g, beta) + 1 byte. Kimi-Linear in bf16 (H=32,
  K=V=128, P=4096, R=64): 2 MiB + 96 KiB + 128 * 64.1 KiB = about 10.1 MiB per KDA layer and row at most;
* compute: when a chained record passes 2R tokens its anchor moves forward by replaying the oldest R tokens once
  (amortised: one extra recurrence step per recorded token; no projection, conv or MLP is recomputed); an unpadded
  forward of T >= R tokens restarts the record inside the call at no extra cost; ``crop`` costs one recurrence over
  at most 2R tokens per KDA layer. Without recording none of this is kept or computed.

Recording stays on for a cache that ``generate`` returns after assisted decoding; ``deactivate_past_recording()``
drops the records. ``memory_report()["rollback_bytes"]`` counts them.

Agent sessions: ``snapshot`` / ``restore`` (in place for a static cache) / ``fork(batch_repeats)``, ``save`` /
``load`` (safetensors, format ``kimi-hybrid-cache`` version 1, sha256 over every tensor, config fingerprint checked on
load), and ``memory_report`` (bytes per layer type, byte-exact against the storage held). Prefix reuse:
``KimiHybridForCausalLM.prefill_prefix`` runs a shared prefix once; ``fork()`` its cache per continuation or call
``generate_from_prefix`` for a batch (``examples/bench_prefix_reuse.py`` measures the time saved).

A user's transformers ``DynamicCache`` / ``StaticCache`` is not this class: the model uses it as it is, through
transformers' cache API (``cache_view_kimi_hybrid``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from transformers.cache_utils import (Cache, DynamicCache, DynamicLayer, LinearAttentionCacheLayerMixin,
                                     LinearAttentionLayer, StaticCache, StaticLayer)

try:  # relative import inside the package / Hub bundle
    from .compat_kimi_hybrid import compiling as _compiling
    from .configuration_kimi_hybrid import FULL, LINEAR
    from .kda_kimi_hybrid import kda_chunk, kda_recurrent
except ImportError:  # pragma: no cover
    from compat_kimi_hybrid import compiling as _compiling  # type: ignore
    from configuration_kimi_hybrid import FULL, LINEAR  # type: ignore
    from kda_kimi_hybrid import kda_chunk, kda_recurrent  # type: ignore

CACHE_FORMAT = "kimi-hybrid-cache"
CACHE_FORMAT_VERSION = 2  # 2: W-wide conv windows (1: W-1 wide; still read)
READABLE_VERSIONS = (1, 2)



def config_fingerprint(config) -> Dict[str, Any]:
    """The config fields a cache depends on (layer plan and every cached tensor's width, ``last_hidden``'s too)."""
    return {
        "layer_types": list(config.layer_types),
        "linear_num_heads": int(config.linear_attn_config["num_heads"]),
        "linear_head_dim": int(config.linear_attn_config["head_dim"]),
        "short_conv_kernel_size": int(config.linear_attn_config["short_conv_kernel_size"]),
        "kv_lora_rank": int(config.kv_lora_rank),
        "qk_rope_head_dim": int(config.qk_rope_head_dim),
        "hidden_size": int(config.hidden_size),  # the width of last_hidden (dynamic caches)
    }


def _own(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` itself when it is a contiguous tensor that spans its whole storage, else a contiguous copy: a cache must
    never keep a large buffer alive through a small view of it (autograd history is kept either way)."""
    if t is None:
        return None
    if _compiling():
        return t.clone(memory_format=torch.contiguous_format)
    if (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _storage_key(t: torch.Tensor):
    """Identity of the storage behind ``t`` (meta tensors have none: each counts on its own)."""
    ptr = t.untyped_storage().data_ptr()
    return ("tensor", id(t)) if ptr == 0 else (str(t.device), ptr)


def _static_address(t: torch.Tensor) -> None:
    """Tag a pre-allocated buffer as a fixed address for torch.compile / CUDA graphs (skipped while tracing)."""
    if not _compiling() and t.device.type != "meta":
        torch._dynamo.mark_static_address(t)


# ----------------------------------------------------------------------------------------------------------------
# KDA layers: transformers' own LinearAttentionLayer
# ----------------------------------------------------------------------------------------------------------------

def new_kda_layer(conv_kernel_size: int) -> LinearAttentionLayer:
    """A KDA layer's cache: transformers' ``LinearAttentionLayer`` (one state, ``state_idx`` 0) with its conv window
    ``W = conv_kernel_size`` wide. Its buffers are allocated at the first write (or by the container's static
    allocation) and written in place from then on."""
    layer = LinearAttentionLayer(number_of_states=1)
    layer.conv_kernel_size[0] = int(conv_kernel_size)
    return layer


def is_kda_layer(layer) -> bool:
    """True for a KDA (linear-attention) cache layer."""
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def kda_tensors(layer) -> Dict[str, torch.Tensor]:
    """A KDA layer's states by name: ``conv_state [B, 3*H*K, W]`` (model dtype) and ``recurrent_state [B, H, K, V]``
    (float32), those that exist."""
    out = {}
    if layer.conv_states[0] is not None:
        out["conv_state"] = layer.conv_states[0]
    if layer.recurrent_states[0] is not None:
        out["recurrent_state"] = layer.recurrent_states[0]
    return out


def kda_store(layer, conv_state: Optional[torch.Tensor] = None, recurrent_state: Optional[torch.Tensor] = None,
              fixed: bool = False) -> None:
    """Write a KDA layer's states: ``conv_state [B, 3*H*K, W]`` and / or ``recurrent_state [B, H, K, V]`` fp32.

    In place into the layer's buffers (allocated by transformers' ``lazy_initialization`` at the first write, zeroed,
    with a fixed address) whenever shapes, dtype and device match and the value carries no autograd history;
    ``fixed`` (a static cache) demands the in-place write. Otherwise (a new batch size, or a training forward whose
    state must keep its graph) the layer holds a tensor that owns exactly its bytes (see :func:`_own`).

    Raises:
        ValueError: ``fixed`` and the shape differs from the allocated buffer.
    """
    for t, slots, flags, kw in ((conv_state, layer.conv_states, layer.is_conv_states_initialized, "conv_states"),
                                (recurrent_state, layer.recurrent_states, layer.is_recurrent_states_initialized,
                                 "recurrent_states")):
        if t is None:
            continue
        old = slots[0]
        if old is None and (fixed or not t.requires_grad):
            layer.lazy_initialization(**{kw: t}, **({"conv_kernel_size": t.shape[-1]} if kw == "conv_states"
                                                      else {}))
            old = slots[0]
        same = old is not None and old.shape == t.shape and old.device == t.device and old.dtype == t.dtype
        if same and (fixed or not (t.requires_grad and torch.is_grad_enabled())):
            old.copy_(t)
        elif fixed:
            raise ValueError(f"a static cache's KDA buffer is {tuple(old.shape)} {old.dtype} on {old.device}; cannot "
                             f"write {tuple(t.shape)} {t.dtype} on {t.device}")
        else:
            slots[0] = _own(t)
        flags[0] = True
        layer.device = slots[0].device
        if kw == "conv_states":
            layer.dtype = slots[0].dtype
    layer.has_previous_state[0] = layer.recurrent_states[0] is not None


def kda_drop(layer) -> None:
    """Forget a KDA layer's states (the buffers are freed; the next write allocates anew)."""
    layer.conv_states[0] = layer.recurrent_states[0] = None
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = False
    layer.has_previous_state[0] = False


def kda_map_rows(layer, fn) -> None:
    """Apply a batch-row map ``fn`` (reorder / repeat / select, ``[B, ...] -> [B', ...]``) to a KDA layer's states."""
    for name, t in kda_tensors(layer).items():
        slots = layer.conv_states if name == "conv_state" else layer.recurrent_states
        slots[0] = fn(t)


class KDARecord:
    """Rollback record of one KDA layer (see the module doc): the recurrent state ``[B, H, K, V]`` fp32 and conv
    window ``[B, 3P, W]`` at position ``anchor``, then for each later token up to ``end``, in position order:
    post-conv ``q, k, v [B, n, H, K]``, decay ``g [B, n, H, K]``, ``beta [B, n, H]``, pre-conv ``x [B, n, 3P]`` and
    ``valid [B, n]`` bool (False = padding: its k, g and beta are zero, so it leaves the state alone, and it never
    enters the conv window). Every tensor is a detached copy."""

    KEYS = ("q", "k", "v", "g", "beta", "x", "valid")

    def __init__(self, anchor: int, state: torch.Tensor, window: torch.Tensor, tokens: Dict[str, torch.Tensor],
                 max_tokens: int):
        self.anchor = int(anchor)
        self.end = int(anchor) + tokens["q"].shape[1]
        self.state = state.detach().clone()
        self.window = window.detach().clone()
        self.tokens = {name: tokens[name].detach().clone() for name in self.KEYS}
        self._bound(max_tokens)

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the record holds."""
        return [self.state, self.window, *self.tokens.values()]

    def nbytes(self) -> int:
        """Nominal bytes of the record."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def extend(self, tokens: Dict[str, torch.Tensor], max_tokens: int) -> None:
        """Append the tokens of the next forward call (same layout as the constructor's)."""
        for name in self.KEYS:
            self.tokens[name] = torch.cat([self.tokens[name], tokens[name].detach().to(self.tokens[name].dtype)], 1)
        self.end += tokens["q"].shape[1]
        self._bound(max_tokens)

    def _bound(self, max_tokens: int) -> None:
        """Past ``2 * max_tokens`` recorded tokens, move the anchor so that ``max_tokens`` stay (one replay of the
        dropped tokens)."""
        n = self.end - self.anchor
        if n > 2 * max_tokens:
            d = n - max_tokens
            self.state, self.window = self.replay(d)
            self.anchor += d
            for name in self.KEYS:
                self.tokens[name] = self.tokens[name][:, d:].contiguous()

    def replay(self, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run the recorded recurrence and conv window forward ``m`` tokens from the anchor. Returns ``(state
        [B, H, K, V] fp32, window [B, 3P, W])`` at position ``anchor + m``."""
        state, window = self.state, self.window
        if m <= 0:
            return state, window
        args = [self.tokens[name][:, :m] for name in ("q", "k", "v", "g", "beta")]
        run = kda_recurrent if m <= 64 else kda_chunk
        with torch.no_grad():
            _, state = run(*args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        B, C, W = window.shape
        x = torch.cat([window, self.tokens["x"][:, :m].transpose(1, 2).to(window.dtype)], dim=-1)  # [B, C, W + m]
        valid = self.tokens["valid"][:, :m]
        if bool(valid.all()):
            return state, x[..., x.shape[-1] - W:]
        # the last W real inputs of each row, oldest first (pads never enter the window)
        valid = torch.cat([valid.new_ones(B, W), valid], dim=1)
        order = (~valid).to(torch.int8).argsort(dim=1, stable=True)  # real columns first, in order
        pick = valid.sum(1, keepdim=True) - W + torch.arange(W, device=valid.device).unsqueeze(0)
        cols = order.gather(1, pick)
        return state, x.gather(2, cols.unsqueeze(1).expand(B, C, W))

    def rollback(self, target: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The ``(state, window)`` at position ``target`` (inside ``[anchor, end]``, as new tensors); the record is
        trimmed to end there."""
        m = target - self.anchor
        state, window = self.replay(m)
        for name in self.KEYS:
            self.tokens[name] = self.tokens[name][:, :m]
        self.end = int(target)
        return state.clone(), window.clone()


def record_kda_step(cache, layer_idx: int, run, tokens, init_state, conv_state, perm=None, token_mask=None):
    """:meth:`KimiHybridCache.kda_run_recorded` (its docstring): one KDA step run with its rollback record kept."""
    q, k, v, g, beta, x_raw = (tokens[n] for n in ("q", "k", "v", "g", "beta", "x"))
    B, T, H, K = q.shape
    R = max(1, int(cache.config.kda_record_max_tokens))
    start = cache.seen_tokens
    rec_tokens = dict(tokens)
    if perm is not None:  # back to position order: pads land on their positions with k = g = beta = 0
        rec_tokens = {n: torch.zeros_like(t).scatter(1, perm.view(B, T, *([1] * (t.dim() - 2))).expand_as(t), t)
                      for n, t in rec_tokens.items()}
    padded = token_mask is not None
    rec_tokens["valid"] = token_mask if padded else torch.ones(B, T, dtype=torch.bool, device=q.device)
    rec = cache.records[layer_idx]
    if rec is not None and rec.end == start and (T < R or padded):
        o, final = run(q, k, v, g, beta, init_state)
        rec.extend(rec_tokens, R)
        return o, final
    W = cache.layers[layer_idx].conv_kernel_size[0]
    split = 0 if padded else max(0, T - R)
    S0 = init_state if init_state is not None else q.new_zeros(B, H, K, K, dtype=torch.float32)
    W0 = conv_state if conv_state is not None else x_raw.new_zeros(B, x_raw.shape[-1], W)
    outs = []
    if split > 0:
        o1, S0 = kda_chunk(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split],
                           initial_state=init_state, output_final_state=True)
        outs.append(o1)
        full = torch.cat([W0.to(x_raw.dtype), x_raw[:, :split].transpose(1, 2)], dim=-1)
        W0 = full[..., full.shape[-1] - W:]
    rest = [t[:, split:] for t in (q, k, v, g, beta)]
    o2, final = run(*rest, S0 if (split > 0 or init_state is not None) else None)
    outs.append(o2)
    cache.records[layer_idx] = KDARecord(start + split, S0, W0, {n: t[:, split:] for n, t in rec_tokens.items()}, R)
    return torch.cat(outs, 1) if len(outs) > 1 else o2, final


def _shape(t: Optional[torch.Tensor]):
    return None if t is None else tuple(t.shape)


# ----------------------------------------------------------------------------------------------------------------
# MLA layers
# ----------------------------------------------------------------------------------------------------------------

class MLALayerMixin:
    """What both MLA layer classes share. The layer holds one buffer, ``latent [B, T, r + rope]`` (model dtype;
    ``r = kv_lora_rank``): the normalised ``c_kv`` and the shared rotary key ``k_pe`` of each token, so attention
    reads each token's 576 values in one pass. transformers' layer view of it (what its cache checks and tools read,
    the MLA convention of its DeepSeek-V3 / kimi_linear caches): ``keys = c_kv [B, 1, T, r]`` and ``values =
    k_pe [B, 1, T, rope]``, both views into ``latent`` (read-only: assign ``latent`` to replace it)."""

    layer_type = FULL

    def _init_mla(self, kv_lora_rank: int) -> None:
        self.kv_lora_rank = int(kv_lora_rank)
        self.__dict__["_latent"] = None

    def __repr__(self):
        return f"{type(self).__name__}(latent={_shape(self.latent)})"

    @property
    def latent(self) -> Optional[torch.Tensor]:
        """``[B, T, Dl]`` (dynamic) or ``[B, max_cache_len, Dl]`` (static), model dtype; None before the first
        update. Assigning stores a tensor that owns its bytes."""
        return self.__dict__.get("_latent")

    @latent.setter
    def latent(self, t: Optional[torch.Tensor]) -> None:
        self.__dict__["_latent"] = _own(t)
        self.is_initialized = t is not None
        if t is not None:
            self.device = t.device
            self.dtype = t.dtype
            self.batch_size = t.shape[0]

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """``c_kv [B, 1, T, kv_lora_rank]``, a view of :attr:`latent` (None before the first update)."""
        lat = self.latent
        return None if lat is None else lat[:, None, :, :self.kv_lora_rank]

    @keys.setter
    def keys(self, t) -> None:
        if t is not None:
            raise AttributeError("an MLA cache layer's keys / values are views of its latent; assign `latent`")
        self.__dict__["_latent"] = None

    @property
    def values(self) -> Optional[torch.Tensor]:
        """``k_pe [B, 1, T, qk_rope_head_dim]``, a view of :attr:`latent` (None before the first update)."""
        lat = self.latent
        return None if lat is None else lat[:, None, :, self.kv_lora_rank:]

    @values.setter
    def values(self, t) -> None:
        if t is not None:
            raise AttributeError("an MLA cache layer's keys / values are views of its latent; assign `latent`")

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensor held, by name (``latent``)."""
        return {} if self.latent is None else {"latent": self.latent}

    def nbytes(self) -> int:
        """Nominal bytes of the latent (``memory_report`` counts the storage behind it)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def _apply(self, fn) -> None:
        if self.latent is not None:
            self.latent = fn(self.latent)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep rows ``beam_idx`` (in that order)."""
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row order b0, b0, ..., b1, b1, ...)."""
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``."""
        self._apply(lambda t: t[indices.to(t.device)])


class DynamicMLALayer(MLALayerMixin, DynamicLayer):
    """Cache of one MLA layer, growing by concatenation: ``latent [B, T, kv_lora_rank + rope]`` (normalised
    c_kv | k_pe, model dtype); transformers sees ``keys [B, 1, T, r]`` / ``values [B, 1, T, rope]`` (views).

    Args:
        kv_lora_rank: ``r``, the width of the ``c_kv`` part.
    """

    static = False

    def __init__(self, kv_lora_rank: int):
        self._init_mla(kv_lora_rank)
        super().__init__()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None) -> None:
        """Start empty: ``[B, 0, Dl]`` with the batch size, width, dtype and device of ``key_states [B, ..., Dl]``."""
        self.latent = key_states.new_empty((key_states.shape[0], 0, key_states.shape[-1]))

    def update(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None, *args,
               **kwargs) -> Tuple[torch.Tensor, None]:
        """Append ``key_states`` = the new latents ``[B, T, Dl]``; return ``(every cached latent [B, T_all, Dl],
        None)``.

        Raises:
            ValueError: the batch size differs from the cached one.
        """
        lat = self.latent
        if lat is None or (lat.shape[1] == 0 and lat.shape[0] == key_states.shape[0]
                           and lat.dtype == key_states.dtype):
            self.latent = key_states
        else:
            if lat.shape[0] != key_states.shape[0]:
                raise ValueError(f"cache batch size {lat.shape[0]} does not match the input batch "
                                 f"{key_states.shape[0]}")
            self.__dict__["_latent"] = torch.cat([lat, key_states.to(lat.dtype)], dim=1)
        return self.latent, None

    def get_seq_length(self) -> int:
        """Tokens held (the latent's length)."""
        return 0 if self.latent is None else int(self.latent.shape[1])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative int; 0 is a no-op).

        Raises:
            ValueError: a positive count, or more tokens than the layer holds.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        n = self.get_seq_length()
        if -tokens_to_remove > n:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from an MLA layer holding {n}")
        if tokens_to_remove < 0:
            self.latent = self.latent[:, :n + tokens_to_remove].clone()

    def reset(self) -> None:
        """Drop the latent."""
        self.__dict__["_latent"] = None
        self.is_initialized = False

    def offload(self) -> None:
        """Move the latent to the CPU (``prefetch`` brings it back to the layer's device). The copy is blocking:
        an asynchronous device-to-host copy could be read on the host (save, snapshot) before it lands."""
        if self.latent is not None:
            device = self.device
            self.latent = self.latent.to("cpu")
            self.device = device

    def prefetch(self) -> None:
        """Move an offloaded latent back to the layer's device."""
        if self.latent is not None and self.latent.device != self.device:
            self.latent = self.latent.to(self.device)


class StaticMLALayer(MLALayerMixin, StaticLayer):
    """Cache of one MLA layer, pre-allocated: ``latent [B, max_cache_len, Dl]`` (transformers sees ``keys
    [B, 1, max_cache_len, r]`` / ``values [B, 1, max_cache_len, rope]``), written in place at the positions of
    ``cumulative_length``, which is the container's device counter itself (shared, never advanced here: the container
    advances it once per forward). Rows past the length are masked by the model. The batch size and the buffer's
    address are fixed: batch changes raise NotImplementedError, offload / prefetch ValueError.

    Args:
        max_cache_len: capacity in tokens.
        kv_lora_rank: ``r``, the width of the ``c_kv`` part.
    """

    static = True

    def __init__(self, max_cache_len: int, kv_lora_rank: int):
        self._init_mla(kv_lora_rank)
        super().__init__(max_cache_len)

    def allocate(self, batch_size: int, width: int, dtype: torch.dtype, device) -> None:
        """Allocate the zeroed ``[batch_size, max_cache_len, width]`` buffer (a fixed address)."""
        self.latent = torch.zeros(batch_size, self.max_cache_len, width, dtype=dtype, device=device)
        _static_address(self.latent)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None) -> None:
        """Allocate the buffer for the batch size, width, dtype and device of ``key_states [B, ..., Dl]``."""
        self.allocate(key_states.shape[0], key_states.shape[-1], key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: Optional[torch.Tensor] = None, *args,
               **kwargs) -> Tuple[torch.Tensor, None]:
        """Write the new latents ``[B, T, Dl]`` at positions ``cumulative_length + [0, T)``; return ``(the whole
        buffer [B, max_cache_len, Dl], None)``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        idx = self.cumulative_length + torch.arange(key_states.shape[1], device=key_states.device)
        self.latent.index_copy_(1, idx, key_states.to(self.latent.dtype))
        return self.latent, None

    def get_seq_length(self) -> int:
        """Tokens written (the container's counter)."""
        return int(self.cumulative_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows ``beam_idx`` copied in place."""
        if self.latent is not None:
            self.latent.copy_(self.latent.index_select(0, beam_idx.to(self.latent.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused (NotImplementedError): a static layer's batch size is fixed."""
        raise NotImplementedError("batch_repeat_interleave changes the batch size of a static cache (fixed buffers); "
                                  "use a dynamic cache or fork()")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused (NotImplementedError): a static layer's batch size is fixed."""
        raise NotImplementedError("batch_select_indices changes the batch size of a static cache (fixed buffers); "
                                  "use a dynamic cache")

    def offload(self) -> None:
        """Refused (ValueError): static buffers keep fixed addresses."""
        raise ValueError(_NO_STATIC_OFFLOAD)

    def prefetch(self) -> None:
        """Refused (ValueError): static buffers keep fixed addresses."""
        raise ValueError(_NO_STATIC_OFFLOAD)

    def crop(self, tokens_to_remove: int) -> None:
        """Nothing to move: the container's counter goes back, and later writes overwrite the stale rows."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")

    def reset(self) -> None:
        """Zero the buffer in place (the container resets the counter)."""
        if self.latent is not None:
            self.latent.zero_()


_NO_STATIC_OFFLOAD = ("a static KimiHybridCache keeps its buffers at fixed addresses (torch.compile / CUDA graphs); "
                      "offloading would move them. Use a dynamic cache, KimiHybridCache(config, offloading=True), "
                      "to offload the MLA latents to the CPU")


# ----------------------------------------------------------------------------------------------------------------
# the container
# ----------------------------------------------------------------------------------------------------------------

class KimiHybridCache(Cache):
    """Hybrid cache for :class:`KimiHybridForCausalLM` (a ``transformers`` ``Cache`` built from its layer API).

    ``KimiHybridCache(config)`` builds a :class:`KimiHybridDynamicCache` (a transformers ``DynamicCache``), and
    ``KimiHybridCache(config, max_cache_len=N)`` a :class:`KimiHybridStaticCache` (a transformers ``StaticCache``);
    both are ``KimiHybridCache`` instances and share everything below.

    Args:
        config: a ``KimiHybridConfig`` (its ``layer_types`` decide each layer's class).
        max_cache_len: None for a dynamic cache (KDA: transformers' ``LinearAttentionLayer``; MLA:
            :class:`DynamicMLALayer`); an int for the static / pre-allocated mode (``LinearAttentionLayer`` +
            :class:`StaticMLALayer`; CUDA graphs, ``torch.compile``), whose batch size is fixed by the first forward
            (or given here).
        batch_size, dtype, device: optional eager allocation of the static buffers (as ``early_initialization``).
        offloading: dynamic mode only: keep each MLA latent on the CPU between its layer's uses (moved to the
            device for the layer's update and attention, back after it); the small KDA states stay on the device.

    Per-layer state: ``cache.layers[i]``. The key-padding mask of every token seen so far is kept in
    ``key_mask [B, T]`` (bool) so that a later forward without an ``attention_mask`` still ignores earlier padding.
    Dynamic mode also keeps ``last_hidden [B, D]``, the final hidden state of each row's last real token, so that a
    forward whose tokens are all padding for a row (a right-padded row in the last piece of a chunked prefill) still
    outputs that row's next-token prediction.

    Raises:
        ValueError: ``max_cache_len`` not a positive int, a layer type other than ``linear_attention`` /
            ``full_attention``, or ``offloading`` with a static cache.
    """

    def __new__(cls, config=None, max_cache_len: Optional[int] = None, *args, **kwargs):
        if cls is KimiHybridCache:
            cls = KimiHybridDynamicCache if max_cache_len is None else KimiHybridStaticCache
        return object.__new__(cls)

    def __init__(self, config, max_cache_len: Optional[int] = None, batch_size: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                 offloading: bool = False):
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int (static cache) or None (dynamic), got "
                             f"{max_cache_len!r}")
        if offloading and max_cache_len is not None:
            raise ValueError(_NO_STATIC_OFFLOAD)
        self.config = config
        self.layer_types = list(config.layer_types)
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"config.layer_types holds {unknown}; a KimiHybridCache has {LINEAR!r} (KDA) and "
                             f"{FULL!r} (MLA) layers only")
        self._max_cache_len = max_cache_len
        self.static = max_cache_len is not None
        # transformers' Cache.__init__ (not DynamicCache's / StaticCache's, which would build per-head layers)
        Cache.__init__(self, layers=[self._new_layer(t) for t in self.layer_types])
        self.offloading = bool(offloading)
        self.fingerprint = config_fingerprint(config)
        self._pos = None  # static mode: device counter (the length lives there)
        self._seen = 0  # the length (static mode: a host count beside the device counter)
        self.key_mask: Optional[torch.Tensor] = None
        self.last_hidden: Optional[torch.Tensor] = None  # dynamic mode: [B, D] of each row's last real token
        self.recording = False
        # the rollback record of each KDA layer while recording (None elsewhere; see KDARecord)
        self.records: List[Optional[KDARecord]] = [None] * len(self.layer_types)
        self._static_ready = False
        if self.static and batch_size is not None:
            self._allocate_static(batch_size, dtype or torch.get_default_dtype(), device or torch.device("cpu"))

    def _new_layer(self, layer_type: str):
        if layer_type == LINEAR:
            return new_kda_layer(self._dims()[2])
        r = int(self.config.kv_lora_rank)
        return StaticMLALayer(self._max_cache_len, r) if self.static else DynamicMLALayer(r)

    # -- the position counter ----------------------------------------------------------------------------------------
    @property
    def _pos(self) -> Optional[torch.Tensor]:
        """Static mode: the device counter ``[]`` (int64) of tokens seen; every StaticMLALayer shares it."""
        return self.__dict__.get("_pos_tensor")

    @_pos.setter
    def _pos(self, t: Optional[torch.Tensor]) -> None:
        self.__dict__["_pos_tensor"] = t
        if t is not None:
            for layer in self.layers:
                if isinstance(layer, StaticMLALayer):
                    layer.cumulative_length = t

    @property
    def max_cache_len(self) -> Optional[int]:  # (a read-only deprecated property on transformers' Cache < 5.20)
        """The static capacity in tokens, or None for a dynamic cache."""
        return self._max_cache_len

    @max_cache_len.setter
    def max_cache_len(self, value: Optional[int]) -> None:
        self._max_cache_len = value

    # ------------------------------------------------------------------------------------------------------------
    # allocation
    # ------------------------------------------------------------------------------------------------------------
    def _dims(self):
        c = self.config
        H, K = int(c.linear_attn_config["num_heads"]), int(c.linear_attn_config["head_dim"])
        W = int(c.linear_attn_config["short_conv_kernel_size"])
        return H, K, W, c.kv_lora_rank + c.qk_rope_head_dim

    def _allocate_static(self, batch_size: int, dtype: torch.dtype, device) -> None:
        H, K, W, Dl = self._dims()
        for layer in self.layers:
            if is_kda_layer(layer):
                kda_drop(layer)
                kda_store(layer, torch.zeros(batch_size, 3 * H * K, W, dtype=dtype, device=device),
                          torch.zeros(batch_size, H, K, K, dtype=torch.float32, device=device), fixed=True)
                layer.has_previous_state[0] = False
            else:
                layer.allocate(batch_size, Dl, dtype, device)
        self.key_mask = torch.zeros(batch_size, self.max_cache_len, dtype=torch.bool, device=device)
        _static_address(self.key_mask)  # written in place by every step (inductor's cudagraphs take no other)
        self._pos = torch.zeros((), dtype=torch.long, device=device)
        _static_address(self._pos)
        self._static_ready = True

    def ensure_allocated(self, batch_size: int, dtype: torch.dtype, device) -> None:
        """Static mode: allocate the buffers at the first forward. Raises ValueError on a batch-size mismatch."""
        if not self.static:
            return
        if self._static_ready:
            if self.key_mask.shape[0] != batch_size:
                raise ValueError(
                    f"this static cache holds batch {self.key_mask.shape[0]} but the input has batch {batch_size}")
            return
        self._allocate_static(batch_size, dtype, device)

    def early_initialization(self, batch_size: int, num_heads: Any = None, head_dim: Any = None,
                             dtype: Optional[torch.dtype] = None, device=None) -> None:
        """transformers' eager allocation (``torch.export``, compiled chunked prefill); the widths come from the
        config.

        Static: allocate every buffer for ``batch_size`` rows in ``dtype`` (default: torch's default dtype) on
        ``device`` (default CPU). Dynamic: start each MLA latent empty ``[batch_size, 0, Dl]`` and the key mask
        ``[batch_size, 0]`` (KDA states are created by the first forward, as transformers' linear layers are).
        ``num_heads`` / ``head_dim``: transformers' per-head K/V shape; accepted and ignored.

        Raises:
            ValueError: a static cache already allocated for another batch size, or a dynamic cache that already
                holds tokens.
        """
        dtype = dtype or torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.device("cpu")
        if self.static:
            if self._static_ready:
                self.ensure_allocated(batch_size, dtype, device)
                return
            self._allocate_static(int(batch_size), dtype, device)
            return
        if self.seen_tokens > 0:
            raise ValueError(f"early_initialization on a cache that already holds {self.seen_tokens} tokens; call "
                             "reset() first")
        Dl = self._dims()[3]
        for layer in self.layers:
            if isinstance(layer, DynamicMLALayer):
                layer.lazy_initialization(torch.empty(int(batch_size), 0, Dl, dtype=dtype, device=device))
        self.key_mask = torch.zeros(int(batch_size), 0, dtype=torch.bool, device=device)

    # ------------------------------------------------------------------------------------------------------------
    # transformers Cache API
    # ------------------------------------------------------------------------------------------------------------
    def __len__(self):
        return len(self.layers)

    def __repr__(self):
        mode = f"static(max_cache_len={self.max_cache_len})" if self.static else "dynamic"
        return (f"{type(self).__name__}({mode}, seen_tokens={self.get_seq_length()}, "
                f"kda_layers={self.layer_types.count(LINEAR)}, mla_layers={self.layer_types.count(FULL)})")

    @property
    def seen_tokens(self) -> int:
        """Tokens seen so far. Static mode: read from the device counter ``_pos`` (the model never reads it inside
        a forward in static mode, so a compiled decode step has no Python int that changes every step)."""
        pos = self._pos
        if pos is not None and not pos.is_meta:  # (a meta cache, for memory planning, has no values)
            return int(pos)
        return self._seen

    @seen_tokens.setter
    def seen_tokens(self, value: int) -> None:
        self._seen = int(value)
        if self._pos is not None:
            self._pos.fill_(int(value))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (the position counter, the same for every layer)."""
        return int(self.seen_tokens)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        """``max_cache_len`` (static) or -1 (dynamic: no maximum); -1 for a KDA layer (``layer_idx`` given), which
        has no sequence dimension."""
        if not self.static or (layer_idx is not None and self.layer_types[layer_idx] == LINEAR):
            return -1
        return int(self.max_cache_len)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        """``(kv_length, kv_offset)`` for transformers' mask builders: the buffer length (static) or the tokens
        seen plus ``query_length`` (dynamic), offset 0."""
        if self.static:
            return int(self.max_cache_len), 0
        return self.get_seq_length() + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Position of the next query token (= tokens seen)."""
        return self.get_seq_length()

    def has_previous_state(self, layer_idx: Optional[int] = None, state_idx: Optional[int] = None) -> bool:
        """True once any token was seen (every layer sees every token)."""
        return self.seen_tokens > 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """KDA layer ``layer_idx``'s conv window ``[B, 3P, W]`` (the last W pre-conv inputs, oldest first), or None
        before its first state (any transformers version; transformers' own getter appeared in 5.21).

        Raises:
            ValueError: an MLA layer, or ``state_idx`` other than 0.
        """
        layer = self._kda(layer_idx, state_idx)
        return layer.conv_states[0] if layer.has_previous_state[0] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """KDA layer ``layer_idx``'s recurrent state ``[B, H, K, V]`` fp32, or None before its first state.

        Raises:
            ValueError: an MLA layer, or ``state_idx`` other than 0.
        """
        layer = self._kda(layer_idx, state_idx)
        return layer.recurrent_states[0] if layer.has_previous_state[0] else None

    def _kda(self, layer_idx: int, state_idx: int = 0) -> LinearAttentionLayer:
        layer = self.layers[layer_idx]
        if not is_kda_layer(layer):
            raise ValueError(f"layer {layer_idx} is a {self.layer_types[layer_idx]} (MLA) layer, not a KDA layer")
        if state_idx != 0:
            raise ValueError(f"a KDA layer holds one conv / recurrent state (state_idx=0), got state_idx={state_idx}")
        return layer

    @property
    def batch_size(self) -> Optional[int]:
        """Rows held (from the key mask), or None before the first forward."""
        return None if self.key_mask is None else self.key_mask.shape[0]

    @property
    def is_compileable(self) -> bool:
        """Only the static mode has fixed shapes and addresses (torch.compile / CUDA graphs)."""
        return bool(self.static)

    @property
    def is_initialized(self) -> bool:
        """True once any token was seen."""
        return self.seen_tokens > 0

    @property
    def is_croppable(self) -> bool:
        """True while recording (``crop`` can then roll the KDA states back; see the module doc)."""
        return self.recording

    @property
    def is_sliding(self):
        """No sliding-window layers."""
        return [False] * len(self.layers)

    @property
    def is_linear(self):
        """True for the KDA (linear-attention) layers."""
        return [t == LINEAR for t in self.layer_types]

    @property
    def is_dummy(self):
        """No cache-less layers."""
        return [False] * len(self.layers)

    def activate_past_recording(self) -> None:
        """Keep what ``crop`` needs to roll the KDA states back (assisted decoding; see the module doc). The KDA
        layers' own ``record_past`` stays off: their conv windows keep their fixed width W, and the records are kept
        here (``records``)."""
        self.recording = True

    def deactivate_past_recording(self) -> None:
        """Stop recording and drop the rollback records (frees their memory)."""
        self.recording = False
        self.records = [None] * len(self.layers)

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        """Whether rollback records are kept (the same for every layer)."""
        return self.recording

    def update(self, *args, **kwargs):
        """Refused (NotImplementedError): the layers write the cache through ``mla_update`` and the KDA layers."""
        raise NotImplementedError(
            "KimiHybridCache is written by the KimiHybrid layers themselves (mla_update for the MLA latents, the KDA "
            "layer states); it does not take per-head key/value tensors")

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Move layer ``layer_idx``'s tensors to the CPU (dynamic cache; ``prefetch`` brings them back).

        Raises:
            ValueError: a static cache (fixed buffer addresses).
        """
        if self.static:
            raise ValueError(_NO_STATIC_OFFLOAD)
        layer = self.layers[layer_idx]
        if is_kda_layer(layer):  # blocking (transformers' own is asynchronous: a host read could race it)
            device = layer.device
            kda_map_rows(layer, lambda t: t.to("cpu"))
            layer.device = device
        else:
            layer.offload()

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Move layer ``layer_idx``'s offloaded tensors back to its device (synchronously).

        Raises:
            ValueError: a static cache (fixed buffer addresses).
        """
        if self.static:
            raise ValueError(_NO_STATIC_OFFLOAD)
        layer = self.layers[layer_idx]
        if is_kda_layer(layer):
            if layer.device is not None:
                kda_map_rows(layer, lambda t: t.to(layer.device))
        else:
            layer.prefetch()

    # -- the model's interface (a user's transformers cache gets the same through cache_view_kimi_hybrid) -----------
    def for_model(self, config) -> "KimiHybridCache":
        """This cache, checked against the ``config`` of the model about to use it (once per forward; the
        fingerprint is compared only when the config object is another than the cache's own).

        Raises:
            ValueError: a cache of a model whose layer plan / widths differ (the differing fields named).
        """
        if config is not self.config:
            want = config_fingerprint(config)
            if self.fingerprint != want:
                raise ValueError("past_key_values is a cache of another model (its layer plan / widths differ from "
                                 f"this model's config: {_diff(self.fingerprint, want)})")
        return self

    def user_cache(self) -> "KimiHybridCache":
        """The object the forward returns as its cache (this one)."""
        return self

    def prepare(self, batch_size: int, num_tokens: int, dtype: torch.dtype, device, host_checks: bool) -> None:
        """Ready the cache for a forward of ``num_tokens`` new tokens of ``batch_size`` rows: allocate a static
        cache's buffers at the first forward (``dtype`` / ``device``), check the batch size and, with
        ``host_checks`` (never while tracing or capturing a graph: it reads the static counter), the room left.

        Raises:
            ValueError: a batch size other than the cached one, or a static cache that would overflow.
        """
        self.ensure_allocated(batch_size, dtype, device)
        if not self.static and self.batch_size is not None and self.seen_tokens > 0 and self.batch_size != batch_size:
            raise ValueError(f"the cache holds batch {self.batch_size} but the input has batch {batch_size}")
        # static: the host count of the tokens written (``count_replayed_tokens`` keeps it for graph replays), so
        # the room check reads no device value
        if self.static and host_checks and self.__dict__.pop("_host_count_stale", False):
            self._seen = self.seen_tokens  # after compiled steps: one read of the device counter
        if self.static and host_checks and self._seen + num_tokens > self.max_cache_len:
            raise ValueError(f"the static cache holds {self._seen} of max_cache_len={self.max_cache_len} "
                             f"tokens and cannot take {num_tokens} more")

    def host_length(self) -> Optional[int]:
        """Tokens held as a Python int, or None for a static cache (its length lives in a device counter, which a
        compiled or captured decode step must not read)."""
        return None if self.static else self.seen_tokens

    def host_count(self) -> Optional[int]:
        """Tokens held as known on the host without a device read (static: the host count kept beside the device
        counter), for shape checks only; None while tracing or when compiled steps ran since the last check."""
        if _compiling() or self.__dict__.get("_host_count_stale", False):
            return None
        return self._seen

    def mask_geometry(self, num_tokens: int, device) -> Tuple[int, torch.Tensor]:
        """``(key_length, query_positions [num_tokens])``: the keys an MLA layer attends over after this forward's
        update (static: the whole buffer) and the absolute positions of the new tokens (static: from the device
        counter, no host read)."""
        if self.static:
            return int(self.max_cache_len), self._pos + torch.arange(num_tokens, device=device)
        past = self.seen_tokens
        return past + num_tokens, past + torch.arange(num_tokens, device=device)

    def keeps_padding_history(self) -> bool:
        """True: this cache remembers which cached tokens were padding (``update_key_mask``), so a later forward may
        pass only the new tokens' mask columns."""
        return True

    def last_hidden_state(self) -> Optional[torch.Tensor]:
        """``[B, D]``: the final hidden state of each row's last real token before this forward (dynamic cache), or
        None."""
        return None if self.static else self.last_hidden

    def end_forward(self, num_tokens: int, last_hidden: Optional[torch.Tensor]) -> None:
        """After every layer has seen the ``num_tokens`` new tokens: keep ``last_hidden [B, D]`` (dynamic cache)
        and move the position counter."""
        if not self.static and last_hidden is not None:
            self.last_hidden = last_hidden.detach().clone()
        self.advance(num_tokens)

    def count_replayed_tokens(self, num_tokens: int) -> None:
        """Static mode: ``num_tokens`` were written by a replayed CUDA graph (which advanced the device counter but
        ran no Python): keep the host count of :meth:`prepare`'s room check in step."""
        self._seen += int(num_tokens)

    def kda_states(self, layer_idx: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """KDA layer ``layer_idx``'s ``(conv window [B, 3P, W], recurrent state [B, H, K, V] fp32)`` to continue
        from, or ``(None, None)`` without one (a static cache's zeroed buffers are returned: zero is "no state")."""
        layer = self.layers[layer_idx]
        if layer.recurrent_states[0] is None or not (self.static or self.seen_tokens > 0):
            return None, None
        return layer.conv_states[0], layer.recurrent_states[0]

    def kda_update(self, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                   recorded: bool = False) -> None:
        """Store KDA layer ``layer_idx``'s new ``conv_state [B, 3P, W]`` and ``recurrent_state [B, H, K, V]`` fp32
        (in place where the buffers allow, see :func:`kda_store`). ``recorded``: the step went through
        :meth:`kda_run_recorded`; otherwise the layer's rollback record ends here."""
        if not recorded:
            self.records[layer_idx] = None
        kda_store(self.layers[layer_idx], conv_state, recurrent_state, fixed=self.static)

    def kda_run_recorded(self, layer_idx: int, run, tokens: Dict[str, torch.Tensor],
                         init_state: Optional[torch.Tensor], conv_state: Optional[torch.Tensor], perm=None,
                         token_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run a KDA step while recording (:meth:`is_recording_past`) and keep its rollback record (module doc).

        ``run(q, k, v, g, beta, initial_state)`` is the layer's kernel call returning ``(o, final_state)``;
        ``tokens``: ``q, k, v, g [B, T, H, K]``, ``beta [B, T, H]`` and the pre-conv ``x [B, T, 3P]`` of the step
        (padded steps: compacted by ``perm [B, T]``, with ``token_mask [B, T]`` the validity in position order).
        The record is extended when it ends where this call starts and the call is shorter than R =
        ``kda_record_max_tokens``, else a new one is anchored ``min(T, R)`` tokens before the end of the call (the
        state there comes from splitting the kernel call). Returns ``(o, final_state)``."""
        return record_kda_step(self, layer_idx, run, tokens, init_state, conv_state, perm, token_mask)

    # -- used by the layers --------------------------------------------------------------------------------------
    def mla_update(self, layer_idx: int, new_latent: torch.Tensor) -> torch.Tensor:
        """Append ``new_latent [B, T, Dl]`` to MLA layer ``layer_idx``; return every cached latent ``[B, T_all, Dl]``
        (static mode: the whole ``[B, max_cache_len, Dl]`` buffer; rows past the length are masked by the model).

        Raises:
            ValueError: ``layer_idx`` is a KDA layer, or the batch size differs from the cached one.
        """
        layer = self.layers[layer_idx]
        if not isinstance(layer, MLALayerMixin):
            raise ValueError(f"layer {layer_idx} is a {self.layer_types[layer_idx]} layer, not MLA")
        if self.offloading:
            layer.prefetch()
        latent, _ = layer.update(new_latent)
        if self.offloading:
            layer.offload()  # the returned tensor stays on the device for this layer's attention
        return latent

    def update_key_mask(self, new_mask: torch.Tensor, history: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Record the key-padding mask ``[B, T]`` of the current tokens; return the mask of all keys. ``history
        [B, past]``: the caller's mask columns of the cached tokens, ANDed into the kept history (dynamic cache)."""
        new_mask = new_mask.bool()
        if history is not None and self.key_mask is not None and not self.static:
            self.key_mask = history.bool() & self.key_mask
        if self.static:
            T = new_mask.shape[1]
            idx = self._pos + torch.arange(T, device=new_mask.device)
            self.key_mask.index_copy_(1, idx, new_mask)
            return self.key_mask
        if self.key_mask is None or self.seen_tokens == 0:
            self.key_mask = new_mask.clone()  # never the caller's tensor (or a view of it)
        else:
            if self.key_mask.shape[0] != new_mask.shape[0]:
                raise ValueError(
                    f"cache batch size {self.key_mask.shape[0]} does not match the input batch {new_mask.shape[0]}")
            self.key_mask = torch.cat([self.key_mask, new_mask], dim=1)
        return self.key_mask

    def advance(self, num_tokens: int) -> None:
        """Move the position counter after every layer has seen ``num_tokens`` new tokens."""
        if self._pos is not None:
            self._pos.add_(num_tokens)
        if _compiling():  # (a compiled step must not read a Python count: it would specialise on it)
            self.__dict__["_host_count_stale"] = True
        else:
            self._seen += int(num_tokens)  # static mode: the host count beside the device counter
        if not _compiling():
            for layer in self.layers:
                if is_kda_layer(layer) and layer.recurrent_states[0] is not None:
                    layer.has_previous_state[0] = True

    # -- batch reshaping (beam search, sampling with num_return_sequences, agent forks) -------------------------
    def _map_rows(self, fn) -> None:
        if self.key_mask is not None:
            self.key_mask = fn(self.key_mask)
        if self.last_hidden is not None:
            self.last_hidden = fn(self.last_hidden)

    def _map_all(self, fn) -> None:
        """Apply a batch-row map to every layer (dynamic cache) and to the container's per-row tensors; drops the
        rollback records."""
        self.records = [None] * len(self.layers)
        for layer in self.layers:
            if is_kda_layer(layer):
                kda_map_rows(layer, fn)
            else:
                layer._apply(fn)
        self._map_rows(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: select rows ``beam_idx`` of every KDA conv/recurrent state and MLA latent (drops the
        rollback records; a static cache's buffers are written in place)."""
        self.records = [None] * len(self.layers)
        for layer in self.layers:
            if is_kda_layer(layer) and self.static:
                for t in kda_tensors(layer).values():
                    t.copy_(t.index_select(0, beam_idx.to(t.device)))
            else:
                layer.reorder_cache(beam_idx)
        if self.static:
            self.key_mask.copy_(self.key_mask.index_select(0, beam_idx.to(self.key_mask.device)))
            return
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row order b0,b0,...,b1,b1,...). Dynamic cache only."""
        if self.static:
            raise NotImplementedError("batch_repeat_interleave changes the batch size; use a dynamic cache or fork()")
        self._map_all(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``. Dynamic cache only."""
        if self.static:
            raise NotImplementedError("batch_select_indices changes the batch size; use a dynamic cache")
        self._map_all(lambda t: t[indices.to(t.device)])

    def reset(self) -> None:
        """Forget every token (static buffers are zeroed in place, keeping their addresses)."""
        self.records = [None] * len(self.layers)
        for layer in self.layers:
            if not is_kda_layer(layer):
                layer.reset()
            elif self.static:  # zero in place: the addresses stay
                for t in kda_tensors(layer).values():
                    t.zero_()
                layer.has_previous_state[0] = False
            else:
                kda_drop(layer)
        if self.static and self._static_ready:
            self.key_mask.zero_()
            self._pos.zero_()
        else:
            self.key_mask = None
        self.last_hidden = None
        self.seen_tokens = 0

    # -- rollback -------------------------------------------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Roll the cache back.

        ``max_length <= 0``: remove ``-max_length`` tokens (transformers >= 5.20 semantics, used by assisted decoding;
        ``crop(0)`` is a no-op). ``max_length > 0``: keep the first ``max_length`` tokens (the legacy absolute form).
        Use :meth:`reset` to drop everything.

        MLA latents are sliced. KDA states are replayed from the rollback record (see the module doc), so the
        target must lie inside it: ``activate_past_recording()`` must have been on during the forwards being undone.

        Raises:
            ValueError: more tokens to remove than the cache holds, a length beyond the current one, or a target
                before the recorded window of a KDA layer (or no record at all).
        """
        cur = self.seen_tokens
        if max_length <= 0:
            if -max_length > cur:
                raise ValueError(f"cannot crop {-max_length} tokens from a cache holding {cur}")
            target = cur + max_length
        else:
            if max_length > cur:
                raise ValueError(f"cannot crop to {max_length} tokens: the cache holds only {cur} (crop only removes "
                                 "tokens)")
            target = max_length
        if target == cur:
            return
        # KDA layers first (they may refuse): nothing is changed unless every layer can roll back
        for i, layer in enumerate(self.layers):
            if is_kda_layer(layer):
                rec = self.records[i]
                if rec is None or rec.end != cur or not (rec.anchor <= target <= rec.end):
                    window = ("no tokens are recorded" if rec is None or rec.end != cur else
                              f"its recorded window is positions [{rec.anchor}, {rec.end}]")
                    raise ValueError(
                        f"cannot crop KDA layer {i} from {cur} to {target} tokens: a recurrent state can only be "
                        f"rolled back inside its recorded window, and {window}. Call "
                        f"activate_past_recording() before the forwards to undo (a packed forward, or one run with "
                        f"recording off, ends the record), undo at most kda_record_max_tokens="
                        f"{self.config.kda_record_max_tokens} tokens, or use snapshot()/restore() for longer "
                        f"rollbacks")
        for i, layer in enumerate(self.layers):
            if is_kda_layer(layer):
                state, window = self.records[i].rollback(target)
                kda_store(layer, window, state, fixed=self.static)
            else:
                layer.crop(target - cur)
        if self.key_mask is not None and not self.static:
            self.key_mask = self.key_mask[:, :target].clone()
        self.last_hidden = None  # it belonged to a removed token
        if self.static:
            self._pos.fill_(target)
            self.key_mask[:, target:] = False
        self.seen_tokens = target

    # -- agent sessions ------------------------------------------------------------------------------------------
    def snapshot(self) -> "KimiHybridCache":
        """A detached deep copy of the cache (rollback records dropped; the recording switch is kept)."""
        new = KimiHybridCache(self.config, max_cache_len=self.max_cache_len, offloading=self.offloading)
        for a, b in zip(new.layers, self.layers):
            if is_kda_layer(b):
                t = kda_tensors(b)
                kda_store(a, *(t[n].detach().clone() if n in t else None for n in ("conv_state", "recurrent_state")))
                a.has_previous_state[0] = b.has_previous_state[0]
                a.device = b.device
            else:
                if b.latent is not None:
                    a.latent = b.latent.detach().clone()
                if b.is_initialized:
                    a.device = b.device
        new.key_mask = None if self.key_mask is None else self.key_mask.clone()
        new.last_hidden = None if self.last_hidden is None else self.last_hidden.detach().clone()
        new._pos = None if self._pos is None else self._pos.clone()
        new._seen = self._seen
        new._static_ready = self._static_ready
        if self.recording:
            new.activate_past_recording()
        new.fingerprint = dict(self.fingerprint)
        return new

    def to_static(self, max_cache_len: int) -> "KimiHybridCache":
        """A new static cache of ``max_cache_len`` positions holding this cache's tokens (same batch, dtypes and
        device): KDA windows and states copied, MLA latents and the key mask in the first ``seen_tokens`` rows.

        Raises:
            ValueError: the cache is empty or holds more tokens than ``max_cache_len``.
        """
        T = self.seen_tokens
        if T > max_cache_len:
            raise ValueError(f"the cache holds {T} tokens, more than max_cache_len={max_cache_len}")
        held = [t for layer in self.layers for t in layer_tensors(layer).values()]
        if not held:
            raise ValueError("to_static needs a filled cache (run a prefill first)")
        kda = [layer.conv_states[0] for layer in self.layers if is_kda_layer(layer) and layer.conv_states[0] is not None]
        dtype = kda[0].dtype if kda else held[0].dtype
        st = KimiHybridCache(self.config, max_cache_len=max_cache_len, batch_size=self.batch_size, dtype=dtype,
                             device=held[0].device)
        st.copy_state_from(self)
        return st

    def copy_state_from(self, src: "KimiHybridCache") -> None:
        """Make this cache hold the tokens of ``src`` (same model and batch; either kind): a static cache in place
        (its buffers keep their addresses, so a graph captured over them stays valid; rows past ``src``'s length
        zeroed), a dynamic one with copies of exactly ``src``'s length. Rollback records are dropped, the recording
        switch follows ``src``.

        Raises:
            ValueError: a static cache smaller than ``src``'s length, or another batch size.
        """
        T = src.seen_tokens
        if self.static and T > self.max_cache_len:
            raise ValueError(f"the cache holds {T} tokens, more than max_cache_len={self.max_cache_len}")
        if self.batch_size is not None and src.batch_size is not None and src.batch_size != self.batch_size:
            raise ValueError(f"the cache holds batch {src.batch_size} but this cache holds batch {self.batch_size}")
        self.reset()
        for a, b in zip(self.layers, src.layers):
            if is_kda_layer(a):
                t = kda_tensors(b)
                if t:
                    kda_store(a, *(t[n] if self.static else t[n].clone() for n in ("conv_state", "recurrent_state")),
                              fixed=self.static)
            elif b.latent is None:
                continue
            elif self.static:
                a.latent[:, :T].copy_(b.latent[:, :T])
            else:
                a.latent = b.latent[:, :T].clone()
        if src.key_mask is not None and self.static:
            self.key_mask[:, :T].copy_(src.key_mask[:, :T])
        elif src.key_mask is not None:
            self.key_mask = src.key_mask[:, :T].clone()
        if src.recording:
            self.activate_past_recording()
        else:
            self.deactivate_past_recording()
        self.seen_tokens = T

    def fork(self, batch_repeats: int = 1) -> "KimiHybridCache":
        """An independent copy to continue from (an agent branch, or one shared prefix for many prompts): a
        :meth:`snapshot`, with every row repeated ``batch_repeats`` times (row order b0, b0, ..., b1, b1, ...)."""
        new = self.snapshot()
        if batch_repeats != 1:
            if batch_repeats < 1:
                raise ValueError(f"batch_repeats must be >= 1, got {batch_repeats}")
            new.batch_repeat_interleave(int(batch_repeats))
        return new

    def restore(self, snap: "KimiHybridCache") -> None:
        """Make this cache equal to ``snap`` (a :meth:`snapshot` of a cache of the same model and batch size).

        Raises:
            TypeError: ``snap`` is not a KimiHybridCache.
            ValueError: the snapshot comes from another model or holds another batch size.
        """
        if not isinstance(snap, KimiHybridCache):
            raise TypeError(f"restore() takes a KimiHybridCache snapshot, got {type(snap).__name__}")
        if snap.fingerprint != self.fingerprint:
            raise ValueError("this snapshot was taken from a model with another layer plan / cache widths: "
                             f"{_diff(snap.fingerprint, self.fingerprint)}")
        if self.batch_size is not None and snap.batch_size is not None and snap.batch_size != self.batch_size:
            raise ValueError(f"snapshot holds batch {snap.batch_size} but this cache holds batch {self.batch_size}")
        if self.static and self._static_ready:
            if not snap.static or snap.max_cache_len != self.max_cache_len:
                raise ValueError("a static cache can only restore a snapshot of a static cache of the same size")
            self.records = [None] * len(self.layers)  # they described the history that was just replaced
            for a, b in zip(self.layers, snap.layers):
                if is_kda_layer(a):
                    tb = kda_tensors(b)
                    for name, t in kda_tensors(a).items():
                        t.copy_(tb[name])
                    a.has_previous_state[0] = b.has_previous_state[0]
                else:
                    a.latent.copy_(b.latent)
            self.key_mask.copy_(snap.key_mask)
            self._pos.copy_(snap._pos)
            self.seen_tokens = snap.seen_tokens
            return
        if snap.static != self.static:
            raise ValueError(f"cannot restore a {'static' if snap.static else 'dynamic'} snapshot into a "
                             f"{'static' if self.static else 'dynamic'} cache; restore into a snapshot's own kind "
                             "(or use the snapshot itself)")
        other = snap.snapshot()
        self.max_cache_len = other.max_cache_len
        self.layers = other.layers
        self.key_mask = other.key_mask
        self.last_hidden = other.last_hidden
        self._pos = other._pos
        self._seen = other._seen
        self._static_ready = other._static_ready
        self.records = [None] * len(self.layers)

    def save(self, path: str) -> None:
        """Save to a safetensors file (format ``kimi-hybrid-cache`` v1): tensors, the config fingerprint, the length
        and a sha256 over every tensor's bytes. Written atomically (temporary file, then rename)."""
        from safetensors.torch import save_file

        tensors: Dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            for name, t in layer_tensors(layer).items():
                tensors[f"layers.{i}.{name}"] = t.detach().contiguous().cpu()
        if self.key_mask is not None:
            tensors["key_mask"] = self.key_mask.detach().to(torch.uint8).contiguous().cpu()
        if self.last_hidden is not None:
            tensors["last_hidden"] = self.last_hidden.detach().contiguous().cpu()
        meta = {
            "format": CACHE_FORMAT,
            "version": str(CACHE_FORMAT_VERSION),
            "fingerprint": json.dumps(self.fingerprint, sort_keys=True),
            "seen_tokens": str(self.seen_tokens),
            "static": json.dumps(self.max_cache_len),
            "sha256": _checksum(tensors),
        }
        tmp = f"{path}.tmp-{os.getpid()}"
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str, config, device=None) -> "KimiHybridCache":
        """Load a cache saved by :meth:`save` for a model with ``config``.

        Raises:
            ValueError: not a kimi-hybrid cache file, unknown version, checksum mismatch (corrupt file), or a cache
                of a model whose layer plan / widths differ from ``config`` (the differing fields are named).
        """
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != CACHE_FORMAT:
                raise ValueError(f"{path} is not a kimi-hybrid cache file (metadata format={meta.get('format')!r})")
            if meta.get("version") not in [str(v) for v in READABLE_VERSIONS]:
                raise ValueError(f"{path} has cache format version {meta.get('version')}; this code reads versions "
                                 f"{', '.join(map(str, READABLE_VERSIONS))}")
            version = int(meta["version"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if _checksum(tensors) != meta.get("sha256"):
            raise ValueError(f"{path}: checksum mismatch, the file is corrupt")
        fp = json.loads(meta["fingerprint"])
        want = config_fingerprint(config)
        if "hidden_size" not in fp and "last_hidden" in tensors:  # files written before the fingerprint held it
            fp["hidden_size"] = int(tensors["last_hidden"].shape[-1])
        fp.setdefault("hidden_size", want["hidden_size"])
        if fp != want:
            raise ValueError(f"{path} was saved from a model whose config does not match this one: {_diff(fp, want)}")
        max_len = json.loads(meta.get("static", "null"))
        cache = KimiHybridCache(config, max_cache_len=max_len)
        W = int(config.linear_attn_config["short_conv_kernel_size"])
        for key, t in tensors.items():
            if key == "key_mask":
                cache.key_mask = t.bool()
                continue
            if key == "last_hidden":
                cache.last_hidden = t
                continue
            _, i, name = key.split(".", 2)
            layer = cache.layers[int(i)]
            if name == "conv_state":
                if version == 1 and t.shape[-1] == W - 1:
                    # version 1 kept the W-1 newest inputs; the oldest of a W-wide window is never read by the
                    # convolution of the next token, so a zero column there is exact
                    t = torch.nn.functional.pad(t, (1, 0))
                kda_store(layer, conv_state=t, fixed=cache.static)
            elif name == "recurrent_state":
                kda_store(layer, recurrent_state=t, fixed=cache.static)
            elif name == "latent":
                layer.latent = t
            else:
                raise ValueError(f"{path}: unknown tensor {key!r}")
        seen = int(meta["seen_tokens"])
        if cache.static:
            cache._pos = torch.tensor(seen, dtype=torch.long)
            cache._static_ready = True
        cache.seen_tokens = seen
        for layer in cache.layers:
            if is_kda_layer(layer):
                layer.has_previous_state[0] = seen > 0 and layer.recurrent_states[0] is not None
        if device is not None:
            cache.to(device)
        return cache

    def to(self, device) -> "KimiHybridCache":
        """Move every held tensor to ``device`` (in place; drops the rollback records); returns self."""
        self.records = [None] * len(self.layers)
        for layer in self.layers:
            if is_kda_layer(layer):
                kda_map_rows(layer, lambda t: t.to(device))
                layer.device = torch.device(device)
            elif layer.latent is not None:
                layer.latent = layer.latent.to(device)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.to(device)
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden.to(device)
        if self._pos is not None:
            self._pos = self._pos.to(device)
        return self

    # -- memory ----------------------------------------------------------------------------------------------------
    def memory_report(self) -> Dict[str, Any]:
        """Bytes held, per layer type and in total: the storage behind every tensor the cache holds, each storage
        counted once (``untyped_storage().nbytes()``), so a view that keeps a larger buffer alive is counted with
        that whole buffer (meta tensors: their own size).

        Returns a dict: ``kda_bytes`` (conv windows + fp32 recurrent states; split into ``kda_state_bytes`` and
        ``kda_conv_bytes``), ``mla_bytes`` (latents), ``mask_bytes`` (key-padding mask), ``hidden_bytes``
        (``last_hidden``, one hidden state per row), ``rollback_bytes`` (assisted-decoding records),
        ``counter_bytes`` (the static mode's device position counter), ``total_bytes`` (their sum),
        ``seen_tokens``, ``per_layer`` (list of (layer_type, bytes)), and the formula values ``mla_bytes_per_token``
        and ``kda_bytes_constant`` for the current batch size and dtypes (what the tensors need, for comparison).
        """
        seen_storage = set()

        def held(*tensors) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                key = _storage_key(t)
                if key in seen_storage:
                    continue
                seen_storage.add(key)
                total += t.untyped_storage().nbytes()
            return total

        per_layer = []
        kda_state = kda_conv = mla = rec = 0
        for t, layer, record in zip(self.layer_types, self.layers, self.records):
            if t == LINEAR:
                s, c = held(layer.recurrent_states[0]), held(layer.conv_states[0])
                kda_state += s
                kda_conv += c
                per_layer.append((t, s + c))
                rec += held(*(record.tensors() if record is not None else ()))
            else:
                b = held(layer.latent)
                mla += b
                per_layer.append((t, b))
        mask = held(self.key_mask)
        hid = held(self.last_hidden)
        counter = held(self._pos)
        B = self.batch_size or 0
        H, K, W, Dl = self._dims()
        lat_dtype = next((l.latent.element_size() for l in self.layers
                          if isinstance(l, MLALayerMixin) and l.latent is not None), 0)
        conv_dtype = next((l.conv_states[0].element_size() for l in self.layers
                           if is_kda_layer(l) and l.conv_states[0] is not None), 0)
        n_mla, n_kda = self.layer_types.count(FULL), self.layer_types.count(LINEAR)
        kda = kda_state + kda_conv
        return {
            "seen_tokens": self.seen_tokens,
            "batch_size": B,
            "kda_bytes": kda,
            "kda_state_bytes": kda_state,
            "kda_conv_bytes": kda_conv,
            "mla_bytes": mla,
            "mask_bytes": mask,
            "hidden_bytes": hid,
            "rollback_bytes": rec,
            "counter_bytes": counter,
            "total_bytes": kda + mla + mask + hid + rec + counter,
            "mla_bytes_per_token": B * n_mla * Dl * lat_dtype,
            "kda_bytes_constant": B * n_kda * (3 * H * K * W * conv_dtype + H * K * K * 4),
            "per_layer": per_layer,
        }


class KimiHybridDynamicCache(KimiHybridCache, DynamicCache):
    """The dynamic :class:`KimiHybridCache` (``KimiHybridCache(config)``): MLA latents grow by concatenation; a
    transformers ``DynamicCache``. See :class:`KimiHybridCache` for the arguments."""


class KimiHybridStaticCache(KimiHybridCache, StaticCache):
    """The static :class:`KimiHybridCache` (``KimiHybridCache(config, max_cache_len=N)``): every buffer
    pre-allocated with a fixed address; a transformers ``StaticCache``. See :class:`KimiHybridCache`."""

    def __init__(self, config, max_cache_len: Optional[int] = None, *args, **kwargs):
        if max_cache_len is None:
            raise ValueError("KimiHybridStaticCache needs max_cache_len (a positive int); use KimiHybridCache(config) "
                             "for a dynamic cache")
        super().__init__(config, max_cache_len, *args, **kwargs)


def layer_tensors(layer) -> Dict[str, torch.Tensor]:
    """Every tensor a cache layer holds, by name: ``conv_state`` / ``recurrent_state`` (KDA) or ``latent`` (MLA)."""
    return kda_tensors(layer) if is_kda_layer(layer) else layer.tensors()


def _checksum(tensors: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k]
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _diff(a: Dict[str, Any], b: Dict[str, Any]) -> str:
    keys = sorted(set(a) | set(b))
    parts = [f"{k}: cache has {a.get(k)!r}, model has {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
    return "; ".join(parts) or "(no difference)"
