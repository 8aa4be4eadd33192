"""Big-model placement: ``device_map`` splits at decoder layers, CPU / disk offload gives the same tokens,
and (on a machine with 2+ GPUs) a layer split over GPUs keeps every cache tensor on its layer's device.

CPU checks: accelerate's ``infer_auto_device_map`` on the full 48B-A3B shape (meta weights, bf16) with two
fictitious 60 GiB GPUs; real offload of tiny models to "cpu" + "disk" (weights loaded on the fly by accelerate
hooks). The multi-GPU test skips below 2 CUDA devices.
"""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate import infer_auto_device_map, init_empty_weights  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kimi_hybrid import KimiHybridCache, KimiHybridConfig, KimiHybridForCausalLM  # noqa: E402
from kimi_hybrid.cache_kimi_hybrid import layer_tensors  # noqa: E402
from presets import preset_config


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_no_split_modules_is_the_decoder_layer():
    assert KimiHybridForCausalLM._no_split_modules == ["KimiDecoderLayer"]
    assert "past_key_values" in KimiHybridForCausalLM._skip_keys_device_placement


def test_infer_auto_device_map_48b_splits_at_layers():
    """91.5 GiB of bf16 weights over two 60 GiB devices: both are used, and no decoder layer is cut."""
    cfg = KimiHybridConfig.from_preset("kimi-linear-48b-a3b")
    with init_empty_weights():
        model = KimiHybridForCausalLM(cfg).to(torch.bfloat16)
    dm = infer_auto_device_map(model, max_memory={0: "60GiB", 1: "60GiB", "cpu": "1GiB"},
                               no_split_module_classes=model._no_split_modules, dtype=torch.bfloat16)
    assert set(dm.values()) == {0, 1}
    for name in dm:
        parts = name.split(".")
        # a key is a whole top-level module or a whole decoder layer, never a piece of one
        assert name in ("model", "lm_head", "model.embed_tokens", "model.norm") or (
            parts[:2] == ["model", "layers"] and len(parts) == 3), name
    order = [dm[f"model.layers.{i}"] for i in range(cfg.num_hidden_layers)]
    assert order == sorted(order), "layers are placed in order, GPU 0 first"


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
def test_cpu_disk_offload_generates_the_same(preset, tmp_path):
    """Layers offloaded to disk and CPU (accelerate hooks load weights per forward): greedy tokens and logits equal
    the plain model's. Exercises the weights the model reads directly (KDA conv kernels, absorbed-MLA kv_b_proj,
    fused experts) under offload."""
    torch.manual_seed(0)
    ref = KimiHybridForCausalLM(preset_config(preset, initializer_range=0.1)).eval()
    ref.save_pretrained(tmp_path / "m")
    n = ref.config.num_hidden_layers
    dmap = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dmap.update({f"model.layers.{i}": ("disk" if i % 2 else "cpu") for i in range(n)})
    off = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=dmap, offload_folder=str(tmp_path / "off"))
    assert off.hf_device_map == dmap
    x = torch.tensor([[5, 17, 33, 42, 61, 7]])
    with torch.no_grad():
        a = ref.generate(input_ids=x, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        b = off.generate(input_ids=x, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        d = (ref(input_ids=a).logits - off(input_ids=a).logits).abs().max().item()
    assert torch.equal(a, b)
    assert d <= 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.gpu
def test_two_gpu_split_cache_on_layer_devices(tmp_path):
    """Layers split over cuda:0 / cuda:1: greedy tokens equal the single-GPU model's, and every KDA state and MLA
    latent lives on its layer's device."""
    torch.manual_seed(0)
    ref = KimiHybridForCausalLM(preset_config("tiny-mla-first", initializer_range=0.1)).eval()
    ref.save_pretrained(tmp_path / "m")
    n = ref.config.num_hidden_layers
    dmap = {"model.embed_tokens": 0, "model.norm": 1, "lm_head": 1}
    dmap.update({f"model.layers.{i}": (0 if i < n // 2 else 1) for i in range(n)})
    split = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=dmap)
    one = ref.to("cuda:0")
    x = torch.tensor([[5, 17, 33, 42, 61, 7]], device="cuda:0")
    with torch.no_grad():
        a = one.generate(input_ids=x, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        cache = KimiHybridCache(split.config)
        b = split.generate(input_ids=x, max_new_tokens=8, do_sample=False, min_new_tokens=8, past_key_values=cache)
    assert torch.equal(a.cpu(), b.cpu())
    for i, layer in enumerate(cache.layers):
        want = torch.device(f"cuda:{dmap[f'model.layers.{i}']}")
        for t in layer_tensors(layer).values():
            assert t.device == want, (i, t.device)
