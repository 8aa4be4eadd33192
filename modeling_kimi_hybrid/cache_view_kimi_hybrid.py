# coding=utf-8
"""The cache a KimiHybrid forward reads and writes, resolved once per call from the caller's ``past_key_values``.

Two kinds serve the same interface (the methods the model calls; see :class:`KimiHybridCache`'s "model's interface"
section): a :class:`KimiHybridCache` itself, or :class:`TransformersCacheView` over a user's transformers cache
(``DynamicCache(config=...)`` / ``StaticCache(config=..., max_cache_len=...)``, empty or filled), which is used as
it is (never re-classed, never replaced) through transformers' public cache API only: ``update`` (MLA: ``keys =
c_kv [B, 1, T, kv_lora_rank]``, ``values = k_pe [B, 1, T, qk_rope_head_dim]``, the MLA convention of transformers'
own caches), ``update_conv_state`` / ``update_recurrent_state`` / ``has_previous_state`` and the conv / recurrent
getters (KDA), ``get_seq_length`` / ``get_mask_sizes``.

What a transformers cache cannot hold, and what to do instead:

* padding history: it does not remember which cached tokens were padding, so a forward after a padded one must pass
  the whole ``attention_mask`` (cached + new columns), as with any transformers model; a mask of the new columns
  only is taken as "every cached token real";
* the hidden state of each row's last real token: a forward (after a first one) in which some row holds only
  padding is refused with a ValueError;
* rollback records (assisted / speculative decoding: ``crop``): refused (ValueError) when the cache records its
  past; pass a :class:`KimiHybridCache` (``generate`` builds one).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin, StaticLayer

from .cache_kimi_hybrid import KimiHybridCache
from .compat_kimi_hybrid import linear_attention_states
from .configuration_kimi_hybrid import FULL, LINEAR

_FIX = ("pass past_key_values=KimiHybridCache(model.config) (add max_cache_len=N for a static, compilable cache; "
        "`from kimi_hybrid import KimiHybridCache`), DynamicCache(config=model.config), "
        "StaticCache(config=model.config, max_cache_len=N), or leave it None and read the cache the model returns")


def resolve_cache(past_key_values: Any, config, use_cache: bool):
    """The cache object a forward of a model with ``config`` uses (once per call):

    * None: a new dynamic :class:`KimiHybridCache` when ``use_cache``, else None;
    * a :class:`KimiHybridCache`: itself (checked against ``config``);
    * another transformers ``Cache`` whose layers match this model's layer plan (``DynamicCache(config=...)``,
      ``StaticCache(config=..., max_cache_len=...)``): a :class:`TransformersCacheView` over it (filled in place);
    * anything else: refused.

    Raises:
        ValueError: a refused cache (its class named, and what to pass instead), or a cache of another model.
    """
    if past_key_values is None:
        return TransformersCacheView(DynamicCache(config=config), config) if use_cache else None
    if isinstance(past_key_values, KimiHybridCache):
        return past_key_values.for_model(config)
    if isinstance(past_key_values, Cache):
        return TransformersCacheView(past_key_values, config)
    if isinstance(past_key_values, (tuple, list)):
        raise ValueError(f"past_key_values is a legacy {type(past_key_values).__name__} of tensors, which "
                         f"KimiHybrid does not read: {_FIX}")
    raise ValueError(f"past_key_values must be a transformers Cache (KimiHybridCache, DynamicCache, StaticCache) or "
                     f"None, got {type(past_key_values).__name__}: {_FIX}")


class TransformersCacheView:
    """A user's transformers ``Cache`` seen through the model's cache interface (module doc). Holds no state of its
    own; every tensor lives in the user's cache.

    Raises (at construction):
        ValueError: a cache whose layers do not match this model's layer plan (a ``DynamicCache()`` built without
            ``config``, a cache of another model, a quantized / offloaded or encoder-decoder cache), one that holds
            per-head keys / values of another model, or one that records its past for rollback.
    """

    def __init__(self, cache: Cache, config):
        self.cache, self.config = cache, config
        self.layer_types = list(config.layer_types)
        self.rank = int(config.kv_lora_rank)
        self.rope = int(config.qk_rope_head_dim)
        layers = getattr(cache, "layers", None)
        name = type(cache).__name__
        if not isinstance(layers, list) or len(layers) != len(self.layer_types):
            raise ValueError(f"past_key_values is a {name} with {len(layers) if isinstance(layers, list) else 'no'} "
                             f"layers, but this model has {len(self.layer_types)} ({self.layer_types.count(LINEAR)} "
                             f"KDA + {self.layer_types.count(FULL)} MLA; a DynamicCache needs config= to build "
                             f"them): {_FIX}")
        for i, (kind, layer) in enumerate(zip(self.layer_types, layers)):
            want = LinearAttentionCacheLayerMixin if kind == LINEAR else CacheLayerMixin
            if not isinstance(layer, want) or (kind == FULL and isinstance(layer, LinearAttentionCacheLayerMixin)):
                raise ValueError(f"past_key_values is a {name} of another model: its layer {i} is a "
                                 f"{type(layer).__name__}, but that layer of this model is {kind!r}: {_FIX}")
            if kind == LINEAR and getattr(layer, "record_past", False):
                raise ValueError(f"past_key_values is a {name} that records its past for rollback (assisted / "
                                 "speculative decoding); a KDA state can only be rolled back from KimiHybridCache's "
                                 "records: pass past_key_values=KimiHybridCache(model.config) (generate builds one "
                                 "when none is given)")
            keys = getattr(layer, "keys", None) if kind == FULL else None
            if keys is not None and keys.numel() and (keys.shape[1] != 1 or keys.shape[-1] != self.rank
                                                      or layer.values.shape[-1] != self.rope):
                raise ValueError(f"past_key_values is a {name} whose layer {i} holds keys {tuple(keys.shape)} / "
                                 f"values {tuple(layer.values.shape)}, not this model's MLA latent (keys [B, 1, T, "
                                 f"{self.rank}], values [B, 1, T, {self.rope}]): it was filled by another model. "
                                 f"{_FIX}")
        self.mla_idx = next((i for i, t in enumerate(self.layer_types) if t == FULL), None)
        self.static = self.mla_idx is not None and isinstance(layers[self.mla_idx], StaticLayer)
        self._past: Optional[int] = None

    def user_cache(self) -> Cache:
        """The user's cache object (returned by the forward as it was passed)."""
        return self.cache

    def _length(self) -> int:
        if self.mla_idx is None:
            return 0
        return int(self.cache.layers[self.mla_idx].get_seq_length())

    def prepare(self, batch_size: int, num_tokens: int, dtype: torch.dtype, device, host_checks: bool) -> None:
        """Read the cached length once for this forward and check the batch size and the room left.

        Raises:
            ValueError: another batch size than the cached one, or a StaticCache that would overflow.
        """
        self._past = self._length()
        if self.mla_idx is not None and self._past > 0:
            held = self.cache.layers[self.mla_idx].keys.shape[0]
            if held != batch_size:
                raise ValueError(f"the cache holds batch {held} but the input has batch {batch_size}")
        if self.static:
            cap = int(self.cache.layers[self.mla_idx].max_cache_len)
            if self._past + num_tokens > cap:
                raise ValueError(f"the StaticCache holds {self._past} of max_cache_len={cap} tokens and cannot take "
                                 f"{num_tokens} more")

    def host_length(self) -> Optional[int]:
        """Tokens held (read once in :meth:`prepare`); None for a cache of KDA layers only, whose transformers
        layers keep no length."""
        return None if self.mla_idx is None else self._past

    def host_count(self) -> Optional[int]:
        """Tokens held (read once in :meth:`prepare`), for shape checks."""
        return self.host_length()

    def mask_geometry(self, num_tokens: int, device) -> Tuple[int, torch.Tensor]:
        """``(key_length, query_positions [num_tokens])`` as :meth:`KimiHybridCache.mask_geometry`."""
        past = self._past or 0
        if self.static:
            return int(self.cache.layers[self.mla_idx].max_cache_len), past + torch.arange(num_tokens, device=device)
        return past + num_tokens, past + torch.arange(num_tokens, device=device)

    def keeps_padding_history(self) -> bool:
        """False: a transformers cache does not remember padding (module doc)."""
        return False

    def update_key_mask(self, new_mask: torch.Tensor, history: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The key-padding mask ``[B, key_length]`` of this forward: ``history [B, past]`` (the caller's mask columns
        of the cached tokens; all real when None), then ``new_mask [B, T]``, then (StaticCache) False up to its
        capacity."""
        B, T = new_mask.shape
        past = self._past or 0
        old = history.bool() if history is not None else new_mask.new_ones(B, past, dtype=torch.bool)
        keys = torch.cat([old, new_mask.bool()], 1)
        if self.static:
            cap = int(self.cache.layers[self.mla_idx].max_cache_len)
            keys = torch.cat([keys, keys.new_zeros(B, cap - past - T)], 1)
        return keys

    def last_hidden_state(self) -> Optional[torch.Tensor]:
        """None: a transformers cache keeps no hidden state (module doc)."""
        return None

    def end_forward(self, num_tokens: int, last_hidden: Optional[torch.Tensor]) -> None:
        """Nothing to advance: transformers' layers count their own tokens."""
        self._past = None

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        """False: rollback needs a KimiHybridCache (refused at construction)."""
        return False

    def mla_update(self, layer_idx: int, new_latent: torch.Tensor) -> torch.Tensor:
        """Append ``new_latent [B, T, r + rope]`` through ``Cache.update`` (keys = c_kv, values = k_pe, one head);
        return every cached latent ``[B, T_all, r + rope]`` (StaticCache: its whole buffer)."""
        keys, values = self.cache.update(new_latent[:, None, :, :self.rank], new_latent[:, None, :, self.rank:],
                                         layer_idx)
        return torch.cat([keys[:, 0], values[:, 0]], dim=-1)

    def kda_states(self, layer_idx: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(conv window [B, 3P, W], recurrent state [B, H, K, V])`` of KDA layer ``layer_idx``, or ``(None,
        None)`` before its first state."""
        return linear_attention_states(self.cache, layer_idx)

    def kda_update(self, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                   recorded: bool = False) -> None:
        """Store the new W-wide conv window and fp32 recurrent state through ``update_conv_state`` /
        ``update_recurrent_state`` (transformers keeps the newest W columns of what it is given: the window)."""
        self.cache.update_conv_state(conv_state, layer_idx)
        self.cache.update_recurrent_state(recurrent_state.to(torch.float32), layer_idx)
