# coding=utf-8
"""KimiHybrid's input checks and masks: token ids / labels / masks / position ids validated with clear errors, packed
documents (``cu_seqlens``, transformers' flash-attention keywords, ``seq_idx``, position-id restarts) turned into
boundaries, and the MLA mask of a padded / packed / cached call. Values are read to the host only where a check
needs them, never while tracing or capturing a CUDA graph.
"""

from typing import Optional

import torch

from .compat_kimi_hybrid import compiling as _compiling, graph_capturing as _graph_capturing


def check_input_ids(input_ids: torch.Tensor, vocab_size: int, values: bool = True) -> None:
    """Raise ValueError for input ids that are not ``[batch, seq]`` integers (int32 / int64) with seq >= 1 and, with
    ``values``, values in ``[0, vocab_size)``. The range check reads two values back from the device, so it is
    skipped under torch.compile and during CUDA-graph capture (where an out-of-range id is still caught by the eager
    steps before)."""
    if input_ids.dim() != 2:
        hint = " (add the batch dimension: ids.unsqueeze(0))" if input_ids.dim() == 1 else ""
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}{hint}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids has no tokens (shape [batch, 0]): pass at least one token per row (generate "
                         "with past_key_values: input_ids must be the cached sequence plus at least one new token)")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be integer token ids (torch.long or torch.int32), got dtype "
                         f"{input_ids.dtype}")
    if not values or _compiling() or _graph_capturing(input_ids):
        return
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids holds ids in [{lo}, {hi}] but the vocabulary has {vocab_size} entries "
                         f"(valid ids: 0..{vocab_size - 1}); was the prompt encoded with another model's tokenizer?")


def check_labels(name: str, labels: torch.Tensor, shape, vocab_size: int, ignore_index: int) -> None:
    """Raise ValueError unless ``labels`` are integer token ids of ``shape`` (when given: ``[B, T]``, the logits'
    rows) with values in ``[0, vocab_size)`` or ``ignore_index`` (one host read: a training-time check)."""
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer tensor of token ids (torch.long), got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if shape is not None and tuple(labels.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(labels.shape)} but the input is {tuple(shape)} [batch, seq]")
    if _compiling() or _graph_capturing(labels):
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        v = labels[bad]
        raise ValueError(f"{name} holds ids in [{int(v.min())}, {int(v.max())}] outside the vocabulary of {vocab_size} "
                         f"entries (valid: 0..{vocab_size - 1}, or {ignore_index} to ignore a position)")


def check_attention_mask(mask: torch.Tensor, B: int, T: int, past: int, static: bool) -> None:
    """Raise ValueError unless ``mask`` is 2-D ``[B, cols]`` with cols = T without cached tokens, T or past + T with
    ``past`` cached tokens (dynamic cache), and at least T in static mode (whose length is not read on the host)."""
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D [batch, past + seq] of 0/1, got {mask.dim()}-D")
    cols = mask.shape[1]
    if mask.shape[0] != B:
        raise ValueError(f"attention_mask has batch {mask.shape[0]} but the input has batch {B}")
    if not static and past == 0 and cols != T:
        raise ValueError(f"attention_mask has {cols} columns for {T} tokens and no cached tokens: without a filled "
                         "past_key_values it must be [batch, seq]")
    if not static and past > 0 and cols not in (T, past + T):
        raise ValueError(f"attention_mask has {cols} columns; with {past} cached tokens and {T} new ones it must "
                         f"have {past + T} (past + new) or {T} (new only)")
    if cols < T:
        raise ValueError(f"attention_mask has {cols} columns, fewer than the {T} tokens")


def check_position_ids(position_ids: Optional[torch.Tensor], B: int, T: int) -> Optional[torch.Tensor]:
    """``position_ids`` as ``[B | 1, T]`` integers (a 1-D ``[T]`` is taken as one row for every batch row), or None.
    This model has no rotary embedding: position ids only mark packed documents (a restart at 0).

    Raises:
        ValueError: not integers, more than 2 dimensions, or a shape that is not ``[B | 1, T]`` / ``[T]``.
    """
    if position_ids is None:
        return None
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point() or position_ids.is_complex() \
            or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must be an integer tensor [batch, seq], got "
                         f"{getattr(position_ids, 'dtype', type(position_ids).__name__)}")
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() != 2 or position_ids.shape[1] != T or position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; for input of batch {B} and {T} tokens "
                         f"it must be [{B}, {T}] (or [1, {T}] / [{T}] for every row). generate derives them from "
                         "attention_mask: check that it has one 0/1 column per input token and the input's batch")
    return position_ids.expand(B, T) if position_ids.shape[0] != B else position_ids


def segment_ids_from_positions(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Packed rows: a position id of 0 after the first token starts a new document. Returns ``[B, T]`` or None."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return None
    starts = position_ids == 0
    if not bool(starts[:, 1:].any()):
        return None
    starts = starts.clone()
    starts[:, 0] = True
    return starts.long().cumsum(1)


def packed_segments(cu_seqlens: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], B: int,
                     device: torch.device) -> Optional[torch.Tensor]:
    """Document ids ``[B, T]`` of packed rows: from ``cu_seqlens [N + 1]`` (batch 1 only; ValueError otherwise), else
    from position ids restarting at 0 (see :func:`segment_ids_from_positions`); None when nothing is packed."""
    if cu_seqlens is None:
        return segment_ids_from_positions(position_ids)
    if B != 1:
        raise ValueError("cu_seqlens describes packed documents of batch 1; flatten the batch first")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths).unsqueeze(0)


