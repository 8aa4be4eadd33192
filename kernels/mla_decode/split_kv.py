"""Latent MLA decode split over the key axis (flash-decoding), Triton: every SM reads its own block of cached
latents once, and the partial results are merged exactly by their log-sum-exp.

The query is already absorbed (``[q_nope W_UK | q_pe]``, the latent's own layout), so all heads and query tokens
of a sequence are the rows of one MQA problem against the shared latent ``[S, r + rope]`` (``r`` c_kv values, then
``rope`` k_pe values). Program ``(b, split, row block)`` of :func:`_latent_split_kernel` streams the keys of its
split in tiles of ``BN``: fp32 scores ``q . latent`` (tensor-core dots with fp32 accumulation), an online softmax,
and the context ``p @ c_kv`` in fp32; it writes its normalised partial context and its log-sum-exp.
:func:`_latent_merge_kernel` combines the splits: ``out = sum_j exp(lse_j - lse) o_j``, ``lse = logsumexp_j lse_j``.

Reference: :func:`kimi_hybrid.kernels.mla_decode.naive.naive_latent_decode` (the bundle's torch path of
``mla_kimi_hybrid.attend_latent``). Tests: kernels/tests/test_mla_decode.py (CUDA),
tests/test_triton_interpreter.py (interpreter).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["latent_decode_attention", "latent_decode_supports", "default_num_splits", "MIN_KERNEL_KEYS"]

MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost (q load, partial write) outweighs its keys
# H200, B1 1M, bf16 (bench mla_sweep at 8f32d88): one split per SM with 64-key tiles, 3 stages, 4 warps 338 us
# (3.57 TB/s, 0.85 of the copy bandwidth); 2 x SMs 375 us; 32-key tiles 404-621 us
SPLITS_PER_SM = 1
# Below this many keys per sequence the torch path is measured faster (H200 bf16: B1 S4096 15.5 us vs 32.9 us,
# B32 S4096 115 vs 138 us; B1 S131072 137 vs 128 us, 94 us with the current tiles): attend_latent keeps torch there.
# bench_kernels mla_decode times B1 at 16K / 32K to refine the crossover.
MIN_KERNEL_KEYS = 16384


@triton.jit
def _latent_split_kernel(q_ptr, lat_ptr, mask_ptr, o_ptr, lse_ptr, M, S, H, keys_per_split, scale,
                         s_qb, s_qm, s_lb, s_ls, s_mb, s_mt, s_ms, s_ob, s_om, s_os, s_eb, s_em,
                         R: tl.constexpr, P: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                         HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    """Program (sequence b, split j, block of BH query rows): rows ``m`` are (token ``m // H``, head ``m % H``).
    q ``[B, M, R + P]``, latent ``[B, S, R + P]`` (last dim contiguous), mask bool ``[B | 1, T, S]`` (True =
    attend); writes o ``[B, M, splits, R]`` fp32 (normalised within the split) and lse ``[B, M, splits]`` fp32
    (-inf for a split in which a row sees no key)."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BH + tl.arange(0, BH)
    rmask = rows < M
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, P)
    q_row = q_ptr + b * s_qb + rows[:, None] * s_qm
    q_c = tl.load(q_row + offs_r[None, :], mask=rmask[:, None], other=0.0)
    q_p = tl.load(q_row + R + offs_p[None, :], mask=rmask[:, None], other=0.0)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, S)
    tok = rows // H
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, R], dtype=tl.float32)
    lat_b = lat_ptr + b * s_lb
    for n0 in range(0, keys_per_split, BN):  # keys_per_split: a multiple of BN
        keys = start + n0 + tl.arange(0, BN)
        kmask = keys < end
        k_c = tl.load(lat_b + keys[:, None] * s_ls + offs_r[None, :], mask=kmask[:, None], other=0.0)
        k_p = tl.load(lat_b + keys[:, None] * s_ls + R + offs_p[None, :], mask=kmask[:, None], other=0.0)
        s = tl.dot(q_c, tl.trans(k_c), input_precision=DOT_PREC)
        s = tl.dot(q_p, tl.trans(k_p), acc=s, input_precision=DOT_PREC) * scale
        valid = rmask[:, None] & kmask[None, :]
        if HAS_MASK:
            seen = tl.load(mask_ptr + b * s_mb + tok[:, None] * s_mt + keys[None, :] * s_ms, mask=valid, other=0)
            valid = valid & (seen != 0)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf - 0) = 0
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision=DOT_PREC)
        m_i = m_new
    seen_any = l_i > 0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + b * s_ob + rows[:, None] * s_om + split * s_os + offs_r[None, :], o, mask=rmask[:, None])
    tl.store(lse_ptr + b * s_eb + rows * s_em + split, lse, mask=rmask)


