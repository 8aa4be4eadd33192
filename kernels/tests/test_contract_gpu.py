"""The transformers contract on CUDA (skipped without CUDA): a compiled static-cache decode step with MoE layers is
one graph and equals the eager step, and how far a row's output moves when the other rows of its batch change, for
FLA's kernels and for ours.

Tolerances: compiled vs eager decode logits, bf16 model: relative RMS error <= 1e-2 (the compiled graph may fuse
and reorder bf16 operations); batch composition: measured and printed (``-s``), asserted only to stay under 1e-2
relative (it is a measurement, the numbers go to the README).
"""

import warnings

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from kimi_hybrid import kda_kimi_hybrid as kk
from presets import preset_config

warnings.filterwarnings("ignore")

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def model_on_cuda(name="tiny-kda-first", dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return KimiHybridForCausalLM(preset_config(name)).eval().to("cuda", dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)])
def test_compiled_decode_step_with_moe_is_one_graph_on_cuda(dtype, tol):
    """A fullgraph-compiled decode step equals the eager one. fp32: the same kernels, only inductor's fusions of the
    elementwise math differ (bound 1e-3 relative). bf16: every fused op rounds differently; measured on the H200
    1.19e-2 relative at the first step (commit 3927761; the tiny CPU model's bf16 gap is 9.9e-3), hence 2e-2."""
    torch._dynamo.reset()
    model = model_on_cuda(dtype=dtype)
    ids = torch.randint(3, 128, (2, 10), device="cuda")
    caches = [KimiHybridCache(model.config, max_cache_len=16) for _ in range(2)]
    step = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        for c in caches:
            model(ids[:, :6], past_key_values=c, use_cache=True)
        for t in range(6, 10):
            want = model(ids[:, t:t + 1], past_key_values=caches[0], use_cache=True).logits
            got = step(input_ids=ids[:, t:t + 1], past_key_values=caches[1], use_cache=True).logits
            assert rel(got, want) <= tol, (t, rel(got, want))


@pytest.mark.parametrize("path", ["fla", "ours"])
def test_batch_composition_on_cuda(path, monkeypatch):
    """Max absolute change of one row's logits (fp32 model) over batches of 1-7 other rows, with FLA's chunked KDA
    kernel or with the torch reference on the GPU (``path``)."""
    if path == "fla" and not kk.fla_available():
        pytest.skip("flash-linear-attention not installed")
    if path == "ours":
        monkeypatch.setattr(kk, "_use_fla", lambda t: False)
    model = model_on_cuda(dtype=torch.float32)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randint(3, 128, (1, 64), device="cuda", generator=g)
    others = torch.randint(3, 128, (7, 64), device="cuda", generator=g)
    with torch.no_grad():
        alone = model(x).logits[0]
        worst = max((model(torch.cat([others[:n], x])).logits[n] - alone).abs().max().item() for n in range(1, 8))
    print(f"\nbatch composition on CUDA ({path}): max |delta logits| = {worst:.3e} "
          f"(logit scale {alone.abs().max().item():.3f})")
    assert worst <= 1e-2 * alone.abs().max().item()