def cu_seqlens_from_segments(segs: torch.Tensor, T: int) -> torch.Tensor:
    """Boundaries ``[N + 1]`` (int64) of the documents of ``segs [B, T]`` over the ``B * T`` flattened tokens (a row
    end is a boundary too), as KDA's varlen kernels read them."""
    B = segs.shape[0]
    flat = (segs + (torch.arange(B, device=segs.device) * (T + 1)).unsqueeze(1)).reshape(-1)
    change = torch.ones_like(flat, dtype=torch.bool)
    change[1:] = flat[1:] != flat[:-1]
    starts = change.nonzero().flatten()
    return torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.long)


def visible_from_4d_mask(mask: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """``[B, T, T]`` bool (query t sees key s) from a 4-D attention mask ``[B or 1, 1, T, T]``: bool (True =
    attend) or additive float (0 = attend, a large negative value = masked), as transformers' custom 4-D masks.

    Raises ValueError for another shape, a query that sees a later key (this model is causal) or not itself (its
    recurrent layers need the query token in its own sequence)."""
    if mask.shape[1] != 1 or mask.shape[2:] != (T, T) or mask.shape[0] not in (1, B):
        raise ValueError(f"a 4-D attention_mask must be [batch, 1, {T}, {T}] for {T} tokens, got {tuple(mask.shape)}")
    visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] > torch.finfo(mask.dtype).min / 2
    visible = visible.expand(B, T, T)
    if not _compiling():
        eye = torch.eye(T, dtype=torch.bool, device=mask.device)
        if bool((visible & ~torch.ones_like(eye).tril()).any()):
            raise ValueError("the 4-D attention_mask lets a token see a later one; this model is causal")
        if not bool((visible | ~eye).all()):
            raise ValueError("the 4-D attention_mask hides a token from itself; every query must see its own token")
    return visible


def packing_boundaries(cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx, B: int,
                        T: int) -> Optional[torch.Tensor]:
    """The packed-document boundaries ``[N + 1]`` given by any of ``cu_seqlens`` (ours), transformers'
    flash-attention keywords (``cu_seq_lens_q/k``, ``max_length_q/k``, as ``DataCollatorWithFlattening(
    return_flash_attn_kwargs=True)`` makes them) or ``seq_idx [1, T]``; None when none is given.

    Raises ValueError when they disagree with each other or with the input (batch must be 1, the boundaries must
    run from 0 to T, ``max_length_*`` must be the longest document). Value checks read the boundaries on the host
    and are skipped while tracing (torch.compile / export)."""
    if (cu_seq_lens_q is None) != (cu_seq_lens_k is None):
        raise ValueError("pass cu_seq_lens_q and cu_seq_lens_k together (for this causal self-attention model they "
                         "are the same document boundaries)")
    found = [("cu_seqlens", cu_seqlens)] if cu_seqlens is not None else []
    if cu_seq_lens_q is not None:
        found += [("cu_seq_lens_q", cu_seq_lens_q), ("cu_seq_lens_k", cu_seq_lens_k)]
    if seq_idx is not None:
        if seq_idx.dim() != 2 or seq_idx.shape != (1, T):
            raise ValueError(f"seq_idx must be [1, {T}] (document index per token of one packed row), got "
                             f"{tuple(seq_idx.shape)}")
        change = torch.ones(T, dtype=torch.bool, device=seq_idx.device)
        change[1:] = seq_idx[0, 1:] != seq_idx[0, :-1]
        starts = change.nonzero().flatten()
        found.append(("seq_idx", torch.cat([starts, starts.new_tensor([T])]).to(torch.long)))
    if not found:
        if max_length_q is not None or max_length_k is not None:
            raise ValueError("max_length_q / max_length_k given without cu_seq_lens_q / cu_seq_lens_k")
        return None
    if B != 1:
        raise ValueError(f"packed documents ({found[0][0]}) need the batch flattened to 1 row, got batch {B}")
    name0, cu = found[0]
    cu = cu.reshape(-1).to(torch.long)
    if _compiling():
        return cu
    bounds = cu.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name0} must rise from 0 to the {T} tokens of the packed row, got {bounds}")
    for name, other in found[1:]:
        if other.reshape(-1).tolist() != bounds:
            raise ValueError(f"{name} {other.reshape(-1).tolist()} disagrees with {name0} {bounds}: causal "
                             "self-attention packing has one set of document boundaries")
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    for name, value in (("max_length_q", max_length_q), ("max_length_k", max_length_k)):
        if value is not None and int(value) != longest:
            raise ValueError(f"{name}={int(value)} but the longest packed document has {longest} tokens")
    return cu


def build_mla_mask(B: int, T: int, keys_valid, segs, cache, device) -> torch.Tensor:
    """The MLA mask, bool ``[B, 1, T, T_keys]``: causal (query positions and key length from the cache's
    ``mask_geometry``), key padding ``keys_valid [B, >= T_keys]``, same document ``segs [B, T]``; a fully masked row may
    see itself."""
    if cache is not None:
        Tk, q_abs = cache.mask_geometry(T, device)
    else:
        Tk, q_abs = T, torch.arange(T, device=device)
    k_idx = torch.arange(Tk, device=device)
    m = (k_idx.view(1, Tk) <= q_abs.view(T, 1)).unsqueeze(0).expand(B, T, Tk)
    if keys_valid is not None:
        m = m & keys_valid[:, None, :Tk]
    if segs is not None:
        m = m & (segs[:, :, None] == segs[:, None, :])
    diag = k_idx.view(1, 1, Tk) == q_abs.view(1, T, 1)
    m = m | (diag & ~m.any(-1, keepdim=True))
    return m.unsqueeze(1)
