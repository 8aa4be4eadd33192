"""Agent sessions on ``KimiHybridCache``: snapshot / restore / fork, save / load (safetensors, versioned, checksummed),
resuming generation after a reload in a new process, prefix reuse, and clear errors on bad input.

Tiny random fp32 models on CPU: both layer orders ("tiny-kda-first", "tiny-mla-first") and "tiny-k3". Logits
compared with max abs diff <= 1e-5 against recomputation without a cache; generated ids must be identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM

from decoding_helpers import PAD, _one_thread, gen, logits_nocache, rand_ids  # noqa: F401
from kimi_hybrid.cache_kimi_hybrid import CACHE_FORMAT_VERSION, layer_tensors
from presets import preset_config

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-5
ORDERS = ["tiny-kda-first", "tiny-mla-first"]
ALL = ORDERS + ["tiny-k3"]
_MODELS = {}


def get_model(preset: str, seed: int = 0) -> KimiHybridForCausalLM:
    if (preset, seed) not in _MODELS:
        torch.manual_seed(seed)
        _MODELS[(preset, seed)] = KimiHybridForCausalLM(preset_config(preset)).eval()
    return _MODELS[(preset, seed)]


def _tensors(cache):
    extra = [cache.last_hidden] if cache.last_hidden is not None else []
    return [t for layer in cache.layers for t in layer_tensors(layer).values()] + [cache.key_mask] + extra


# ---------------------------------------------------------------------------------------------------------------
# snapshot / restore / fork
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ALL)
def test_snapshot_restore_fork(preset):
    m = get_model(preset)
    ids = rand_ids(2, 12, seed=30)
    c = KimiHybridCache(m.config)
    with torch.no_grad():
        m(ids[:, :8], past_key_values=c)
        snap = c.snapshot()
        assert snap.get_seq_length() == 8
        assert not {t.data_ptr() for t in _tensors(c)} & {t.data_ptr() for t in _tensors(snap)}, "shared storage"
        a = m(ids[:, 8:10], past_key_values=c).logits  # moves c on; the snapshot must not move
        assert snap.get_seq_length() == 8 and c.get_seq_length() == 10
        c.restore(snap)
        assert c.get_seq_length() == 8
        b = m(ids[:, 8:10], past_key_values=c).logits
        assert (a - b).abs().max() == 0
        # branches from one snapshot are independent and each equals its recomputation
        other = rand_ids(2, 3, seed=31)
        f1, f2 = snap.fork(), snap.fork()
        l1 = m(ids[:, 8:11], past_key_values=f1).logits
        l2 = m(other, past_key_values=f2).logits
        assert (l1 - logits_nocache(m, ids[:, :11])[:, 8:]).abs().max() <= ATOL
        assert (l2 - logits_nocache(m, torch.cat([ids[:, :8], other], 1))[:, 8:]).abs().max() <= ATOL
        assert snap.get_seq_length() == 8
        # fork with batch_repeats: row order b0, b0, b1, b1
        f3 = snap.fork(batch_repeats=2)
        nxt = rand_ids(4, 1, seed=32)
        l3 = m(nxt, past_key_values=f3).logits
        ref = logits_nocache(m, torch.cat([ids[:, :8].repeat_interleave(2, 0), nxt], 1))[:, -1:]
        assert (l3 - ref).abs().max() <= ATOL


@pytest.mark.parametrize("preset", ALL)
def test_static_snapshot_restore_and_memory_report(preset):
    m = get_model(preset)
    ids = rand_ids(1, 9, seed=33)
    c = KimiHybridCache(m.config, max_cache_len=16)
    with torch.no_grad():
        m(ids[:, :6], past_key_values=c)
        snap = c.snapshot()
        a = m(ids[:, 6:9], past_key_values=c).logits
        buf = c.layers[-1].latent.data_ptr()
        c.restore(snap)
        assert c.layers[-1].latent.data_ptr() == buf, "static restore must copy in place (fixed addresses)"
        b = m(ids[:, 6:9], past_key_values=c).logits
        assert (a - b).abs().max() == 0
        # a rollback record dies with the history it described, even when the restored one has the same length
        other = snap.fork()
        m(ids[:, 1:4], past_key_values=other)  # another history, also 9 tokens
        c.restore(snap)
        c.activate_past_recording()
        m(ids[:, 6:9], past_key_values=c)  # recorded 6..9
        c.restore(other)
        with pytest.raises(ValueError, match="no tokens are recorded"):
            c.crop(-1)
        c.deactivate_past_recording()
        c.restore(snap)
        b = m(ids[:, 6:9], past_key_values=c).logits
    assert (a - b).abs().max() == 0
    # byte-exact memory report (dynamic): KDA constant, MLA linear in the length
    d = KimiHybridCache(m.config)
    with torch.no_grad():
        m(ids, past_key_values=d)
    r = d.memory_report()
    assert r["kda_bytes"] == r["kda_bytes_constant"]
    assert r["mla_bytes"] == r["mla_bytes_per_token"] * 9
    assert r["total_bytes"] == sum(t.numel() * t.element_size() for t in _tensors(d))


# ---------------------------------------------------------------------------------------------------------------
# save / load, and resuming in a new process
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ALL)
def test_save_load_roundtrip_and_refusals(preset, tmp_path):
    m = get_model(preset)
    ids = rand_ids(2, 10, seed=34)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # left padding: the key mask travels with the file
    c = KimiHybridCache(m.config)
    with torch.no_grad():
        m(ids[:, :7], attention_mask=mask, past_key_values=c)
    path = tmp_path / "session.safetensors"
    c.save(str(path))
    loaded = KimiHybridCache.load(str(path), m.config)
    assert loaded.get_seq_length() == 7
    for x, y in zip(_tensors(c), _tensors(loaded)):
        assert x.dtype == y.dtype and torch.equal(x, y)
    mask2 = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
    with torch.no_grad():
        lo = m(ids[:, 7:], attention_mask=mask2, past_key_values=loaded).logits
    ref = logits_nocache(m, ids, mask2)[:, 7:]
    assert (lo - ref).abs().max() <= ATOL

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["format"] == "kimi-hybrid-cache" and meta["version"] == str(CACHE_FORMAT_VERSION)
    # a model whose config does not match: refused, naming the difference
    other = "tiny-mla-first" if preset == "tiny-kda-first" else "tiny-kda-first"
    with pytest.raises(ValueError, match="config does not match.*layer_types"):
        KimiHybridCache.load(str(path), preset_config(other))
    with pytest.raises(ValueError, match="config does not match.*kv_lora_rank"):
        KimiHybridCache.load(str(path), preset_config(preset, kv_lora_rank=16))
    # corrupt payload: checksum
    bad = dict(tensors)
    key = next(k for k in bad if k.endswith("recurrent_state"))
    bad[key] = bad[key].clone()
    bad[key].view(-1)[0] += 1
    save_file(bad, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(ValueError, match="checksum"):
        KimiHybridCache.load(str(tmp_path / "bad.safetensors"), m.config)
    # unknown version / not a cache file
    save_file(tensors, str(tmp_path / "v99.safetensors"), metadata={**meta, "version": "99"})
    with pytest.raises(ValueError, match="version 99"):
        KimiHybridCache.load(str(tmp_path / "v99.safetensors"), m.config)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a kimi-hybrid cache"):
        KimiHybridCache.load(str(tmp_path / "other.safetensors"), m.config)
    # a version-1 file (W-1 wide conv windows, before the cache took transformers' W-wide layout) still loads and
    # continues exactly: the column it lacks is never read by the next token's convolution
    from kimi_hybrid.cache_kimi_hybrid import _checksum

    v1 = {k: (t[..., 1:].contiguous() if k.endswith("conv_state") else t) for k, t in tensors.items()}
    save_file(v1, str(tmp_path / "v1.safetensors"), metadata={**meta, "version": "1", "sha256": _checksum(v1)})
    old = KimiHybridCache.load(str(tmp_path / "v1.safetensors"), m.config)
    assert old.get_conv_state(next(i for i, t in enumerate(m.config.layer_types)
                                   if t == "linear_attention")).shape[-1] == m.config.linear_conv_kernel_size
    with torch.no_grad():
        lo1 = m(ids[:, 7:], attention_mask=mask2, past_key_values=old).logits
    assert torch.equal(lo1, lo)


_CHILD = r"""
import json, sys
import torch
from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
results = {}
for job in json.loads(sys.argv[1]):
    model = KimiHybridForCausalLM.from_pretrained(job["model"]).eval()
    cache = KimiHybridCache.load(job["cache"], model.config)
    seq = torch.tensor(job["sequences"])
    with torch.no_grad():
        out = model.generate(seq, past_key_values=cache, max_new_tokens=job["new"], do_sample=False, pad_token_id=0)
    results[job["name"]] = out.tolist()
