# coding=utf-8
"""Attention math of KimiHybrid's Multi-head Latent Attention (MLA, DeepSeek-V2 style without rotary, as in
Kimi-Linear-48B-A3B): the cache holds one latent per token, ``latent = [RMSNorm(c_kv) | k_pe]``
(``kv_lora_rank + qk_rope_head_dim`` values), and per-head keys / values are ``kv_b_proj(c_kv)`` split into
``k_nope [nope]`` and ``v [v_dim]``; the key of head ``h`` is ``[k_nope_h | k_pe]`` (``k_pe`` shared by all heads).

Three ways to attend, picked by :func:`attend_decompressed` / :func:`attend_latent`:

* **one shot** (no prefix: keys = the queries' own tokens, plain causal) and every call that records gradients:
  decompress all keys, one ``F.scaled_dot_product_attention`` call (cuDNN / flash / math as SDPA picks).
* **blockwise** (a prefix in the cache, chunked prefill, or a boolean mask), inference only: the keys are decompressed
  one block at a time, each block gives a partial output and its per-row log-sum-exp, and the partials are merged
  exactly (``o = sum_b exp(lse_b - lse) o_b``, ``lse = logaddexp_b lse_b``; the merge of flash attention across key
  blocks). Memory is one key block's K / V plus an fp32 ``[B, H, T, v]`` accumulator, whatever the prefix length;
  v stays at ``v_dim`` (no padding to the query/key width). With a bottom-right causal structure (chunked prefill)
  the prefix blocks are unmasked and the block of the new tokens is plain causal, so on CUDA each block runs in a
  fused kernel that returns the log-sum-exp (cuDNN, else flash with v padded per block, else memory-efficient:
  ``FUSED_ORDER``; the first use on a device checks each candidate against the fp32 reference and keeps the first
  that agrees). With a
  boolean mask, and on CPU, blocks run in plain PyTorch (fp32 scores, queries also blocked to bound the scores).
* **latent** (decode, a few new tokens): attention in latent space, the query absorbs ``W_UK`` and the output
  ``W_UV`` (:func:`attend_latent`).

A fourth way serves transformers' attention interface (``config._attn_implementation`` other than ``"sdpa"``):
:func:`attend_interface` decompresses all keys once and calls a function with transformers' signature (``"eager"``:
:func:`mla_eager_attention_forward`, explicit fp32 probabilities; or a function registered with
``transformers.AttentionInterface``) with an additive float mask (:func:`interface_mask`).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .kernels_kimi_hybrid import load_kernel

__all__ = ["attend_decompressed", "attend_latent", "latent_context", "attend_interface", "decompress_kv",
           "merge_partials",
           "block_attention_lse", "fused_backend", "interface_mask", "mla_eager_attention_forward", "KV_BLOCK_BYTES",
           "SCORE_BLOCK_BYTES"]

# decompressed K + V of one key block (bf16, batch x heads x (qk + v) per token); 2 GiB = 104K tokens at B=1, H=32
KV_BLOCK_BYTES = 2 * 2**30
# fp32 scores of one (query block, key block) tile in the plain-PyTorch block path
SCORE_BLOCK_BYTES = 256 * 2**20


def _compiling() -> bool:
    comp = getattr(torch, "compiler", None)
    return bool(comp is not None and hasattr(comp, "is_compiling") and comp.is_compiling())


def _graph_capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------------------------------------------
# decompression
# ----------------------------------------------------------------------------------------------------------------

def decompress_kv(latent: torch.Tensor, kv_b_proj: Callable[[torch.Tensor], torch.Tensor], num_heads: int,
                  kv_lora_rank: int, nope: int, v_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys and values of ``latent [B, S, kv_lora_rank + rope]``.

    ``kv_b_proj`` is called (a module: a PEFT / quantised wrapper is honoured). Returns ``k [B, S, H, nope + rope]``
    (contiguous) and ``v [B, S, H, v_dim]`` (a view), in the projection's output dtype."""
    B, S, _ = latent.shape
    rope = latent.shape[-1] - kv_lora_rank
    c_kv, k_pe = latent.split([kv_lora_rank, rope], dim=-1)
    kv = kv_b_proj(c_kv).view(B, S, num_heads, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, S, num_heads, rope).to(k_nope.dtype)], dim=-1)
    return k, v


