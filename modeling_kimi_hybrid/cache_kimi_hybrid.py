# coding=utf-8
"""``KimiHybridCache``: the hybrid decoding cache of Kimi-Linear / Kimi K3, on transformers' cache layer API.

One layer object per decoder layer (``cache.layers[i]``), each a transformers cache layer that owns its tensors and
its update / reorder / crop / batch operations:

* KDA layers (``linear_attention``): :class:`KDALayer` (a ``LinearAttentionCacheLayerMixin``) holds a fixed-size
  state whatever the context length: the short-conv window of the last ``W-1`` pre-conv q|k|v inputs,
  ``conv_state [B, 3*H*K, W-1]`` in the model dtype, and the delta-rule ``recurrent_state [B, H, K, V]`` in float32
  (``conv_states[0]`` / ``recurrent_states[0]`` in transformers' naming), plus the rollback record (below).
  :class:`StaticKDALayer` pre-allocates both and writes them in place.
* MLA layers (``full_attention``): :class:`DynamicMLALayer` (a ``DynamicLayer``) or :class:`StaticMLALayer` (a
  ``StaticLayer``) hold only the compressed latent of each token: the RMS-normalised ``c_kv`` (``kv_lora_rank``)
  concatenated with the shared ``k_pe`` (``qk_rope_head_dim``), ``latent [B, T, kv_lora_rank + rope]`` (576 values
  per token for Kimi-Linear), never per-head K/V. It is stored as the layer's ``keys``; ``values`` stays ``None``.

Every stored tensor owns exactly its bytes: a layer's update keeps a view only when it is the whole of its storage
and copies it otherwise (the torch short-conv returns its window as a slice of the whole padded prefill input, which
would otherwise stay alive behind a few columns). ``memory_report()`` sums the storages actually held (each counted
once), so nothing hidden behind a view can escape it.

The sequence length comes from one position counter held by the container (``seen_tokens``), never from layer 0
(often a KDA layer). Modes, chosen by the layer classes: dynamic (latents grow by concatenation) and static
(``max_cache_len`` given, or ``generate(..., cache_implementation="static")``): every buffer is pre-allocated at the
first forward (or by ``early_initialization``) and updated in place at positions taken from a device counter
``_pos`` (``seen_tokens`` reads it; every ``StaticMLALayer`` shares that same tensor as its ``cumulative_length``),
so a decode step has fixed shapes and addresses and no Python int that changes per step: it compiles to one graph
(``torch.compile``) or can be CUDA-graph captured. Zeroed KDA buffers are the "no state yet" state. Batch-changing
operations (``batch_repeat_interleave``, ``batch_select_indices``) need a dynamic cache.

Rollback for assisted / speculative decoding (``crop``): a recurrent state cannot be un-applied, so while
``activate_past_recording()`` is on each KDA layer keeps a *record*: the recurrent state and conv window at an anchor
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
* memory: one state copy ``H*K*V`` fp32 + one conv window ``3P*(W-1)`` + at most ``2R`` recorded tokens, each
  ``6P`` values in the model dtype (q, k, v, x) + ``P + H`` fp32 (g, beta) + 1 byte. Kimi-Linear in bf16 (H=32,
  K=V=128, P=4096, R=64): 2 MiB + 72 KiB + 128 * 64.1 KiB = about 10.1 MiB per KDA layer and row at most;
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

A cache of another class (transformers' ``DynamicCache`` / ``StaticCache``, ...) cannot hold this model's state
(no key-padding history, no rollback record, per-head K/V layers): :meth:`KimiHybridCache.from_user_cache` refuses it
with a ValueError instead of silently decoding into a private cache the caller never sees.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionCacheLayerMixin, StaticLayer

try:  # relative import inside the package / Hub bundle
    from .kda_kimi_hybrid import _compiling, kda_chunk, kda_recurrent
except ImportError:  # pragma: no cover
    from kda_kimi_hybrid import _compiling, kda_chunk, kda_recurrent  # type: ignore

CACHE_FORMAT = "kimi-hybrid-cache"
CACHE_FORMAT_VERSION = 1

LINEAR = "linear_attention"
FULL = "full_attention"


def config_fingerprint(config) -> Dict[str, Any]:
    """The config fields a cache depends on (layer plan and every cached tensor's width)."""
    return {
        "layer_types": list(config.layer_types),
        "linear_num_heads": int(config.linear_attn_config["num_heads"]),
        "linear_head_dim": int(config.linear_attn_config["head_dim"]),
        "short_conv_kernel_size": int(config.linear_attn_config["short_conv_kernel_size"]),
        "kv_lora_rank": int(config.kv_lora_rank),
        "qk_rope_head_dim": int(config.qk_rope_head_dim),
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
# KDA layers
# ----------------------------------------------------------------------------------------------------------------

class _RowOps:
    """Batch-row operations of a cache layer, written once over the layer's ``_apply(fn)`` (which maps every tensor it
    holds, ``[batch, ...]``, and drops what cannot follow the rows, e.g. a KDA layer's rollback record)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: keep rows ``beam_idx`` (in that order)."""
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row order b0, b0, ..., b1, b1, ...)."""
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``."""
        self._apply(lambda t: t[indices.to(t.device)])


class _FixedBuffers:
    """What a static layer refuses: its buffers have a fixed batch size and fixed addresses (torch.compile / CUDA
    graphs), so batch changes raise NotImplementedError and offload / prefetch raise ValueError."""

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


class KDALayer(_RowOps, LinearAttentionCacheLayerMixin):
    """Cache of one KDA layer (transformers' linear-attention layer API, one state: ``state_idx`` 0).

    ``conv_state [B, C, W-1]`` (C = 3*H*K, the fused q|k|v channels, model dtype; ``conv_states[0]``) and
    ``recurrent_state [B, H, K, V]`` (float32; ``recurrent_states[0]``); ``None`` until the first forward. Assigning
    either attribute (or calling ``update_conv_state`` / ``update_recurrent_state``) stores a tensor that owns its
    bytes (see :func:`_own`). ``record`` holds the rollback anchor and tokens (see the module doc);
    ``record_past`` mirrors the container's recording switch. Dynamic: batch operations replace the tensors.

    Args:
        conv_width: ``W - 1``, the number of pre-conv inputs kept (``conv_kernel_size[0]``).
    """

    layer_type = LINEAR
    is_sliding = False
    static = False
    is_compileable = False  # assigned, not written in place: no fixed addresses

    def __init__(self, conv_width: Optional[int] = None, **kwargs):
        super().__init__(number_of_states=1)
        self.conv_kernel_size[0] = conv_width
        self.record: Optional[Dict[str, Any]] = None

    def __repr__(self):
        return f"{type(self).__name__}(conv_state={_shape(self.conv_state)}, recurrent_state=" \
               f"{_shape(self.recurrent_state)})"

    # -- the two states ---------------------------------------------------------------------------------------------
    @property
    def conv_state(self) -> Optional[torch.Tensor]:
        """The conv window ``[B, 3*H*K, W-1]`` (model dtype; oldest input first), or None."""
        return self.conv_states[0]

    @conv_state.setter
    def conv_state(self, t: Optional[torch.Tensor]) -> None:
        self._store(self.conv_states, self.is_conv_states_initialized, t)

    @property
    def recurrent_state(self) -> Optional[torch.Tensor]:
        """The recurrent state ``[B, H, K, V]`` (float32), or None."""
        return self.recurrent_states[0]

    @recurrent_state.setter
    def recurrent_state(self, t: Optional[torch.Tensor]) -> None:
        self._store(self.recurrent_states, self.is_recurrent_states_initialized, t)

    def _store(self, slot: dict, flags: dict, t: Optional[torch.Tensor]) -> None:
        if t is None:
            slot[0], flags[0] = None, False
            if not any(self.is_conv_states_initialized.values()) and not any(
                    self.is_recurrent_states_initialized.values()):
                self.has_previous_state[0] = False
            return
        old = slot[0]
        if self.static and old is not None and old.shape == t.shape and old.device == t.device \
                and old.dtype == t.dtype:
            old.copy_(t)  # keep the fixed address
        else:
            slot[0] = _own(t)
        flags[0] = True
        self.has_previous_state[0] = True
        self.device = slot[0].device
        if slot is self.conv_states:
            self.dtype = slot[0].dtype

    def lazy_initialization(self, conv_states: Optional[torch.Tensor] = None,
                            recurrent_states: Optional[torch.Tensor] = None, state_idx: int = 0, **kwargs) -> None:
        """transformers' hook: adopt the device / dtype of the first states (the tensors are stored by the updates)."""
        _check_state_idx(state_idx)
        for t in (conv_states, recurrent_states):
            if t is not None and self.device is None:
                self.device = t.device
        if conv_states is not None:
            self.dtype = conv_states.dtype

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store the conv window ``[B, C, W-1]`` (the W-1 most recent pre-conv inputs, oldest first; a copy when the
        given tensor is a view of a larger buffer) and return the stored tensor."""
        _check_state_idx(state_idx)
        self.conv_state = conv_states
        return self.conv_state

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store the recurrent state ``[B, H, K, V]`` (float32) and return the stored tensor."""
        _check_state_idx(state_idx)
        self.recurrent_state = recurrent_states
        return self.recurrent_state

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The states held, by name (``conv_state``, ``recurrent_state``)."""
        out = {}
        if self.conv_state is not None:
            out["conv_state"] = self.conv_state
        if self.recurrent_state is not None:
            out["recurrent_state"] = self.recurrent_state
        return out

    def record_tensors(self) -> List[torch.Tensor]:
        """Every tensor of the rollback record (empty without one)."""
        return [] if not self.record else [t for t in self.record.values() if isinstance(t, torch.Tensor)]

    def nbytes(self) -> int:
        """Nominal bytes of the states (``memory_report`` counts the storage behind them)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def record_nbytes(self) -> int:
        """Nominal bytes of the rollback record."""
        return sum(t.numel() * t.element_size() for t in self.record_tensors())

    # -- transformers' layer operations -----------------------------------------------------------------------------
    def _apply(self, fn) -> None:
        for name, t in self.tensors().items():
            setattr(self, name, fn(t))
        self.record = None

    def reset(self) -> None:
        """Forget the state (dynamic: drop the tensors)."""
        self.conv_state = None
        self.recurrent_state = None
        self.has_previous_state[0] = False
        self.record = None

    def offload(self) -> None:
        """Move the states to the CPU (``prefetch`` brings them back to the layer's device). The copy is blocking:
        an asynchronous device-to-host copy could be read on the host (save, snapshot) before it lands."""
        for name, t in self.tensors().items():
            device = self.device
            setattr(self, name, t.to("cpu"))
            self.device = device

    def prefetch(self) -> None:
        """Move offloaded states back to the layer's device."""
        if self.device is None:
            return
        device = self.device
        for name, t in self.tensors().items():
            if t.device != device:
                setattr(self, name, t.to(device))

    @property
    def is_croppable(self) -> bool:
        """True while a rollback record covers the latest tokens (see :meth:`crop`)."""
        return self.record is not None

    def activate_past_recording(self) -> None:
        """transformers' switch; the records themselves are written by the model while the container records."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative int, transformers' convention; 0 is a no-op) by
        replaying the rollback record.

        Raises:
            ValueError: a positive count, no record, or a target before the record's anchor.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0:
            return
        rec = self.record
        if rec is None:
            raise ValueError("cannot crop a KDA layer without a rollback record: call activate_past_recording() "
                             "before the forwards to undo")
        target = rec["end"] + tokens_to_remove
        if target < rec["anchor"]:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens: the record reaches back to position "
                             f"{rec['anchor']} of {rec['end']}")
        self.rollback(target)

    # -- rollback record (see the module doc) ----------------------------------------------------------------------
    RECORD_KEYS = ("q", "k", "v", "g", "beta", "x", "valid")

    def start_record(self, anchor: int, state: torch.Tensor, window: torch.Tensor,
                     tokens: Dict[str, torch.Tensor], max_tokens: int) -> None:
        """Start a record at position ``anchor`` with ``state [B, H, K, V]`` fp32 and ``window [B, 3P, W-1]`` there,
        followed by ``tokens`` in position order: ``q, k, v [B, n, H, K]`` (post-conv), ``g [B, n, H, K]``,
        ``beta [B, n, H]``, ``x [B, n, 3P]`` (pre-conv) and ``valid [B, n]`` bool (False = padding: its k, g and
        beta are zero, so it leaves the state alone, and it never enters the conv window)."""
        n = tokens["q"].shape[1]
        self.record = {"anchor": int(anchor), "end": int(anchor) + n, "state": state.detach().clone(),
                       "window": window.detach().clone()}
        for name in self.RECORD_KEYS:
            self.record[name] = tokens[name].detach().clone()
        self._bound_record(max_tokens)

    def extend_record(self, tokens: Dict[str, torch.Tensor], max_tokens: int) -> None:
        """Append the tokens of the next forward call (same layout as :meth:`start_record`)."""
        rec = self.record
        for name in self.RECORD_KEYS:
            rec[name] = torch.cat([rec[name], tokens[name].detach().to(rec[name].dtype)], dim=1)
        rec["end"] += tokens["q"].shape[1]
        self._bound_record(max_tokens)

    def _bound_record(self, max_tokens: int) -> None:
        """Past ``2 * max_tokens`` recorded tokens, move the anchor so that ``max_tokens`` stay (one replay of the
        dropped tokens)."""
        rec = self.record
        n = rec["end"] - rec["anchor"]
        if n > 2 * max_tokens:
            d = n - max_tokens
            rec["state"], rec["window"] = replay_record(rec, d)
            rec["anchor"] += d
            for name in self.RECORD_KEYS:
                rec[name] = rec[name][:, d:].contiguous()

    def rollback(self, target: int) -> None:
        """Set the conv window and recurrent state to their values at position ``target`` (inside the record);
        the record is trimmed to end there (static layers copy into their buffers)."""
        rec = self.record
        m = target - rec["anchor"]
        state, window = replay_record(rec, m)
        for name in self.RECORD_KEYS:
            rec[name] = rec[name][:, :m]
        rec["end"] = int(target)
        # (the replayed tensors may be the record's own anchor tensors: store copies)
        self.conv_state = window.clone()
        self.recurrent_state = state.clone()


class StaticKDALayer(_FixedBuffers, KDALayer):
    """:class:`KDALayer` with both states pre-allocated (:meth:`allocate`, or transformers' lazy initialisation at
    the first update) and written in place, so their addresses never change (torch.compile / CUDA graphs). Zeroed
    buffers are the "no state yet" state; the batch size is fixed."""

    static = True
    is_compileable = True

    def allocate(self, batch_size: int, channels: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device) -> None:
        """Allocate zeroed ``conv_state [batch_size, channels, W-1]`` (``dtype``) and ``recurrent_state
        [batch_size, heads, head_dim, head_dim]`` (float32) on ``device``."""
        conv = torch.zeros(batch_size, channels, self.conv_kernel_size[0], dtype=dtype, device=device)
        state = torch.zeros(batch_size, heads, head_dim, head_dim, dtype=torch.float32, device=device)
        self.conv_states[0], self.recurrent_states[0] = conv, state
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.has_previous_state[0] = False
        self.device, self.dtype = conv.device, conv.dtype
        _static_address(conv)
        _static_address(state)

    def lazy_initialization(self, conv_states: Optional[torch.Tensor] = None,
                            recurrent_states: Optional[torch.Tensor] = None, state_idx: int = 0, **kwargs) -> None:
        """transformers' hook: allocate zeroed buffers shaped like the given states (fixed addresses from then on)."""
        _check_state_idx(state_idx)
        for t, slot, flags in ((conv_states, self.conv_states, self.is_conv_states_initialized),
                               (recurrent_states, self.recurrent_states, self.is_recurrent_states_initialized)):
            if t is not None and slot[0] is None:
                slot[0] = torch.zeros_like(t, memory_format=torch.contiguous_format)
                flags[0] = True
                self.device = t.device
                _static_address(slot[0])

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Copy the window into the buffer (allocated at the first call); return the buffer."""
        if self.conv_state is None:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx)
        return super().update_conv_state(conv_states, state_idx)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Copy the state into the buffer (allocated at the first call); return the buffer."""
        if self.recurrent_state is None:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        return super().update_recurrent_state(recurrent_states, state_idx)

    def reset(self) -> None:
        """Zero the buffers in place (their addresses stay)."""
        for t in self.tensors().values():
            t.zero_()
        self.has_previous_state[0] = False
        self.record = None



_NO_STATIC_OFFLOAD = ("a static KimiHybridCache keeps its buffers at fixed addresses (torch.compile / CUDA graphs); "
                      "offloading would move them. Use a dynamic cache, KimiHybridCache(config, offloading=True), "
                      "to offload the MLA latents to the CPU")


def _check_state_idx(state_idx: int) -> None:
    if state_idx != 0:
        raise ValueError(f"a KDA layer holds one conv / recurrent state (state_idx=0), got state_idx={state_idx}")


def _shape(t: Optional[torch.Tensor]):
    return None if t is None else tuple(t.shape)


def replay_record(rec: Dict[str, Any], m: int):
    """Run the recorded recurrence and conv window forward ``m`` tokens from the anchor.
    Returns ``(state [B, H, K, V] fp32, window [B, 3P, W-1])`` at position ``anchor + m``."""
    state, window = rec["state"], rec["window"]
    if m <= 0:
        return state, window
    args = [rec[name][:, :m] for name in ("q", "k", "v", "g", "beta")]
    run = kda_recurrent if m <= 64 else kda_chunk
    with torch.no_grad():
        _, state = run(*args, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    B, C, W1 = window.shape
    x = torch.cat([window, rec["x"][:, :m].transpose(1, 2).to(window.dtype)], dim=-1)  # [B, C, W1 + m]
    valid = rec["valid"][:, :m]
    if bool(valid.all()):
        return state, x[..., x.shape[-1] - W1:]
    # the last W-1 real inputs of each row, oldest first (pads never enter the window)
    valid = torch.cat([valid.new_ones(B, W1), valid], dim=1)
    order = (~valid).to(torch.int8).argsort(dim=1, stable=True)  # real columns first, in order
    pick = valid.sum(1, keepdim=True) - W1 + torch.arange(W1, device=valid.device).unsqueeze(0)
    cols = order.gather(1, pick)
    return state, x.gather(2, cols.unsqueeze(1).expand(B, C, W1))


# ----------------------------------------------------------------------------------------------------------------
# MLA layers
# ----------------------------------------------------------------------------------------------------------------

class MLALayerMixin(_RowOps):
    """What both MLA layer classes share: the latent ``[B, T or max_cache_len, kv_lora_rank + rope]`` (model dtype)
    is the layer's ``keys``; ``values`` stays ``None`` (the latent serves as both)."""

    layer_type = FULL

    def __repr__(self):
        return f"{type(self).__name__}(latent={_shape(self.keys)})"

    @property
    def latent(self) -> Optional[torch.Tensor]:
        """``[B, T, Dl]`` (dynamic) or ``[B, max_cache_len, Dl]`` (static), model dtype; None before the first
        update. Assigning stores a tensor that owns its bytes."""
        return self.keys

    @latent.setter
    def latent(self, t: Optional[torch.Tensor]) -> None:
        self.keys = _own(t)
        self.is_initialized = t is not None
        if t is not None:
            self.device = t.device
            self.batch_size = t.shape[0]

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensor held, by name (``latent``)."""
        return {} if self.keys is None else {"latent": self.keys}

    def nbytes(self) -> int:
        """Nominal bytes of the latent (``memory_report`` counts the storage behind it)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class DynamicMLALayer(MLALayerMixin, DynamicLayer):
    """Cache of one MLA layer, growing by concatenation: ``latent [B, T, kv_lora_rank + rope]`` (normalised
    c_kv | k_pe, model dtype), stored as the layer's ``keys`` (``values`` stays ``None``: the latent is both)."""

    static = False

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
        if self.keys is None or (self.keys.shape[1] == 0 and self.keys.shape[0] == key_states.shape[0]
                                 and self.keys.dtype == key_states.dtype):
            self.latent = key_states
        else:
            if self.keys.shape[0] != key_states.shape[0]:
                raise ValueError(f"cache batch size {self.keys.shape[0]} does not match the input batch "
                                 f"{key_states.shape[0]}")
            self.keys = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=1)
        return self.keys, None

    def get_seq_length(self) -> int:
        """Tokens held (the latent's length)."""
        return 0 if self.keys is None else int(self.keys.shape[1])

    def _apply(self, fn) -> None:
        if self.keys is not None:
            self.latent = fn(self.keys)

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
            self.keys = self.keys[:, :n + tokens_to_remove].clone()

    def reset(self) -> None:
        """Drop the latent."""
        self.keys = self.values = None
        self.is_initialized = False

    def offload(self) -> None:
        """Move the latent to the CPU (``prefetch`` brings it back to the layer's device). The copy is blocking:
        an asynchronous device-to-host copy could be read on the host (save, snapshot) before it lands."""
        if self.keys is not None:
            self.keys = self.keys.to("cpu")

    def prefetch(self) -> None:
        """Move an offloaded latent back to the layer's device."""
        if self.keys is not None and self.keys.device != self.device:
            self.keys = self.keys.to(self.device)


class StaticMLALayer(_FixedBuffers, MLALayerMixin, StaticLayer):
    """Cache of one MLA layer, pre-allocated: ``latent [B, max_cache_len, Dl]`` (``keys``; ``values`` stays
    ``None``), written in place at the positions of ``cumulative_length``, which is the container's device counter
    itself (shared, never advanced here: the container advances it once per forward). Rows past the length are
    masked by the model."""

    static = True

    def allocate(self, batch_size: int, width: int, dtype: torch.dtype, device) -> None:
        """Allocate the zeroed ``[batch_size, max_cache_len, width]`` buffer (a fixed address)."""
        self.latent = torch.zeros(batch_size, self.max_cache_len, width, dtype=dtype, device=device)
        _static_address(self.keys)

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
        self.keys.index_copy_(1, idx, key_states.to(self.keys.dtype))
        return self.keys, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows ``beam_idx`` copied in place."""
        if self.keys is not None:
            self.keys.copy_(self.keys.index_select(0, beam_idx.to(self.keys.device)))

    def crop(self, tokens_to_remove: int) -> None:
        """Nothing to move: the container's counter goes back, and later writes overwrite the stale rows."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")

    def reset(self) -> None:
        """Zero the buffer in place (the container resets the counter)."""
        if self.keys is not None:
            self.keys.zero_()



# the names the per-layer classes had before they were built on transformers' layer API (isinstance checks)
KDALayerCache = KDALayer
MLALayerCache = MLALayerMixin

# ----------------------------------------------------------------------------------------------------------------
# the container
# ----------------------------------------------------------------------------------------------------------------

class KimiHybridCache(Cache):
    """Hybrid cache for :class:`KimiHybridForCausalLM` (a ``transformers`` ``Cache`` built from its layer API).

    Args:
        config: a ``KimiHybridConfig`` (its ``layer_types`` decide each layer's class).
        max_cache_len: None for a dynamic cache (:class:`KDALayer` + :class:`DynamicMLALayer`); an int for the
            static / pre-allocated mode (:class:`StaticKDALayer` + :class:`StaticMLALayer`; CUDA graphs,
            ``torch.compile``), whose batch size is fixed by the first forward (or given here).
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
        super().__init__(layers=[self._new_layer(t) for t in self.layer_types])
        self.offloading = bool(offloading)
        self.fingerprint = config_fingerprint(config)
        self._pos = None  # static mode: device counter (the length lives there)
        self._seen = 0  # dynamic mode: the length
        self.key_mask: Optional[torch.Tensor] = None
        self.last_hidden: Optional[torch.Tensor] = None  # dynamic mode: [B, D] of each row's last real token
        self.recording = False
        self._static_ready = False
        if self.static and batch_size is not None:
            self._allocate_static(batch_size, dtype or torch.get_default_dtype(), device or torch.device("cpu"))

    def _new_layer(self, layer_type: str):
        if layer_type == LINEAR:
            cls = StaticKDALayer if self.static else KDALayer
            return cls(conv_width=self._dims()[2] - 1)
        return StaticMLALayer(self._max_cache_len) if self.static else DynamicMLALayer()

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
            if isinstance(layer, StaticKDALayer):
                layer.allocate(batch_size, 3 * H * K, H, K, dtype, device)
            else:
                layer.allocate(batch_size, Dl, dtype, device)
        self.key_mask = torch.zeros(batch_size, self.max_cache_len, dtype=torch.bool, device=device)
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
        """transformers' eager allocation (``torch.export``, compiled chunked prefill). The widths come from the
        config, so ``num_heads`` / ``head_dim`` (transformers' per-head K/V shape) are accepted and ignored.

        Static: allocate every buffer for ``batch_size`` rows in ``dtype`` (default: torch's default dtype) on
        ``device`` (default CPU). Dynamic: start each MLA latent empty ``[batch_size, 0, Dl]`` and the key mask
        ``[batch_size, 0]`` (KDA states are created by the first forward, as transformers' linear layers are).

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
        return (f"KimiHybridCache({mode}, seen_tokens={self.get_seq_length()}, "
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
        """``max_cache_len`` (static) or -1 (dynamic: no maximum)."""
        return -1 if not self.static else int(self.max_cache_len)

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
        """KDA layer ``layer_idx``'s conv window ``[B, 3P, W-1]``, or None before its first state (any transformers
        version; transformers' own getter appeared in 5.21)."""
        layer = self._kda(layer_idx)
        _check_state_idx(state_idx)
        return layer.conv_state if layer.has_previous_state[0] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Optional[torch.Tensor]:
        """KDA layer ``layer_idx``'s recurrent state ``[B, H, K, V]`` fp32, or None before its first state."""
        layer = self._kda(layer_idx)
        _check_state_idx(state_idx)
        return layer.recurrent_state if layer.has_previous_state[0] else None

    def _kda(self, layer_idx: int) -> KDALayer:
        layer = self.layers[layer_idx]
        if not isinstance(layer, KDALayer):
            raise ValueError(f"layer {layer_idx} is a {self.layer_types[layer_idx]} (MLA) layer, not a KDA layer")
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
        """Keep what ``crop`` needs to roll the KDA states back (assisted decoding; see the module doc)."""
        self.recording = True
        for layer in self.layers:
            if isinstance(layer, KDALayer):
                layer.record_past = True

    def deactivate_past_recording(self) -> None:
        """Stop recording and drop the rollback records (frees their memory)."""
        self.recording = False
        for layer in self.layers:
            if isinstance(layer, KDALayer):
                layer.record_past = False
                layer.record = None

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
        self.layers[layer_idx].offload()

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """Move layer ``layer_idx``'s offloaded tensors back to its device (synchronously).

        Raises:
            ValueError: a static cache (fixed buffer addresses).
        """
        self.layers[layer_idx].prefetch()

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

    def update_key_mask(self, new_mask: torch.Tensor) -> torch.Tensor:
        """Record the key-padding mask ``[B, T]`` of the current tokens; return the mask of all keys."""
        new_mask = new_mask.bool()
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
        else:
            self._seen += int(num_tokens)
        if not _compiling():
            for layer in self.layers:
                if isinstance(layer, KDALayer) and layer.recurrent_state is not None:
                    layer.has_previous_state[0] = True

    # -- batch reshaping (beam search, sampling with num_return_sequences, agent forks) -------------------------
    def _map_rows(self, fn) -> None:
        if self.key_mask is not None:
            self.key_mask = fn(self.key_mask)
        if self.last_hidden is not None:
            self.last_hidden = fn(self.last_hidden)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: select rows ``beam_idx`` of every KDA conv/recurrent state and MLA latent (drops the
        rollback records)."""
        for layer in self.layers:
            layer.reorder_cache(beam_idx)
        if self.static:
            self.key_mask.copy_(self.key_mask.index_select(0, beam_idx.to(self.key_mask.device)))
            return
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row order b0,b0,...,b1,b1,...). Dynamic cache only."""
        if self.static:
            raise NotImplementedError("batch_repeat_interleave changes the batch size; use a dynamic cache or fork()")
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``. Dynamic cache only."""
        if self.static:
            raise NotImplementedError("batch_select_indices changes the batch size; use a dynamic cache")
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self._map_rows(lambda t: t[indices.to(t.device)])

    def reset(self) -> None:
        """Forget every token (static buffers are zeroed in place, keeping their addresses)."""
        for layer in self.layers:
            layer.reset()
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
            if isinstance(layer, KDALayer):
                rec = layer.record
                if rec is None or rec["end"] != cur or not (rec["anchor"] <= target <= rec["end"]):
                    window = None if rec is None or rec["end"] != cur else (rec["anchor"], rec["end"])
                    raise ValueError(
                        f"cannot crop KDA layer {i} from {cur} to {target} tokens: a recurrent state can only be "
                        f"rolled back inside its recorded window {window} (positions [anchor, end]). Call "
                        f"activate_past_recording() before the forwards to undo (a packed forward, or one run with "
                        f"recording off, ends the record), undo at most kda_record_max_tokens="
                        f"{self.config.kda_record_max_tokens} tokens, or use snapshot()/restore() for longer "
                        f"rollbacks")
        for layer in self.layers:
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
            for name, t in b.tensors().items():
                setattr(a, name, t.detach().clone())
            if isinstance(b, KDALayer):
                a.has_previous_state[0] = b.has_previous_state[0]
                a.device = b.device
            elif b.is_initialized:
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
            for a, b in zip(self.layers, snap.layers):
                for name, t in a.tensors().items():
                    t.copy_(getattr(b, name))
                if isinstance(a, KDALayer):
                    a.record = None  # it described the history that was just replaced
                    a.has_previous_state[0] = b.has_previous_state[0]
            self.key_mask.copy_(snap.key_mask)
            self._pos.copy_(snap._pos)
            self.seen_tokens = snap.seen_tokens
            return
        other = snap.snapshot()
        self.static = other.static
        self.max_cache_len = other.max_cache_len
        self.layers = other.layers
        self.key_mask = other.key_mask
        self.last_hidden = other.last_hidden
        self._pos = other._pos
        self._seen = other._seen
        self._static_ready = other._static_ready
        for layer in self.layers:
            if isinstance(layer, KDALayer):
                layer.record_past = self.recording

    def save(self, path: str) -> None:
        """Save to a safetensors file (format ``kimi-hybrid-cache`` v1): tensors, the config fingerprint, the length
        and a sha256 over every tensor's bytes. Written atomically (temporary file, then rename)."""
        from safetensors.torch import save_file

        tensors: Dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            for name, t in layer.tensors().items():
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
            if meta.get("version") != str(CACHE_FORMAT_VERSION):
                raise ValueError(f"{path} has cache format version {meta.get('version')}; this code reads version "
                                 f"{CACHE_FORMAT_VERSION}")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if _checksum(tensors) != meta.get("sha256"):
            raise ValueError(f"{path}: checksum mismatch, the file is corrupt")
        fp = json.loads(meta["fingerprint"])
        want = config_fingerprint(config)
        if fp != want:
            raise ValueError(f"{path} was saved from a model whose config does not match this one: {_diff(fp, want)}")
        max_len = json.loads(meta.get("static", "null"))
        cache = cls(config, max_cache_len=max_len)
        for key, t in tensors.items():
            if key == "key_mask":
                cache.key_mask = t.bool()
                continue
            if key == "last_hidden":
                cache.last_hidden = t
                continue
            _, i, name = key.split(".", 2)
            setattr(cache.layers[int(i)], name, t)
        seen = int(meta["seen_tokens"])
        if cache.static:
            cache._pos = torch.tensor(seen, dtype=torch.long)
            cache._static_ready = True
        cache.seen_tokens = seen
        for layer in cache.layers:
            if isinstance(layer, KDALayer):
                layer.has_previous_state[0] = seen > 0 and layer.recurrent_state is not None
        if device is not None:
            cache.to(device)
        return cache

    def to(self, device) -> "KimiHybridCache":
        """Move every held tensor to ``device`` (in place; drops the rollback records); returns self."""
        for layer in self.layers:
            for name, t in layer.tensors().items():
                setattr(layer, name, t.to(device))
            if isinstance(layer, KDALayer):
                layer.record = None
        if self.key_mask is not None:
            self.key_mask = self.key_mask.to(device)
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden.to(device)
        if self._pos is not None:
            self._pos = self._pos.to(device)
        return self

    # -- a cache given by the caller -------------------------------------------------------------------------------
    @classmethod
    def from_user_cache(cls, cache: Any, config, use_cache: bool = True) -> Optional["KimiHybridCache"]:
        """The cache a forward of a model with ``config`` should use, given the caller's ``past_key_values``.

        * ``None``: a new dynamic :class:`KimiHybridCache` when ``use_cache``, else None.
        * a :class:`KimiHybridCache` of this model: that object (it is filled in place and stays valid for the
          caller's next call).
        * anything else, transformers' ``DynamicCache`` / ``StaticCache`` included, empty or not: refused. Their
          per-head key / value layers cannot hold this model's state (KDA conv windows and recurrent states, MLA
          latents, the key-padding history, the rollback records), and decoding into a replacement the caller never
          sees would make the caller's object silently stale.

        Raises:
            ValueError: a foreign cache (its class named, and what to pass instead), a legacy tuple / list cache, or
                a KimiHybridCache of a model whose layer plan / widths differ (the differing fields named).
        """
        if cache is None:
            return cls(config) if use_cache else None
        if isinstance(cache, KimiHybridCache):
            want = config_fingerprint(config)
            if cache.fingerprint != want:
                raise ValueError("past_key_values is a cache of another model (its layer plan / widths differ from "
                                 f"this model's config: {_diff(cache.fingerprint, want)})")
            return cache
        fix = ("pass past_key_values=KimiHybridCache(model.config) (add max_cache_len=N for a static, compilable "
               "cache; `from kimi_hybrid import KimiHybridCache`), or leave it None and read the cache the model "
               "returns")
        if isinstance(cache, Cache):
            try:
                held = int(cache.get_seq_length())
            except Exception:  # a cache whose layers cannot report a length (e.g. linear layers only)
                held = None
            what = "an empty" if held == 0 else ("a" if held is None else f"a filled ({held} tokens)")
            raise ValueError(
                f"past_key_values is {what} {type(cache).__name__}; KimiHybrid keeps its state (KDA conv windows and "
                "fp32 recurrent states, MLA latents, the key-padding history) in a KimiHybridCache, which a "
                f"{type(cache).__name__} cannot hold, and it never replaces the caller's cache behind its back: {fix}")
        if isinstance(cache, (tuple, list)):
            raise ValueError(f"past_key_values is a legacy {type(cache).__name__} of tensors, which KimiHybrid does "
                             f"not read: {fix}")
        raise ValueError(f"past_key_values must be a KimiHybridCache or None, got {type(cache).__name__}: {fix}")

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
        for t, layer in zip(self.layer_types, self.layers):
            if t == LINEAR:
                s, c = held(layer.recurrent_state), held(layer.conv_state)
                kda_state += s
                kda_conv += c
                per_layer.append((t, s + c))
                rec += held(*layer.record_tensors())
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
        conv_dtype = next((l.conv_state.element_size() for l in self.layers
                           if isinstance(l, KDALayer) and l.conv_state is not None), 0)
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
            "kda_bytes_constant": B * n_kda * (3 * H * K * (W - 1) * conv_dtype + H * K * K * 4),
            "per_layer": per_layer,
        }


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