print("RESULT " + json.dumps(results))
"""


def test_resume_after_reload_in_a_new_process(tmp_path):
    """Generate 4 tokens, save model + cache, resume for 6 more in a fresh Python process == 10 in one go."""
    jobs, expected = [], {}
    for preset in ALL:
        m = get_model(preset)
        ids = rand_ids(1, 7, seed=35)
        expected[preset] = gen(m, ids, max_new_tokens=10).tolist()
        first = gen(m, ids, max_new_tokens=4, return_dict_in_generate=True)
        mdir, cpath = tmp_path / preset, tmp_path / f"{preset}.safetensors"
        m.save_pretrained(str(mdir))
        first.past_key_values.save(str(cpath))
        jobs.append({"name": preset, "model": str(mdir), "cache": str(cpath), "new": 6,
                     "sequences": first.sequences.tolist()})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(jobs)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    got = json.loads(line[len("RESULT "):])
    for preset in ALL:
        assert len(got[preset][0]) == len(expected[preset][0])
        assert got[preset] == expected[preset], preset


# ---------------------------------------------------------------------------------------------------------------
# prefix reuse
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ALL)
def test_prefix_reuse_equals_full_prompts(preset):
    m = get_model(preset)
    prefix = rand_ids(1, 20, seed=36)
    suffixes = [rand_ids(3, seed=37), rand_ids(5, seed=38), rand_ids(1, seed=39)]
    prefix_cache = m.prefill_prefix(prefix)
    assert prefix_cache.get_seq_length() == 20
    before = [t.clone() for t in _tensors(prefix_cache)]
    seen = []
    hook = m.model.register_forward_pre_hook(lambda mod, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        out = m.generate_from_prefix(prefix_cache, prefix, suffixes, max_new_tokens=5, do_sample=False)
    finally:
        hook.remove()
    S = max(len(s) for s in suffixes)
    assert seen[0] == (3, S), f"the prefix was recomputed: first forward saw {seen[0]}"
    for i, s in enumerate(suffixes):
        alone = gen(m, torch.cat([prefix[0], s]).unsqueeze(0), max_new_tokens=5)[0, 20 + len(s):]
        assert torch.equal(out[i, 20 + S:20 + S + len(alone)], alone), i
    # the prefix snapshot is untouched and reusable; a fork per prompt works the same way
    assert all(torch.equal(a, b) for a, b in zip(before, _tensors(prefix_cache)))
    full = torch.cat([prefix[0], suffixes[1]]).unsqueeze(0)
    one = gen(m, full, past_key_values=prefix_cache.fork(), max_new_tokens=5)
    assert torch.equal(one, gen(m, full, max_new_tokens=5))


# ---------------------------------------------------------------------------------------------------------------
# clear errors
# ---------------------------------------------------------------------------------------------------------------

def test_clear_errors():
    kda, mla = get_model("tiny-kda-first"), get_model("tiny-mla-first")
    ids = rand_ids(2, 5, seed=40)
    c = KimiHybridCache(kda.config)
    with torch.no_grad():
        kda(ids, past_key_values=c)
        # a cache of another model
        with pytest.raises(ValueError, match="cache of another model.*layer_types"):
            mla(ids[:, :1], past_key_values=c)
        with pytest.raises(ValueError, match="cache of another model"):
            gen(mla, ids, past_key_values=KimiHybridCache(kda.config), max_new_tokens=2)
        # batch-size mismatch (dynamic and static)
        with pytest.raises(ValueError, match="holds batch 2 but the input has batch 3"):
            kda(rand_ids(3, 1), past_key_values=c)
        s = KimiHybridCache(kda.config, max_cache_len=8)
        kda(ids, past_key_values=s)
        with pytest.raises(ValueError, match="holds batch 2 but the input has batch 1"):
            kda(ids[:1, :1], past_key_values=s)
        # crop beyond the length
        with pytest.raises(ValueError, match="cannot crop 6 tokens from a cache holding 5"):
            c.crop(-6)
        with pytest.raises(ValueError, match="holds only 5"):
            c.crop(9)
        # restoring a snapshot of another batch size / another model
        snap1 = c.fork()
        snap1.batch_select_indices(torch.tensor([0]))
        with pytest.raises(ValueError, match="snapshot holds batch 1 but this cache holds batch 2"):
            c.restore(snap1)
        other = KimiHybridCache(mla.config)
        mla(ids, past_key_values=other)
        with pytest.raises(ValueError, match="another layer plan"):
            c.restore(other.snapshot())
        with pytest.raises(TypeError, match="KimiHybridCache snapshot"):
            c.restore({"not": "a cache"})
        # a static cache that would overflow, and batch reshaping of a static cache
        with pytest.raises(ValueError, match="max_cache_len=8"):
            kda(rand_ids(2, 4), past_key_values=s)
        with pytest.raises(NotImplementedError, match="fork"):
            s.batch_repeat_interleave(2)
        with pytest.raises(ValueError, match="batch_repeats"):
            c.fork(batch_repeats=0)
        # prefix helper misuse
        pc = kda.prefill_prefix(ids[:1])
        with pytest.raises(ValueError, match="expected the cache of prefix_ids"):
            kda.generate_from_prefix(pc, ids[:1, :3], [ids[0, :2]])