@triton.jit
def _latent_merge_kernel(o_ptr, lse_ptr, out_ptr, M, n_splits, s_ob, s_om, s_os, s_eb, s_em, s_xb, s_xm,
                         R: tl.constexpr, BS: tl.constexpr):
    """Program (sequence b, row m): ``out[b, m] = sum_j exp(lse_j - max) o_j / sum_j exp(lse_j - max)`` over the
    splits, in fp32, stored in out's dtype. A row that sees no key at all gets NaN (0 / 0), as softmax does."""
    b = tl.program_id(0)
    m = tl.program_id(1)
    offs_r = tl.arange(0, R)
    offs_s = tl.arange(0, BS)
    lse_row = lse_ptr + b * s_eb + m * s_em
    top = tl.full([BS], float("-inf"), dtype=tl.float32)
    for j0 in range(0, n_splits, BS):
        top = tl.maximum(top, tl.load(lse_row + j0 + offs_s, mask=j0 + offs_s < n_splits, other=float("-inf")))
    mx = tl.max(top, axis=0)
    acc = tl.zeros([R], dtype=tl.float32)
    den = tl.zeros([BS], dtype=tl.float32)
    for j0 in range(0, n_splits, BS):
        js = j0 + offs_s
        w = tl.exp(tl.load(lse_row + js, mask=js < n_splits, other=float("-inf")) - mx)
        parts = tl.load(o_ptr + b * s_ob + m * s_om + js[:, None] * s_os + offs_r[None, :],
                        mask=(js < n_splits)[:, None], other=0.0)
        acc += tl.sum(w[:, None] * parts, axis=0)
        den += w
    out = acc / tl.sum(den, axis=0)
    tl.store(out_ptr + b * s_xb + m * s_xm + offs_r, out.to(out_ptr.dtype.element_ty))