# ----------------------------------------------------------------------------------------------------------------
# one key block -> (partial output, log-sum-exp)
# ----------------------------------------------------------------------------------------------------------------

def _math_block(q, k, v, scale, causal, mask):
    """Plain PyTorch: ``q [B, H, T, d]``, ``k [B, H, S, d]``, ``v [B, H, S, dv]``; ``mask`` bool broadcastable to
    ``[B, H, T, S]`` (True = attend) or None; ``causal``: square top-left causal. Returns ``o [B, H, T, dv]`` fp32
    (0 on rows that see no key) and ``lse [B, H, T]`` fp32 (-inf there). Scores in fp32 (16-bit inputs on CUDA:
    tensor-core products written in fp32, ``bmm_fp32``; elsewhere the inputs are upcast); queries are blocked so
    one fp32 score tile stays under ``SCORE_BLOCK_BYTES``."""
    B, H, T, d = q.shape
    S, dv = k.shape[2], v.shape[-1]
    tc = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if tc:
        kt = k.reshape(B * H, S, d).transpose(1, 2)
        vv = v.reshape(B * H, S, dv)
    else:
        kt, vv = k.float().transpose(-1, -2), v.float()
    qb = max(1, min(T, SCORE_BLOCK_BYTES // max(1, B * H * S * 4)))
    o = torch.empty(B, H, T, dv, device=q.device, dtype=torch.float32)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    for a in range(0, T, qb):
        e = min(T, a + qb)
        if tc:
            s = bmm_fp32(q[:, :, a:e].reshape(B * H, e - a, d), kt).view(B, H, e - a, S).mul_(scale)
        else:
            s = torch.matmul(q[:, :, a:e].float(), kt).mul_(scale)
        if mask is not None:
            s = s.masked_fill(~mask[..., a:e, :], float("-inf"))
        if causal:
            rows = torch.arange(a, e, device=q.device).view(-1, 1)
            s = s.masked_fill(torch.arange(S, device=q.device).view(1, -1) > rows, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        if tc:  # probabilities in the input dtype for the context product, as SDPA does
            pv = bmm_fp32(p.to(v.dtype).view(B * H, e - a, S), vv).view(B, H, e - a, dv)
        else:
            pv = torch.matmul(p, vv)
        o[:, :, a:e] = pv / l.clamp_min(torch.finfo(torch.float32).tiny)
        lse[:, :, a:e] = (m + torch.log(l)).squeeze(-1)
    return o, lse


def _cudnn(q, k, v, scale, causal):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r[0], r[1]


def _flash_padded(q, k, v, scale, causal):
    dv = v.shape[-1]
    vp = F.pad(v, (0, q.shape[-1] - dv)) if dv < q.shape[-1] else v  # one block's v only
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, vp, 0.0, causal, False, scale=scale)
    return r[0][..., :dv], r[1]


def _efficient(q, k, v, scale, causal):
    r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return r[0], r[1]


_FUSED: Dict[str, Callable] = {"cudnn": _cudnn, "flash": _flash_padded, "efficient": _efficient}
# the order candidates are tried in: cuDNN first (unpadded; 544 TFLOP/s useful for one-shot causal 128K at these
# widths on an H200, flash with v padded 261), flash next. kernels/bench_h200.py times each at the long prefill's
# block shapes and reorders this tuple by the measurement.
FUSED_ORDER: Tuple[str, ...] = ("cudnn", "flash", "efficient")
# set to a list to record (backend, causal, q shape, k shape, start event, end event) of every fused block call
PROFILE: Optional[list] = None
_CHOSEN: Dict[tuple, Optional[Tuple[str, float]]] = {}
_CHECK_LOG: Dict[tuple, dict] = {}
_FAILED: Dict[tuple, set] = {}
_FAIL_COUNT: Dict[tuple, Dict[str, int]] = {}


def _lse_as(lse: torch.Tensor, B: int, H: int, T: int) -> torch.Tensor:
    """Kernels return the log-sum-exp as ``[B, H, T]``, ``[B, H, T, 1]`` or padded along T: bring it to [B, H, T]."""
    if lse.dim() == 4:
        lse = lse[..., 0]
    return lse[..., :T].reshape(B, H, T).float()


def _check_candidate(name: str, key: tuple, device, dtype, qk_dim: int, v_dim: int) -> Optional[float]:
    """Run candidate ``name`` once on a small problem against :func:`_math_block`; its lse factor, or None when it
    raised or disagreed. Cached per (device, dtype, widths); the outcome is logged in ``_CHECK_LOG``."""
    done = _CHECK_LOG.setdefault(key, {})
    if name in done:
        return done[name]["lse_factor"] if done[name]["ok"] else None
    gen = torch.Generator(device=device).manual_seed(1234)
    ok, notes, factor = True, [], 1.0
    for causal, T, S in ((False, 67, 131), (True, 93, 93)):
        def mk(n, d):
            return torch.randn(1, n, 2, d, device=device, generator=gen).to(dtype).transpose(1, 2)
        q, k, v = mk(T, qk_dim), mk(S, qk_dim), mk(S, v_dim)
        scale = qk_dim ** -0.5
        ro, rl = _math_block(q, k, v, scale, causal, None)
        try:
            o, lse = _FUSED[name](q, k, v, scale, causal)
            lse = _lse_as(lse, 1, 2, T)
        except Exception as e:  # noqa: BLE001 - a kernel that does not take these shapes / dtype is skipped
            notes.append(f"{type(e).__name__}: {str(e)[:120]}")
            ok = False
            break
        err = ((o.float() - ro).norm() / ro.norm()).item()
        lerr = (lse - rl).abs().max().item()
        if lerr > 2e-2 and (lse * math.log(2) - rl).abs().max().item() < 2e-2:
            factor, lerr = math.log(2), (lse * math.log(2) - rl).abs().max().item()
        tol = 2e-3 if dtype == torch.float32 else 2e-2
        notes.append({"causal": causal, "out_rel_err": err, "lse_max_abs_err": lerr})
        if not (err < tol and lerr < 2e-2):
            ok = False
            break
    done[name] = {"ok": ok, "lse_factor": factor, "checks": notes}
    return factor if ok else None


def fused_backend(device: torch.device, dtype: torch.dtype, qk_dim: int, v_dim: int,
                  exclude=()) -> Optional[Tuple[str, float]]:
    """The fused kernel for unmasked key blocks on ``device`` at this dtype and head widths: the first candidate of
    ``FUSED_ORDER`` (cuDNN, flash with v padded per block, memory-efficient) not in ``exclude`` that passes its
    start-up check: a small problem (odd lengths, causal and not) whose output and log-sum-exp must agree with
    :func:`_math_block` in fp32 (output rel. error < 2e-2 in 16-bit / 2e-3 in fp32, log-sum-exp within 2e-2; a
    base-2 log-sum-exp is recognised and rescaled). A candidate that raised on real blocks of 3 different calls is
    not used again (``_FAILED``). Returns ``(name, lse_factor)`` or None (the plain-PyTorch block path is used).
    Check outcomes are kept in ``_CHECK_LOG``, the choice without exclusions in ``_CHOSEN``."""
    key = (str(device), dtype, qk_dim, v_dim)
    if not exclude and key in _CHOSEN:
        return _CHOSEN[key]
    chosen = None
    for name in FUSED_ORDER:
        if name in exclude or name in _FAILED.get(key, ()):
            continue
        factor = _check_candidate(name, key, device, dtype, qk_dim, v_dim)
        if factor is not None:
            chosen = (name, factor)
            break
    if not exclude:
        _CHOSEN[key] = chosen
    return chosen


def _fused_device(t: torch.Tensor) -> bool:
    """Whether unmasked blocks on t's device go to a fused kernel (CUDA); CPU uses the plain-PyTorch block."""
    return t.is_cuda


def block_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False,
                        mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, H, T, d]`` over one key block ``k [B, H, S, d]``, ``v [B, H, S, dv]`` with its
    log-sum-exp. ``causal`` = square top-left causal (T == S); ``mask`` bool broadcastable to ``[B, H, T, S]``.
    Returns ``o [B, H, T, dv]`` (fp32 or the input dtype) and ``lse [B, H, T]`` fp32 (natural log; -inf on rows that
    see no key of the block, whose o is 0). Unmasked blocks on CUDA run in a fused kernel (:func:`fused_backend`)."""
    if mask is None and _fused_device(q):
        key = (str(q.device), q.dtype, q.shape[-1], v.shape[-1])
        exclude = set()
        while True:
            be = fused_backend(q.device, q.dtype, q.shape[-1], v.shape[-1], frozenset(exclude))
            if be is None:
                break
            try:
                if PROFILE is not None and q.is_cuda:
                    ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    ev[0].record()
                o, lse = _FUSED[be[0]](q, k, v, scale, causal)
                if PROFILE is not None and q.is_cuda:
                    ev[1].record()
                    PROFILE.append((be[0], causal, tuple(q.shape), tuple(k.shape), ev[0], ev[1]))
            except RuntimeError as e:  # a shape the small check did not cover: the next candidate for this block
                if _graph_capturing(q):
                    raise
                exclude.add(be[0])
                fails = _FAIL_COUNT.setdefault(key, {})
                fails[be[0]] = fails.get(be[0], 0) + 1
                _CHECK_LOG.setdefault(key, {}).setdefault("runtime_failures", []).append(
                    f"{be[0]} at q {tuple(q.shape)} x k {tuple(k.shape)}, causal={causal}: {str(e)[:160]}")
                if fails[be[0]] >= 3:
                    _FAILED.setdefault(key, set()).add(be[0])
                    _CHOSEN.pop(key, None)
                continue
            lse = _lse_as(lse, q.shape[0], q.shape[1], q.shape[2])
            return o, (lse * be[1] if be[1] != 1.0 else lse)
    return _math_block(q, k, v, scale, causal, mask)


def merge_partials(acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a block's partial ``(o [B, H, T, dv], lse [B, H, T])`` into the running fp32 ``acc_o [B, H, T, dv]`` /
    ``acc_lse [B, H, T]`` in place (start them at 0 / -inf; views of a row range are fine). Rows at -inf on both
    sides stay at o = 0, lse = -inf."""
    new = torch.logaddexp(acc_lse, lse)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    acc_o.mul_(torch.exp(acc_lse - base).unsqueeze(-1))
    acc_o.add_(o.float().mul_(torch.exp(lse - base).unsqueeze(-1)))
    acc_lse.copy_(new)


# ----------------------------------------------------------------------------------------------------------------
# the decompressed path
# ----------------------------------------------------------------------------------------------------------------

def _causal_offset(attn_mask, T: int, S: int) -> Optional[int]:
    """Keys a query at position i of this call sees: ``j <= i + offset``. None when attn_mask is a dense mask or an
    upper-left CausalBias of a non-square shape (handled as a dense mask)."""
    if attn_mask is None:
        return S - T
    if type(attn_mask).__name__ == "CausalBias":
        # CausalVariant is an IntEnum: str() of it is "1" / "2" on Python >= 3.11, so compare its name
        variant = getattr(getattr(attn_mask, "variant", None), "name", "")
        if variant == "LOWER_RIGHT":
            return S - T
        if T == S:
            return 0
    return None


def attend_decompressed(q: torch.Tensor, latent: torch.Tensor, kv_b_proj: Callable[[torch.Tensor], torch.Tensor],
                        attn_mask, *, num_heads: int, kv_lora_rank: int, nope: int, v_dim: int, scaling: float,
                        key_block: Optional[int] = None) -> torch.Tensor:
    """MLA over decompressed keys / values.

    Args:
        q: ``[B, T, H, nope + rope]`` queries of the new tokens.
        latent: ``[B, S, kv_lora_rank + rope]`` latents of all keys (the prefix from the cache, then the new tokens:
            ``S >= T``; the last T are the queries' own).
        kv_b_proj: the up-projection ``[.., kv_lora_rank] -> [.., H * (nope + v_dim)]`` (called, so adapters apply).
        attn_mask: None (causal: query i sees keys ``j <= i + S - T``), a ``torch.nn.attention.bias.CausalBias``
            (lower right = the same; upper left when square), or bool ``[B | 1, 1, T, S]`` (True = attend).
        key_block: keys per block in the blockwise path (default: ``KV_BLOCK_BYTES`` of decompressed K / V).

    Returns ``[B, T, H, v_dim]`` in q's dtype. One-shot SDPA when there is no prefix (plain causal), when a dense
    mask's keys fit one block, when gradients are recorded, or under torch.compile; else the blockwise path (module
    docstring). Raises ValueError on a mask that is neither bool, a CausalBias nor None.
    """
    B, T, H, Dqk = q.shape
    S = latent.shape[1]
    grad = torch.is_grad_enabled() and (q.requires_grad or latent.requires_grad
                                        or any(p.requires_grad for p in getattr(kv_b_proj, "parameters", list)()))
    off = _causal_offset(attn_mask, T, S)
    if grad or _compiling() or (off == 0 and S == T):
        return _attend_one_shot(q, latent, kv_b_proj, attn_mask, num_heads, kv_lora_rank, nope, v_dim, scaling)
    elt = 2 if q.dtype in (torch.bfloat16, torch.float16) else 4
    blk = key_block or max(16, KV_BLOCK_BYTES // max(1, B * H * (Dqk + v_dim) * elt))
    # whole multiples of 8192 keys: with pieces of 8K multiples the prefix splits into few distinct block shapes
    # (cuDNN builds one execution plan per shape)
    blk = blk // 8192 * 8192 if blk >= 8192 else blk
    if (off is None or off < 0) and S <= blk:  # a dense mask over keys that fit one block: one SDPA call
        return _attend_one_shot(q, latent, kv_b_proj, attn_mask, num_heads, kv_lora_rank, nope, v_dim, scaling)
    qh = q.transpose(1, 2)
    acc_o = torch.zeros(B, H, T, v_dim, device=q.device, dtype=torch.float32)
    acc_lse = torch.full((B, H, T), float("-inf"), device=q.device, dtype=torch.float32)

    def block(s, e, parts):
        """Keys [s, e) decompressed once; ``parts``: (row0, row1, causal, mask) query ranges attending to them."""
        k, v = decompress_kv(latent[:, s:e], kv_b_proj, H, kv_lora_rank, nope, v_dim)
        kh, vh = k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2)
        for a, b, causal, m in parts:
            o, lse = block_attention_lse(qh[:, :, a:b], kh, vh, scaling, causal=causal, mask=m)
            merge_partials(acc_o[:, :, a:b], acc_lse[:, :, a:b], o, lse)
            del o, lse

    if off is not None and off >= 0 and T <= S:
        for s in range(0, off, blk):  # the prefix: every query sees every key
            block(s, min(off, s + blk), [(0, T, False, None)])
        for s in range(off, S, blk):  # the new tokens' own keys, in blocks of their own
            e = min(S, s + blk)
            ra, rb = s - off, e - off  # rows [ra, rb) see this block causally (square), rows >= rb see all of it
            block(s, e, [(ra, rb, True, None)] + ([(rb, T, False, None)] if rb < T else []))
    else:
        mask = attn_mask
        if type(mask).__name__ == "CausalBias":
            mask = mask._materialize(q.device).view(1, 1, T, S)
        if mask is not None and mask.dtype != torch.bool:
            raise ValueError(f"attn_mask must be a bool tensor [B, 1, T, S], a CausalBias or None; got {mask.dtype}")
        check = not _graph_capturing(q)
        # masked blocks run in plain PyTorch: smaller key blocks keep its score tiles >= 512 query rows tall
        blk = key_block or min(blk, max(16, SCORE_BLOCK_BYTES // max(1, B * H * 4 * 512)))
        for s in range(0, S, blk):
            e = min(S, s + blk)
            m = mask[..., s:e] if mask is not None else None
            if m is not None and check and not bool(m.any()):
                continue  # no query sees this block (e.g. the unused tail of a static cache)
            block(s, e, [(0, T, False, m)])
    return acc_o.to(q.dtype).transpose(1, 2)


def _attend_one_shot(q, latent, kv_b_proj, attn_mask, H, r, nope, v_dim, scaling):
    B, T, _, Dqk = q.shape
    k, v = decompress_kv(latent, kv_b_proj, H, r, nope, v_dim)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if attn_mask is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=T > 1, scale=scaling)
    elif type(attn_mask).__name__ == "CausalBias" and qh.is_cuda and v_dim < Dqk:
        # training through a prefix (rare): flash serves the bottom-right bias only when q, k and v share a head dim
        vp = F.pad(vh, (0, Dqk - v_dim))
        o = F.scaled_dot_product_attention(qh, kh, vp, attn_mask=attn_mask, scale=scaling)[..., :v_dim]
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask, scale=scaling)
    return o.transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# the latent path (decode)
# ----------------------------------------------------------------------------------------------------------------

_OUT_DTYPE_OK: Dict[tuple, bool] = {}


def bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` batched, result in float32. For bf16 / fp16 inputs the product is written directly in fp32 where
    torch supports ``bmm(..., out_dtype=torch.float32)`` (CUDA, torch >= 2.8), else computed in the input dtype and
    cast (fp32 accumulation either way, rounded once to the input dtype in the fallback)."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    key = (a.device.type, a.dtype)
    if _compiling():  # no try/except under dynamo: use what the eager warm-up found
        return torch.bmm(a, b, out_dtype=torch.float32) if _OUT_DTYPE_OK.get(key) else torch.bmm(a, b).float()
    if _OUT_DTYPE_OK.get(key, True):
        try:
            out = torch.bmm(a, b, out_dtype=torch.float32)
            _OUT_DTYPE_OK[key] = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_OK[key] = False
    return torch.bmm(a, b).float()


def latent_context(qf: torch.Tensor, latent: torch.Tensor, attn_mask: Optional[torch.Tensor], *, num_heads: int,
                   kv_lora_rank: int, scaling: float) -> torch.Tensor:
    """The latent-space attention context (the reference of the split-KV decode kernel): ``qf [B, T*H, r + rope]``
    absorbed queries (row ``t * H + h``), ``latent [B, S, r + rope]``, ``attn_mask`` bool ``[B | 1, 1, T, S]`` or
    None. Returns ``softmax(scaling * qf . latent^T) @ c_kv`` ``[B, T*H, r]`` in the latent's dtype; scores and
    softmax in fp32, probabilities cast to the latent dtype for the context product, as SDPA does."""
    B, M, _ = qf.shape
    S, T = latent.shape[1], M // num_heads
    scores = bmm_fp32(qf, latent.transpose(1, 2).to(qf.dtype))  # [B, T*H, S] fp32
    scores = scores.view(B, T, num_heads, S).mul_(scaling)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask.transpose(1, 2), float("-inf"))  # [B|1, T, 1, S]
    p = scores.softmax(-1).to(latent.dtype).view(B, M, S)
    return torch.bmm(p, latent[..., :kv_lora_rank])


def attend_latent(q: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor, attn_mask, *, num_heads: int,
                  kv_lora_rank: int, nope: int, v_dim: int, scaling: float) -> torch.Tensor:
    """Attention in latent space (decode): ``q [B, T, H, nope + rope]``, ``latent [B, S, r + rope]`` (the cache),
    ``kv_b_weight [H * (nope + v_dim), r]`` (``kv_b_proj.weight``), ``attn_mask`` bool ``[B, 1, T, S]`` / a
    ``CausalBias`` / None (bottom-right causal). Returns ``[B, T, H, v_dim]``.

    With ``W_UK [H, nope, r]`` and ``W_UV [H, v, r]`` the two slices of ``kv_b_weight``:
    ``score[t, h, s] = <q_nope W_UK | q_pe, c_kv[s] | k_pe[s]>`` and ``out = (p @ c_kv) W_UV^T``. Because the
    absorbed query ``[q_nope W_UK | q_pe]`` has the latent's own layout (r + rope values), all heads and query tokens
    form one ``[T*H, r + rope] x [r + rope, S]`` product against the cache (MQA over one shared latent "head"): the
    step reads each cached latent once for the scores and its ``c_kv`` part once for the context, and nothing of size
    ``S x H`` except the fp32 scores. Scores and softmax are fp32; probabilities are cast to the latent dtype for the
    context product, as SDPA does. On CUDA, without autograd and outside ``torch.compile``, the context runs in the
    split-KV Triton kernel (``kimi_hybrid.kernels.mla_decode``, every SM on its own block of keys) where
    ``load_kernel`` finds it; :func:`latent_context` is its reference.
    """
    B, T, H, _ = q.shape
    S = latent.shape[1]
    r, n, dv = kv_lora_rank, nope, v_dim
    rope = q.shape[-1] - n
    w = kv_b_weight.view(H, n + dv, r)
    w_uk, w_uv = w[:, :n], w[:, n:]
    q_nope, q_pe = q.split([n, rope], dim=-1)
    q_lat = torch.bmm(q_nope.reshape(B * T, H, n).transpose(0, 1), w_uk.to(q.dtype))  # [H, B*T, r]
    q_lat = q_lat.transpose(0, 1).reshape(B, T, H, r)
    qf = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1).reshape(B, T * H, r + rope)
    if attn_mask is not None and type(attn_mask).__name__ == "CausalBias":  # chunked prefill (SDPA bias object)
        attn_mask = attn_mask._materialize(q.device).view(1, 1, T, S)
    if attn_mask is None and T > 1:
        q_abs = torch.arange(T, device=q.device) + (S - T)
        attn_mask = (torch.arange(S, device=q.device).view(1, S) <= q_abs.view(T, 1)).view(1, 1, T, S)
    kernel = load_kernel("mla_decode") if latent.is_cuda and not _compiling() and not torch.is_grad_enabled() else None
    if kernel is not None and kernel.latent_decode_supports(qf, latent, r, attn_mask, H):
        ctx = kernel.latent_decode_attention(qf, latent, attn_mask, num_heads=H, kv_lora_rank=r, scaling=scaling)
    else:
        ctx = latent_context(qf, latent, attn_mask, num_heads=H, kv_lora_rank=r, scaling=scaling)
    ctx = ctx.view(B * T, H, r).transpose(0, 1)
    out = torch.bmm(ctx, w_uv.transpose(1, 2).to(ctx.dtype))  # [H, B*T, v]
    return out.transpose(0, 1).reshape(B, T, H, dv)


# ----------------------------------------------------------------------------------------------------------------
# transformers' attention interface (config._attn_implementation other than "sdpa")
# ----------------------------------------------------------------------------------------------------------------

def mla_eager_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: Optional[torch.Tensor], scaling: float, dropout: float = 0.0,
                                **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention with transformers' attention-interface signature (the ``"eager"`` implementation of the
    MLA layers, and their ``output_attentions`` path).

    Args:
        module: the calling attention module (only ``module.training`` is read, for dropout).
        query: ``[B, H, T, d]``; key: ``[B, H, S, d]``; value: ``[B, H, S, dv]`` (``dv`` may differ from ``d``).
        attention_mask: None (no mask: every query sees every key), an additive float mask broadcastable to
            ``[B, H, T, S]`` (0 = attend, a large negative value = masked, as transformers' ``eager_mask``), or a bool
            mask (True = attend).
        scaling: the score scale. dropout: probability dropout, applied only when ``module.training``.
        **kwargs: transformers' extra keywords (ignored).

    Returns ``(out [B, T, H, dv], probs [B, H, T, S])``, both in the query dtype. Unlike transformers'
    ``eager_attention_forward`` the scores are computed in fp32 (inputs upcast) as well as the softmax, so fp32 and
    16-bit runs see the same reference math; no head repetition (MLA has as many key / value heads as query heads).
    """
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    probs = scores.softmax(-1).to(query.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout, training=getattr(module, "training", False))
    out = torch.matmul(probs, value.to(probs.dtype))
    return out.transpose(1, 2).contiguous(), probs


def interface_mask(attn_mask, B: int, T: int, S: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The mask handed to a transformers attention-interface function: additive float ``[B | 1, 1, T, S]`` in
    ``dtype``, 0 where a query attends and ``torch.finfo(dtype).min`` where it does not (the format of transformers'
    ``eager_mask``, which ``eager_attention_forward`` adds to its scores and ``sdpa_attention_forward`` passes to SDPA
    as is). Always materialised, never None: transformers' sdpa function reads a None mask as top-left causal and
    drops keys past T, which is wrong with a prefix.

    ``attn_mask``: the MLA's mask: None (bottom-right causal: query i sees keys ``j <= i + S - T``), a
    ``torch.nn.attention.bias.CausalBias`` or bool ``[B | 1, 1, T, S]`` (True = attend). Raises ValueError on
    anything else (a float mask, a wrong shape)."""
    if attn_mask is None:
        q_abs = torch.arange(T, device=device) + (S - T)
        attn_mask = (torch.arange(S, device=device).view(1, S) <= q_abs.view(T, 1)).view(1, 1, T, S)
    elif type(attn_mask).__name__ == "CausalBias":
        attn_mask = attn_mask._materialize(device).view(1, 1, T, S)
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        raise ValueError(f"attn_mask must be a bool tensor [B, 1, T, S], a CausalBias or None; got "
                         f"{getattr(attn_mask, 'dtype', type(attn_mask).__name__)}")
    if attn_mask.dim() != 4 or tuple(attn_mask.shape[-2:]) != (T, S) or attn_mask.shape[0] not in (1, B):
        raise ValueError(f"attn_mask must have shape [{B} | 1, 1, {T}, {S}]; got {tuple(attn_mask.shape)}")
    zero = torch.zeros((), device=device, dtype=dtype)
    return torch.where(attn_mask, zero, torch.finfo(dtype).min)


def attend_interface(attention_fn: Callable, module: torch.nn.Module, q: torch.Tensor, latent: torch.Tensor,
                     kv_b_proj: Callable[[torch.Tensor], torch.Tensor], attn_mask, *, num_heads: int,
                     kv_lora_rank: int, nope: int, v_dim: int, scaling: float, pad_v: bool = False,
                     dropout: float = 0.0, **kwargs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """MLA over decompressed keys through a transformers attention-interface function.

    Args:
        attention_fn: called as ``attention_fn(module, query [B, H, T, qk], key [B, H, S, qk], value [B, H, S, v'],
            attention_mask, scaling=scaling, dropout=dropout, **kwargs)`` and expected to return
            ``(out [B, T, H, v'], weights or None)`` (transformers' convention, e.g. ``eager_attention_forward``,
            ``sdpa_attention_forward`` or a function registered with ``transformers.AttentionInterface``).
        module: the calling attention module (passed through; transformers' functions read ``training``,
            ``is_causal``, ``num_key_value_groups``, ``layer_idx`` from it).
        q: ``[B, T, H, nope + rope]``; latent: ``[B, S, kv_lora_rank + rope]`` (prefix then the new tokens).
        kv_b_proj: the up-projection (called, so adapters apply).
        attn_mask: None (bottom-right causal), a ``CausalBias`` or bool ``[B | 1, 1, T, S]``; handed over as the
            additive float mask of :func:`interface_mask` in q's dtype.
        pad_v: pad values with zeros to the query / key head dim (for kernels that need equal head dims, e.g. flash
            attention) and slice the output back to ``v_dim``.

    Returns ``(out [B, T, H, v_dim], weights)`` with ``out`` in q's dtype and ``weights`` whatever the function
    returned (``[B, H, T, S]`` probabilities for the eager function, None for sdpa). Raises ValueError on a bad mask
    (:func:`interface_mask`) or when the function returns an output of another shape.
    """
    B, T, H, Dqk = q.shape
    S = latent.shape[1]
    k, v = decompress_kv(latent, kv_b_proj, num_heads, kv_lora_rank, nope, v_dim)
    qh, kh, vh = q.transpose(1, 2), k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2)
    if pad_v and v_dim < Dqk:
        vh = F.pad(vh, (0, Dqk - v_dim))
    mask = interface_mask(attn_mask, B, T, S, q.device, q.dtype)
    out, weights = attention_fn(module, qh, kh, vh, mask, scaling=scaling, dropout=dropout, **kwargs)
    if out.dim() != 4 or tuple(out.shape[:3]) != (B, T, H) or out.shape[-1] != vh.shape[-1]:
        raise ValueError(f"the attention function {getattr(attention_fn, '__name__', attention_fn)!r} returned an "
                         f"output of shape {tuple(out.shape)}; expected [{B}, {T}, {H}, {vh.shape[-1]}] "
                         "(transformers' convention: [batch, query length, heads, head dim])")
    return out[..., :v_dim].to(q.dtype), weights
