# coding=utf-8
"""``KimiHybridCache``: the hybrid decoding cache of Kimi-Linear / Kimi K3.

* KDA layers (``linear_attention``) hold a fixed-size state whatever the context length: the short-conv window of
  the last ``W-1`` pre-conv q|k|v inputs, ``[B, 3*H*K, W-1]`` in the model dtype, and the delta-rule recurrent state
  ``[B, H, K, V]`` in float32.
* MLA layers (``full_attention``) hold only the compressed latent of each token: the RMS-normalised ``c_kv``
  (``kv_lora_rank``) concatenated with the shared ``k_pe`` (``qk_rope_head_dim``), ``[B, T, kv_lora_rank + rope]``
  (576 values per token for Kimi-Linear), never per-head K/V.

The sequence length comes from a position counter (``seen_tokens``), never from layer 0 (often a KDA layer).

Modes: dynamic (latents grow by concatenation) and static (``max_cache_len`` given, or
``generate(..., cache_implementation="static")``): every buffer is pre-allocated at the first forward and updated in
place at positions taken from a device counter ``_pos`` (``seen_tokens`` reads it), so a decode step has fixed shapes
and addresses and no Python int that changes per step: it compiles to one graph (``torch.compile``) or can be
CUDA-graph captured. Zeroed KDA buffers are the "no state yet" state. Batch-changing operations
(``batch_repeat_interleave``, ``batch_select_indices``) need a dynamic cache.

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
load), and ``memory_report`` (bytes per layer type, byte-exact against the tensors held). Prefix reuse:
``KimiHybridForCausalLM.prefill_prefix`` runs a shared prefix once; ``fork()`` its cache per continuation or call
``generate_from_prefix`` for a batch (``examples/bench_prefix_reuse.py`` measures the time saved).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Any, Dict, List, Optional

import torch
from transformers.cache_utils import Cache

try:  # relative import inside the package / Hub bundle
    from .kda_kimi_hybrid import kda_chunk, kda_recurrent
except ImportError:  # pragma: no cover
    from kda_kimi_hybrid import kda_chunk, kda_recurrent  # type: ignore

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


class KDALayerCache:
    """Cache of one KDA layer: ``conv_state [B, C, W-1]`` (C = 3*H*K, model dtype) and ``recurrent_state
    [B, H, K, V]`` (float32). ``None`` until the first forward. ``record`` holds the rollback anchor (see module doc).
    """

    layer_type = LINEAR

    def __init__(self):
        self.conv_state: Optional[torch.Tensor] = None
        self.recurrent_state: Optional[torch.Tensor] = None
        self.record: Optional[Dict[str, Any]] = None

    def tensors(self) -> Dict[str, torch.Tensor]:
        out = {}
        if self.conv_state is not None:
            out["conv_state"] = self.conv_state
        if self.recurrent_state is not None:
            out["recurrent_state"] = self.recurrent_state
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def record_nbytes(self) -> int:
        if not self.record:
            return 0
        return sum(t.numel() * t.element_size() for t in self.record.values() if isinstance(t, torch.Tensor))

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

    def rollback(self, target: int, in_place: bool = False) -> None:
        """Set the conv window and recurrent state to their values at position ``target`` (inside the record);
        the record is trimmed to end there. ``in_place``: copy into the existing buffers (static mode)."""
        rec = self.record
        m = target - rec["anchor"]
        state, window = replay_record(rec, m)
        for name in self.RECORD_KEYS:
            rec[name] = rec[name][:, :m]
        rec["end"] = int(target)
        if in_place:
            self.conv_state.copy_(window)
            self.recurrent_state.copy_(state)
        else:
            self.conv_state = window.clone()
            self.recurrent_state = state.clone()


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


class MLALayerCache:
    """Cache of one MLA layer: ``latent [B, T, kv_lora_rank + rope]`` (normalised c_kv | k_pe), model dtype.
    In static mode ``latent`` is ``[B, max_cache_len, ...]`` and only the first ``seen_tokens`` rows are valid."""

    layer_type = FULL

    def __init__(self):
        self.latent: Optional[torch.Tensor] = None

    def tensors(self) -> Dict[str, torch.Tensor]:
        return {} if self.latent is None else {"latent": self.latent}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class KimiHybridCache(Cache):
    """Hybrid cache for :class:`KimiHybridForCausalLM` (a ``transformers`` ``Cache``).

    Args:
        config: a ``KimiHybridConfig`` (its ``layer_types`` decide the per-layer cache class).
        max_cache_len: None for a dynamic cache; an int for the static / pre-allocated mode (CUDA graphs,
            ``torch.compile``), where ``batch_size`` is fixed by the first forward (or given here).
        batch_size, dtype, device: optional eager allocation of the static buffers.

    Per-layer state: ``cache.layers[i]`` is a :class:`KDALayerCache` or :class:`MLALayerCache`.
    The key-padding mask of every token seen so far is kept in ``key_mask [B, T]`` (bool) so that a later forward
    without an ``attention_mask`` still ignores earlier padding. Dynamic mode also keeps ``last_hidden [B, D]``, the
    final hidden state of each row's last real token, so that a forward whose tokens are all padding for a row (a
    right-padded row in the last piece of a chunked prefill) still outputs that row's next-token prediction.
    """

    def __init__(self, config, max_cache_len: Optional[int] = None, batch_size: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None):
        # we manage our own layers; Cache.__init__ would insist on transformers' layer classes
        self.config = config
        self.layer_types = list(config.layer_types)
        self.layers: List[Any] = [KDALayerCache() if t == LINEAR else MLALayerCache() for t in self.layer_types]
        self.fingerprint = config_fingerprint(config)
        self.max_cache_len = max_cache_len
        self.static = max_cache_len is not None
        self._pos: Optional[torch.Tensor] = None  # static mode: device counter (the length lives there)
        self._seen = 0  # dynamic mode: the length
        self.key_mask: Optional[torch.Tensor] = None
        self.last_hidden: Optional[torch.Tensor] = None  # dynamic mode: [B, D] of each row's last real token
        self.recording = False
        self.offloading = False
        self.layer_class_to_replicate = None
        if self.static and batch_size is not None:
            self._allocate_static(batch_size, dtype or torch.get_default_dtype(), device or torch.device("cpu"))

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
            if isinstance(layer, KDALayerCache):
                layer.conv_state = torch.zeros(batch_size, 3 * H * K, W - 1, dtype=dtype, device=device)
                layer.recurrent_state = torch.zeros(batch_size, H, K, K, dtype=torch.float32, device=device)
            else:
                layer.latent = torch.zeros(batch_size, self.max_cache_len, Dl, dtype=dtype, device=device)
        self.key_mask = torch.zeros(batch_size, self.max_cache_len, dtype=torch.bool, device=device)
        self._pos = torch.zeros((), dtype=torch.long, device=device)
        self._static_ready = True

    def ensure_allocated(self, batch_size: int, dtype: torch.dtype, device) -> None:
        """Static mode: allocate the buffers at the first forward. Raises on a batch-size mismatch."""
        if not self.static:
            return
        if getattr(self, "_static_ready", False):
            if self.key_mask.shape[0] != batch_size:
                raise ValueError(
                    f"this static cache holds batch {self.key_mask.shape[0]} but the input has batch {batch_size}")
            return
        self._allocate_static(batch_size, dtype, device)

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
        if self._pos is not None and not self._pos.is_meta:  # (a meta cache, for memory planning, has no values)
            return int(self._pos)
        return self._seen

    @seen_tokens.setter
    def seen_tokens(self, value: int) -> None:
        self._seen = int(value)
        if self._pos is not None:
            self._pos.fill_(int(value))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (a position counter, the same for every layer)."""
        return int(self.seen_tokens)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1 if not self.static else int(self.max_cache_len)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        if self.static:
            return int(self.max_cache_len), 0
        return self.get_seq_length() + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def has_previous_state(self, layer_idx: Optional[int] = None, state_idx: Optional[int] = None) -> bool:
        return self.seen_tokens > 0

    @property
    def batch_size(self) -> Optional[int]:
        return None if self.key_mask is None else self.key_mask.shape[0]

    @property
    def is_compileable(self) -> bool:
        """Only the static mode has fixed shapes and addresses (torch.compile / CUDA graphs)."""
        return bool(self.static)

    @property
    def is_initialized(self) -> bool:
        return self.seen_tokens > 0

    @property
    def is_croppable(self) -> bool:
        return self.recording

    @property
    def is_sliding(self):
        return [False] * len(self.layers)

    @property
    def is_linear(self):
        return [t == LINEAR for t in self.layer_types]

    @property
    def is_dummy(self):
        return [False] * len(self.layers)

    def activate_past_recording(self) -> None:
        """Keep what ``crop`` needs to roll the KDA states back inside the latest forward call (assisted decoding)."""
        self.recording = True

    def deactivate_past_recording(self) -> None:
        """Stop recording and drop the rollback records (frees their memory)."""
        self.recording = False
        for layer in self.layers:
            if isinstance(layer, KDALayerCache):
                layer.record = None

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return self.recording

    def update(self, *args, **kwargs):
        raise NotImplementedError(
            "KimiHybridCache is written by the KimiHybrid layers themselves (update_latent / KDA states); it does not "
            "take per-head key/value tensors")

    # -- used by the layers --------------------------------------------------------------------------------------
    def mla_update(self, layer_idx: int, new_latent: torch.Tensor) -> torch.Tensor:
        """Append ``new_latent [B, T, Dl]`` to MLA layer ``layer_idx``; return every cached latent ``[B, T_all, Dl]``
        (static mode: the whole ``[B, max_cache_len, Dl]`` buffer; rows past the length are masked by the model)."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, MLALayerCache):
            raise ValueError(f"layer {layer_idx} is a {self.layer_types[layer_idx]} layer, not MLA")
        if self.static:
            T = new_latent.shape[1]
            idx = self._pos + torch.arange(T, device=new_latent.device)
            layer.latent.index_copy_(1, idx, new_latent.to(layer.latent.dtype))
            return layer.latent
        if layer.latent is None:
            layer.latent = new_latent
        else:
            if layer.latent.shape[0] != new_latent.shape[0]:
                raise ValueError(
                    f"cache batch size {layer.latent.shape[0]} does not match the input batch {new_latent.shape[0]}")
            layer.latent = torch.cat([layer.latent, new_latent.to(layer.latent.dtype)], dim=1)
        return layer.latent

    def update_key_mask(self, new_mask: torch.Tensor) -> torch.Tensor:
        """Record the key-padding mask ``[B, T]`` of the current tokens; return the mask of all keys."""
        new_mask = new_mask.bool()
        if self.static:
            T = new_mask.shape[1]
            idx = self._pos + torch.arange(T, device=new_mask.device)
            self.key_mask.index_copy_(1, idx, new_mask)
            return self.key_mask
        if self.key_mask is None or self.seen_tokens == 0:
            self.key_mask = new_mask
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

    # -- batch reshaping (beam search, sampling with num_return_sequences, agent forks) -------------------------
    def _map_tensors(self, fn) -> None:
        for layer in self.layers:
            if isinstance(layer, KDALayerCache):
                if layer.conv_state is not None:
                    layer.conv_state = fn(layer.conv_state)
                if layer.recurrent_state is not None:
                    layer.recurrent_state = fn(layer.recurrent_state)
                layer.record = None
            elif layer.latent is not None:
                layer.latent = fn(layer.latent)
        if self.key_mask is not None:
            self.key_mask = fn(self.key_mask)
        if self.last_hidden is not None:
            self.last_hidden = fn(self.last_hidden)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: select rows ``beam_idx`` of every KDA conv/recurrent state and MLA latent."""
        if self.static:
            for layer in self.layers:
                for t in layer.tensors().values():
                    t.copy_(t.index_select(0, beam_idx.to(t.device)))
                if isinstance(layer, KDALayerCache):
                    layer.record = None
            self.key_mask.copy_(self.key_mask.index_select(0, beam_idx.to(self.key_mask.device)))
            return
        self._map_tensors(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (row order b0,b0,...,b1,b1,...)."""
        if self.static:
            raise NotImplementedError("batch_repeat_interleave changes the batch size; use a dynamic cache or fork()")
        self._map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``."""
        if self.static:
            raise NotImplementedError("batch_select_indices changes the batch size; use a dynamic cache")
        self._map_tensors(lambda t: t[indices.to(t.device)])

    def reset(self) -> None:
        """Forget every token (static buffers are zeroed in place)."""
        if self.static and getattr(self, "_static_ready", False):
            for layer in self.layers:
                for t in layer.tensors().values():
                    t.zero_()
                if isinstance(layer, KDALayerCache):
                    layer.record = None
            self.key_mask.zero_()
            self._pos.zero_()
        else:
            for i, t in enumerate(self.layer_types):
                self.layers[i] = KDALayerCache() if t == LINEAR else MLALayerCache()
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
            if isinstance(layer, KDALayerCache):
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
            if isinstance(layer, KDALayerCache):
                layer.rollback(target, in_place=self.static)
            elif layer.latent is not None and not self.static:
                layer.latent = layer.latent[:, :target]
        if self.key_mask is not None and not self.static:
            self.key_mask = self.key_mask[:, :target]
        self.last_hidden = None  # it belonged to a removed token
        if self.static:
            self._pos.fill_(target)
            self.key_mask[:, target:] = False
        self.seen_tokens = target

    # -- agent sessions ------------------------------------------------------------------------------------------
    def snapshot(self) -> "KimiHybridCache":
        """A detached deep copy of the cache (rollback records dropped)."""
        new = KimiHybridCache.__new__(KimiHybridCache)
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("layers", "key_mask", "_pos",
                                                                                    "last_hidden")})
        new.layers = []
        for layer in self.layers:
            c = KDALayerCache() if isinstance(layer, KDALayerCache) else MLALayerCache()
            for name, t in layer.tensors().items():
                setattr(c, name, t.detach().clone())
            new.layers.append(c)
        new.key_mask = None if self.key_mask is None else self.key_mask.clone()
        new.last_hidden = None if self.last_hidden is None else self.last_hidden.detach().clone()
        new._pos = None if self._pos is None else self._pos.clone()
        new.config = self.config
        new.fingerprint = copy.deepcopy(self.fingerprint)
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
            ValueError: the snapshot comes from another model or holds another batch size.
        """
        if not isinstance(snap, KimiHybridCache):
            raise TypeError(f"restore() takes a KimiHybridCache snapshot, got {type(snap).__name__}")
        if snap.fingerprint != self.fingerprint:
            raise ValueError("this snapshot was taken from a model with another layer plan / cache widths: "
                             f"{_diff(snap.fingerprint, self.fingerprint)}")
        if self.batch_size is not None and snap.batch_size is not None and snap.batch_size != self.batch_size:
            raise ValueError(f"snapshot holds batch {snap.batch_size} but this cache holds batch {self.batch_size}")
        if self.static and getattr(self, "_static_ready", False):
            if not snap.static or snap.max_cache_len != self.max_cache_len:
                raise ValueError("a static cache can only restore a snapshot of a static cache of the same size")
            for a, b in zip(self.layers, snap.layers):
                for name, t in a.tensors().items():
                    t.copy_(getattr(b, name))
                if isinstance(a, KDALayerCache):
                    a.record = None  # it described the history that was just replaced
            self.key_mask.copy_(snap.key_mask)
            self._pos.copy_(snap._pos)
            self.seen_tokens = snap.seen_tokens
            return
        other = snap.snapshot()
        self.layers = other.layers
        self.key_mask = other.key_mask
        self.last_hidden = other.last_hidden
        self._pos = other._pos
        self.seen_tokens = other.seen_tokens
        self.static = other.static
        self.max_cache_len = other.max_cache_len
        if self.static:
            self._static_ready = True

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
        cache.seen_tokens = int(meta["seen_tokens"])
        if cache.static:
            cache._pos = torch.tensor(cache.seen_tokens, dtype=torch.long)
            cache._static_ready = True
        if device is not None:
            cache.to(device)
        return cache

    def to(self, device) -> "KimiHybridCache":
        """Move every held tensor to ``device`` (in place); returns self."""
        for layer in self.layers:
            for name, t in layer.tensors().items():
                setattr(layer, name, t.to(device))
            if isinstance(layer, KDALayerCache):
                layer.record = None
        if self.key_mask is not None:
            self.key_mask = self.key_mask.to(device)
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden.to(device)
        if self._pos is not None:
            self._pos = self._pos.to(device)
        return self

    # -- memory ----------------------------------------------------------------------------------------------------
    def memory_report(self) -> Dict[str, Any]:
        """Bytes held, per layer type and in total, summed from the tensors actually held (byte-exact).

        Returns a dict: ``kda_bytes`` (conv windows + fp32 recurrent states; split into ``kda_state_bytes`` and
        ``kda_conv_bytes``), ``mla_bytes`` (latents), ``mask_bytes`` (key-padding mask), ``hidden_bytes``
        (``last_hidden``, one hidden state per row), ``rollback_bytes`` (assisted-decoding records), ``total_bytes``,
        ``seen_tokens``, ``per_layer`` (list of (layer_type, bytes)), and the formula values
        ``mla_bytes_per_token`` and ``kda_bytes_constant`` for the current batch size and dtypes.
        """
        per_layer = []
        kda = mla = rec = kda_state = 0
        for t, layer in zip(self.layer_types, self.layers):
            b = layer.nbytes()
            per_layer.append((t, b))
            if t == LINEAR:
                kda += b
                rec += layer.record_nbytes()
                if layer.recurrent_state is not None:
                    kda_state += layer.recurrent_state.numel() * layer.recurrent_state.element_size()
            else:
                mla += b
        mask = 0 if self.key_mask is None else self.key_mask.numel() * self.key_mask.element_size()
        hid = 0 if self.last_hidden is None else self.last_hidden.numel() * self.last_hidden.element_size()
        B = self.batch_size or 0
        H, K, W, Dl = self._dims()
        lat_dtype = next((l.latent.element_size() for l in self.layers
                          if isinstance(l, MLALayerCache) and l.latent is not None), 0)
        conv_dtype = next((l.conv_state.element_size() for l in self.layers
                           if isinstance(l, KDALayerCache) and l.conv_state is not None), 0)
        n_mla, n_kda = self.layer_types.count(FULL), self.layer_types.count(LINEAR)
        return {
            "seen_tokens": self.seen_tokens,
            "batch_size": B,
            "kda_bytes": kda,
            "kda_state_bytes": kda_state,
            "kda_conv_bytes": kda - kda_state,
            "mla_bytes": mla,
            "mask_bytes": mask,
            "hidden_bytes": hid,
            "rollback_bytes": rec,
            "total_bytes": kda + mla + mask + hid + rec,
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
