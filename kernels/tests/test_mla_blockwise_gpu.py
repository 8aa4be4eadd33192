"""Blockwise MLA over a cached prefix on CUDA (``mla_kimi_hybrid.attend_decompressed``): the fused per-block kernel
(chosen by ``fused_backend``) merged by log-sum-exp, against a dense fp64 reference on the same device; its memory
does not grow with the prefix; a tiny model's chunked prefill with small key blocks equals its one-shot forward.
Skipped without CUDA. Metrics: ||a - b|| / ||ref|| (bf16 2e-2, fp32 2e-3) and max |a - b| / max |ref| for logits."""

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from kimi_hybrid import mla_kimi_hybrid as mla
from presets import preset_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

H, R, NOPE, ROPE, DV = 8, 512, 128, 64, 128  # the 48B-A3B widths (32 heads there)
SCALE = (NOPE + ROPE) ** -0.5


def _proj(dtype, heads=H):
    torch.manual_seed(1)
    p = torch.nn.Linear(R, heads * (NOPE + DV), bias=False, device="cuda")
    p.weight.data.mul_(4.0)  # scores of a few units: a softmax that is not flat
    return p.to(dtype).requires_grad_(False)


def _reference(q, latent, proj, T, S):
    w = proj.weight.double()
    k, v = mla.decompress_kv(latent.double(), lambda c: c @ w.t(), q.shape[2], R, NOPE, DV)
    s = torch.einsum("bthd,bshd->bhts", q.double(), k) * SCALE
    mask = torch.arange(S, device=q.device).view(1, S) <= torch.arange(T, device=q.device).view(T, 1) + (S - T)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v.double())


def test_fused_backend_found_for_bf16():
    be = mla.fused_backend(torch.device("cuda"), torch.bfloat16, NOPE + ROPE, DV)
    print("fused backend bf16:", be, mla._CHECK_LOG)
    assert be is not None and be[0] in ("cudnn", "flash", "efficient")


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 2e-3)])
@pytest.mark.parametrize("T,S,key_block", [(300, 1811, 512), (777, 777 + 1000, 256), (1, 900, 128)])
def test_blockwise_equals_dense_reference(dtype, tol, T, S, key_block):
    torch.manual_seed(T + S)
    q = torch.randn(2, T, H, NOPE + ROPE, device="cuda")
    latent = torch.randn(2, S, R + ROPE, device="cuda")
    proj = _proj(dtype)
    with torch.no_grad():
        got = mla.attend_decompressed(q.to(dtype), latent.to(dtype), proj, causal_lower_right(T, S), num_heads=H,
                                      kv_lora_rank=R, nope=NOPE, v_dim=DV, scaling=SCALE, key_block=key_block)
    ref = _reference(q.to(dtype), latent.to(dtype), proj, T, S)
    err = ((got.double() - ref).norm() / ref.norm()).item()
    print(dtype, T, S, key_block, "rel err", err, "backend", mla._CHOSEN)
    assert got.dtype == dtype and torch.isfinite(got).all() and err < tol


def test_prefix_memory_does_not_grow(monkeypatch):
    """32 heads, bf16, a 2K piece over a 60K and over a 190K prefix with 256 MiB key blocks: the extra memory (over
    the inputs) is the same at both lengths within 64 MiB, and under 3 GiB, where decompressing (and padding v for)
    the whole 190K prefix took 7.8 GB."""
    monkeypatch.setattr(mla, "KV_BLOCK_BYTES", 256 * 2**20)
    T, heads = 2048, 32
    proj = _proj(torch.bfloat16, heads)
    extra = {}
    for P in (60_000, 190_000):
        S = P + T
        q = torch.randn(1, T, heads, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
        latent = torch.randn(1, S, R + ROPE, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():  # once to build plans / workspaces, then measured
            mla.attend_decompressed(q, latent, proj, causal_lower_right(T, S), num_heads=heads, kv_lora_rank=R,
                                    nope=NOPE, v_dim=DV, scaling=SCALE)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = mla.attend_decompressed(q, latent, proj, causal_lower_right(T, S), num_heads=heads,
                                          kv_lora_rank=R, nope=NOPE, v_dim=DV, scaling=SCALE)
            end.record()
        torch.cuda.synchronize()
        extra[P] = torch.cuda.max_memory_allocated() - base
        flop = 2 * T * (P + T / 2) * heads * (NOPE + ROPE + DV)
        ms = start.elapsed_time(end)
        print(f"prefix {P}: peak extra {extra[P] / 2**20:.0f} MiB, {ms:.1f} ms, {flop / ms / 1e9:.0f} TFLOP/s useful,"
              f" backend {mla._CHOSEN}")
        assert torch.isfinite(out).all()
        del q, latent, out
    assert abs(extra[190_000] - extra[60_000]) < 64 * 2**20
    assert extra[190_000] < 3 * 2**30


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
def test_tiny_model_chunked_prefill_small_blocks_cuda(preset, monkeypatch):
    cfg = preset_config(preset)
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 57), device="cuda")
    with torch.no_grad():
        full = m(ids, use_cache=False).logits
        monkeypatch.setattr(mla, "KV_BLOCK_BYTES", 1)  # 16-token key blocks
        cache = KimiHybridCache(cfg)
        got = torch.cat([m(ids[:, s:s + 19], past_key_values=cache, use_cache=True).logits
                         for s in range(0, 57, 19)], 1)
    err = ((got - full).abs().max() / full.abs().max()).item()
    print(preset, "chunked vs one-shot", err)
    assert err < 2e-3
