"""CPU prefill memory grows linearly with the prompt: the MLA one-shot path must not materialise fp32 ``[B, H, T, T]``
scores (torch's fused CPU SDPA kernel needs equal value and query/key head sizes; the values are padded).

Each length runs in a fresh interpreter; the metric is the growth of the peak resident set size
(``resource.getrusage(...).ru_maxrss``) over a forward at that length, after a short warm-up forward. The widths are the
default model's (6 heads, qk 64 + 32, v 64): a quadratic path adds 6 x T^2 x 4 B = 384 MiB at T = 4096."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, resource, sys, torch
from kimi_hybrid import KimiHybridConfig, KimiHybridForCausalLM
torch.manual_seed(0)
cfg = KimiHybridConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=32, qk_nope_head_dim=64,
                       qk_rope_head_dim=32, v_head_dim=64, layer_types=["full_attention"], mlp_layer_types=["dense"],
                       first_k_dense_replace=1, max_position_embeddings=1 << 17, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)
model = KimiHybridForCausalLM(cfg).eval()
T = int(sys.argv[1])
with torch.no_grad():
    model(torch.randint(3, 256, (1, 64)), use_cache=True, logits_to_keep=1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = model(torch.randint(3, 256, (1, T)), use_cache=True, logits_to_keep=1)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_kib": after - before, "finite": bool(out.logits.isfinite().all())}))
"""


def _growth_mib(T: int) -> float:
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(T)], capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["finite"]
    return got["growth_kib"] / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's unit")
def test_cpu_prefill_peak_memory_is_linear_in_the_prompt():
    small, large = _growth_mib(1024), _growth_mib(4096)
    # linear: 4x the tokens -> ~4x the growth (activations, latents, the KV of one MLA layer: a few MiB here); the
    # quadratic score matrix alone would add 384 MiB at 4096 tokens
    assert large < 4 * small + 48, (small, large)
    assert large < 160, (small, large)