def default_num_splits(S: int, device: torch.device) -> int:
    """Splits of the key axis: ``SPLITS_PER_SM`` per SM at long contexts (the pipelined 64-key tiles keep one
    program per SM busy), fewer below so each split keeps at least ``MIN_KEYS_PER_SPLIT`` keys. Depends on S and the
    device only, never on the batch, so a row gives the same bits alone or in a batch."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(SPLITS_PER_SM * sms, triton.cdiv(S, MIN_KEYS_PER_SPLIT)))


def latent_decode_supports(q: torch.Tensor, latent: torch.Tensor, kv_lora_rank: int,
                           attn_mask: Optional[torch.Tensor] = None, num_heads: int = 1, *,
                           min_keys: int = MIN_KERNEL_KEYS) -> bool:
    """Whether :func:`latent_decode_attention` serves these inputs and should be used: ``q [B, T*H, D]`` and
    ``latent [B, S, D]`` of one float dtype with ``kv_lora_rank`` and the rope width powers of two >= 16, the
    latent's last dim contiguous, ``attn_mask`` None or bool ``[B | 1, 1, T, S]``, and ``S >= min_keys`` (default
    :data:`MIN_KERNEL_KEYS`, below which the torch path is faster; ``min_keys=0`` asks about validity only)."""
    if latent.dim() == 3 and latent.shape[1] < min_keys:
        return False
    if q.dim() != 3 or latent.dim() != 3 or q.shape[0] != latent.shape[0] or q.shape[1] % num_heads:
        return False
    rope = latent.shape[-1] - kv_lora_rank
    pow2 = all(d >= 16 and d & (d - 1) == 0 for d in (kv_lora_rank, rope))
    if attn_mask is not None:
        B, T, S = q.shape[0], q.shape[1] // num_heads, latent.shape[1]
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or tuple(attn_mask.shape[1:]) != (1, T, S) \
                or attn_mask.shape[0] not in (1, B):
            return False
    return (pow2 and q.shape[-1] == latent.shape[-1] and q.dtype == latent.dtype
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and latent.stride(-1) == 1)


def latent_decode_attention(q: torch.Tensor, latent: torch.Tensor, attn_mask: Optional[torch.Tensor], *,
                            num_heads: int, kv_lora_rank: int, scaling: float, num_splits: Optional[int] = None,
                            block_h: int = 32, block_n: int = 64, num_warps: int = 4,
                            num_stages: int = 3) -> torch.Tensor:
    """Softmax attention of absorbed queries against the cached latents, split over the key axis.

    Args:
        q: ``[B, T * H, r + rope]`` absorbed queries (row ``t * H + h``), the latent's dtype.
        latent: ``[B, S, r + rope]`` (``[c_kv | k_pe]``; last dim contiguous, e.g. a static cache buffer's prefix).
        attn_mask: bool ``[B | 1, 1, T, S]`` (True = attend) or None (every query sees every key).
        num_heads: H. kv_lora_rank: r. scaling: the score scale.
        num_splits: key-axis splits (default :func:`default_num_splits`); block_h / block_n: rows / keys per tile.

    Returns:
        ``[B, T * H, r]`` in the latent's dtype: ``softmax(scaling * q . latent^T) @ c_kv`` with fp32 scores,
        softmax and accumulation. No host synchronisation (CUDA-graph safe).

    Raises:
        ValueError: shapes or dtypes it does not serve (see :func:`latent_decode_supports` with ``min_keys=0``), or a
        mask of another shape.
    """
    B, M, D = q.shape
    S = latent.shape[1]
    R = kv_lora_rank
    if not latent_decode_supports(q, latent, R, attn_mask, num_heads, min_keys=0):
        raise ValueError(f"latent_decode_attention: q {tuple(q.shape)} {q.dtype}, latent {tuple(latent.shape)} "
                         f"{latent.dtype}, kv_lora_rank {R}, {num_heads} heads, mask "
                         f"{None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype)}: needs q "
                         "[B, T*H, r + rope] and latent [B, S, r + rope] of one float dtype, r and rope powers of two "
                         ">= 16, and a bool mask [B | 1, 1, T, S] or None")
    mask = None if attn_mask is None else attn_mask[:, 0]
    if q.dtype == torch.float32:  # fp32 tiles are twice the bytes: smaller key tiles, no pipelining (fits on-chip)
        block_n, num_stages = min(block_n, 16), 1
    n_splits = num_splits or default_num_splits(S, q.device)
    keys_per_split = triton.cdiv(triton.cdiv(max(S, 1), n_splits), block_n) * block_n
    n_splits = max(1, triton.cdiv(S, keys_per_split))
    q = q.contiguous()
    parts = torch.empty(B, M, n_splits, R, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, M, n_splits, dtype=torch.float32, device=q.device)
    bh = max(16, min(block_h, triton.next_power_of_2(M)))
    m_strides = (0, 0, 0) if mask is None else ((mask.stride(0) if mask.shape[0] > 1 else 0),
                                                mask.stride(1), mask.stride(2))
    _latent_split_kernel[(B, n_splits, triton.cdiv(M, bh))](
        q, latent, mask if mask is not None else lse, parts, lse, M, S, num_heads, keys_per_split, float(scaling),
        q.stride(0), q.stride(1), latent.stride(0), latent.stride(1), *m_strides,
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        R=R, P=D - R, BH=bh, BN=block_n, HAS_MASK=mask is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else None, num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(B, M, R, dtype=latent.dtype, device=q.device)
    _latent_merge_kernel[(B, M)](parts, lse, out, M, n_splits, parts.stride(0), parts.stride(1), parts.stride(2),
                                 lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), R=R,
                                 BS=min(16, triton.next_power_of_2(n_splits)), num_warps=4)
    return out
