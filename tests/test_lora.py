"""PEFT LoRA on KimiHybrid: targets, CPU training, fast paths with adapters, save / load / merge.

All CPU, fp32, tiny random configs (``tiny-kda-first``: 3 KDA + 1 MLA with MoE; ``tiny-mla-first``; ``tiny-k3``).
Tolerances are stated per test. GPU variants at the end skip without CUDA.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kimi_hybrid.app.lora import (  # noqa: E402
    EXPERT_PARAMETERS,
    check_lora_targets,
    enable_gradient_checkpointing,
    lora_targets,
    merge_and_save,
    packing_collator,
    recommended_lora_config,
)
from kimi_hybrid import KimiHybridConfig, KimiHybridForCausalLM  # noqa: E402
from kimi_hybrid.modeling_kimi_hybrid import KimiMLAttention  # noqa: E402
from presets import TINY_PRESETS, preset_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is ~10x faster than oversubscribed threads on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(preset="tiny-kda-first", seed=0, **over):
    torch.manual_seed(seed)
    cfg = preset_config(preset, **over)
    return KimiHybridForCausalLM(cfg).eval()


def lora(model, seed=1, r=4, alpha=8, **kw):
    """The recommended config with random (non-zero) A and B, so the adapter changes every output."""
    cfg = recommended_lora_config(model.config, r=r, alpha=alpha, init_lora_weights=False, **kw)
    torch.manual_seed(seed)
    return get_peft_model(model, cfg)


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


# ------------------------------------------------------------------------------------------------------------------
# 1. the recommended config
# ------------------------------------------------------------------------------------------------------------------

def test_recommended_targets_kimi_linear_shape():
    cfg = KimiHybridConfig.from_preset("kimi-linear-48b-a3b")
    modules, params = lora_targets(cfg)
    assert modules == ["q_proj", "k_proj", "v_proj", "o_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                       "gate_proj", "up_proj", "down_proj"]
    assert params == list(EXPERT_PARAMETERS)
    lc = recommended_lora_config(cfg)
    assert (lc.r, lc.lora_alpha, lc.lora_dropout) == (16, 32, 0.0)
    assert set(lc.target_parameters) == set(EXPERT_PARAMETERS)
    for banned in ("q_conv1d", "k_conv1d", "v_conv1d", "gate", "lm_head", "embed_tokens", "f_a_proj", "b_proj"):
        assert banned not in lc.target_modules
    gates = lora_targets(cfg, include_gates=True)[0]
    assert {"f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj"} <= set(gates)
    assert lora_targets(cfg, include_experts=False)[1] == []
    with pytest.raises(ValueError, match="dropout"):
        recommended_lora_config(cfg, dropout=0.05)
    assert recommended_lora_config(cfg, include_experts=False, dropout=0.05).lora_dropout == 0.05


def test_recommended_targets_k3():
    cfg = KimiHybridConfig.from_preset("kimi-k3")
    modules, params = lora_targets(cfg, include_gates=True)
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "routed_expert_down_proj",
            "routed_expert_up_proj", "g_proj"} <= set(modules)
    assert "g_a_proj" not in modules and params == list(EXPERT_PARAMETERS)


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first", "tiny-k3"])
def test_wrapping_every_target_and_no_conv(preset):
    pm = lora(tiny(preset))
    adapted = check_lora_targets(pm)
    leaves = {n.rsplit(".", 1)[-1] for n in adapted}
    assert not any("conv1d" in n or n.endswith("lm_head") or n.endswith("mlp.gate") for n in adapted)
    assert {"kv_b_proj", "kv_a_proj_with_mqa", "o_proj", "experts"} <= leaves
    n_moe = pm.config.mlp_layer_types.count("sparse")
    # two nested ParamWrappers (gate_up_proj, down_proj) per MoE layer
    assert sum(1 for n, m in pm.named_modules() if type(m).__name__ == "ParamWrapper") == 2 * n_moe
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_conv_target_is_refused_or_bypassed():
    """Why the depthwise conv is never a target: PEFT refuses it unless r % groups == 0; with r == groups it wraps
    it, but the model reads the fused conv kernels directly, so the adapter would be silently ignored (outputs
    unchanged with non-zero A and B); check_lora_targets refuses such a model."""
    m = tiny()
    groups = m.model.layers[0].self_attn.q_conv1d.groups
    with pytest.raises(ValueError, match="groups"):
        get_peft_model(m, LoraConfig(r=4, target_modules=["q_conv1d"]))
    m = tiny()
    x = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        want = m(input_ids=x).logits
    with pytest.warns(UserWarning, match="groups > 1"):
        pm = get_peft_model(m, LoraConfig(r=groups, target_modules=["q_conv1d"], init_lora_weights=False))
    with torch.no_grad(), pytest.raises(ValueError, match="q_conv1d is wrapped by a PEFT adapter.*modules_to_save"):
        pm(input_ids=x)  # the forward refuses: the fused conv would skip the adapter
    with pytest.raises(ValueError, match="must not wrap"):
        check_lora_targets(pm)
    # the documented way to train the conv: modules_to_save (a trained full copy, read through the wrapper)
    pm = get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["q_conv1d"]))
    with torch.no_grad():
        for mod in pm.modules():
            if type(mod).__name__ == "ModulesToSaveWrapper":
                next(iter(mod.modules_to_save.values())).weight.mul_(2)
        assert not torch.equal(pm(input_ids=x).logits, want)


# ------------------------------------------------------------------------------------------------------------------
# 2. training on CPU
# ------------------------------------------------------------------------------------------------------------------

def test_label_masking():
    pm = lora(tiny())
    x = torch.randint(3, 128, (2, 14))
    labels = x.clone()
    labels[:, :6] = -100  # a "prompt" that is not trained on
    out = pm(input_ids=x, labels=labels)
    logits = out.logits[:, :-1].float()
    tgt = labels[:, 1:]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, ref, atol=1e-6)
    # a fully masked row contributes nothing: its loss gradient is exactly zero
    only_first = labels.clone()
    only_first[1] = -100
    pm.zero_grad()
    pm(input_ids=x, labels=only_first).loss.backward()
    g1 = lora_grads(pm)
    pm.zero_grad()
    pm(input_ids=x[:1], labels=only_first[:1]).loss.backward()
    g2 = lora_grads(pm)
    assert max((g1[k] - g2[k]).abs().max().item() for k in g1) < 1e-6


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_equals_separate(checkpointing):
    """DataCollatorWithFlattening rows (position_ids restarting at 0) == each document alone: summed token loss
    (rel 1e-5) and every LoRA gradient (max abs diff <= 1e-5 * max |g| + 1e-7)."""
    pm = lora(tiny("tiny-kda-first"))
    pm.train()
    if checkpointing:
        enable_gradient_checkpointing(pm)
    torch.manual_seed(3)
    docs = [torch.randint(3, 128, (n,)).tolist() for n in (5, 11, 3, 8)]
    n_tok = sum(len(d) - 1 for d in docs)

    pm.zero_grad()
    total = 0.0
    for d in docs:
        t = torch.tensor([d])
        loss = pm(input_ids=t, labels=t).loss * (len(d) - 1) / n_tok
        loss.backward()
        total += loss.item()
    g_sep = lora_grads(pm)

    batch = packing_collator()([{"input_ids": d} for d in docs])
    assert batch["input_ids"].shape == (1, sum(map(len, docs)))
    assert "attention_mask" not in batch
    pm.zero_grad()
    out = pm(**batch)
    out.loss.backward()
    g_pack = lora_grads(pm)
    assert abs(out.loss.item() - total) <= 1e-5 * abs(total)
    assert g_sep.keys() == g_pack.keys() and len(g_sep) > 0
    for k in g_sep:
        scale = g_sep[k].abs().max().item()
        assert (g_sep[k] - g_pack[k]).abs().max().item() <= 1e-5 * scale + 1e-7, k


def test_packing_has_no_leakage():
    """Changing document 1 changes nothing in document 2's logits when packed."""
    m = tiny("tiny-mla-first")
    d1, d2 = [5, 6, 7, 8, 9], [10, 11, 12, 13]
    b1 = packing_collator()([{"input_ids": d1}, {"input_ids": d2}])
    b2 = packing_collator()([{"input_ids": [20, 21, 22, 23, 24]}, {"input_ids": d2}])
    with torch.no_grad():
        l1 = m(input_ids=b1["input_ids"], position_ids=b1["position_ids"]).logits[0, 5:]
        l2 = m(input_ids=b2["input_ids"], position_ids=b2["position_ids"]).logits[0, 5:]
        alone = m(input_ids=torch.tensor([d2])).logits[0]
    assert torch.allclose(l1, l2, atol=1e-5) and torch.allclose(l1, alone, atol=1e-5)


def _fixed_dataset(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        L = 10 + (i % 3) * 4
        ids = torch.randint(3, 128, (L,), generator=g).tolist()
        labels = [-100] * 3 + ids[3:]  # prompt masking inside the packed rows
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _eval_loss(model, rows):
    model.eval()
    with torch.no_grad():
        b = packing_collator()(rows)
        return model(**b).loss.item()


def test_trainer_reduces_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    pm = get_peft_model(tiny(), recommended_lora_config(tiny().config, r=8, alpha=16))
    rows = _fixed_dataset()
    before = _eval_loss(pm, rows)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=8,
                             learning_rate=2e-2, lr_scheduler_type="constant", warmup_steps=0, logging_steps=4,
                             save_strategy="no", report_to=[], use_cpu=True, gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False}, dataloader_num_workers=0,
                             remove_unused_columns=False, seed=0)
    trainer = Trainer(model=pm, args=args, train_dataset=rows, data_collator=packing_collator())
    trainer.train()
    after = _eval_loss(pm, rows)
    assert after < before - 0.5, (before, after)
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def test_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "models" / "kimi-hybrid-stdlib"))
    model = tiny(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                 bos_token_id=tok.bos_token_id)
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int\n    y: int\n",
             "for i in range(10):\n    print(i)\n", "import os\nprint(os.getcwd())\n"] * 2
    ds = datasets.Dataset.from_dict({"text": texts})
    cfg = trl.SFTConfig(output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=8, learning_rate=2e-2,
                        lr_scheduler_type="constant", logging_steps=5, save_strategy="no", report_to=[],
                        use_cpu=True, packing=True, max_length=128, gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"use_reentrant": False}, dataloader_num_workers=0, seed=0)
    trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok,
                             peft_config=recommended_lora_config(model.config, r=8, alpha=16))
    assert isinstance(trainer.model, PeftModel)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses


# ------------------------------------------------------------------------------------------------------------------
# 3. fast paths with adapters
# ------------------------------------------------------------------------------------------------------------------

def _greedy_no_cache(model, x, n):
    seq = x
    with torch.no_grad():
        for _ in range(n):
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq


def _count_latent_calls(monkeypatch):
    calls = {"n": 0}
    orig = KimiMLAttention._attend_latent

    def spy(self, *a, **k):
        calls["n"] += 1
        return orig(self, *a, **k)

    monkeypatch.setattr(KimiMLAttention, "_attend_latent", spy)
    return calls


def _base_weight_decode(monkeypatch):
    """Simulate the bug the model guards against: latent decode reading the *base* kv_b_proj weight."""
    orig = KimiMLAttention.forward

    def buggy(self, x, cache=None, attn_mask=None):
        kv = self.kv_b_proj
        if cache is not None and cache.seen_tokens > 0 and not torch.is_grad_enabled() and isinstance(kv, LoraLayer):
            self.kv_b_proj = kv.get_base_layer()
            try:
                return orig(self, x, cache, attn_mask)
            finally:
                self.kv_b_proj = kv
        return orig(self, x, cache, attn_mask)

    monkeypatch.setattr(KimiMLAttention, "forward", buggy)


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-k3"])
def test_generation_adapter_equals_merged_equals_no_cache(preset, monkeypatch):
    """Greedy tokens: adapter (cache) == merge_and_unload (cache, absorbed MLA decode) == adapted model without
    cache. Logits of the merged model vs the adapter: max abs diff <= 1e-4 (fp32). The test can fail: decoding with
    the base kv_b_proj weight gives other tokens."""
    base = tiny(preset, initializer_range=0.1)
    pm = lora(base, seed=2, r=8, alpha=64)
    x = torch.tensor([[5, 17, 33, 42, 61, 7, 99, 12]])
    n_new = 8
    calls = _count_latent_calls(monkeypatch)
    with torch.no_grad():
        gen_adapter = pm.generate(input_ids=x, max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new)
    assert calls["n"] == 0, "absorbed MLA decode ran with a LoRA-wrapped kv_b_proj"
    ref = _greedy_no_cache(pm, x, n_new)
    assert torch.equal(gen_adapter, ref)

    merged = copy.deepcopy(pm).merge_and_unload()
    mla = pm.config.layer_types.index("full_attention")
    assert type(merged.model.layers[mla].self_attn.kv_b_proj) is torch.nn.Linear
    with torch.no_grad():
        gen_merged = merged.generate(input_ids=x, max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new)
        diff = (merged(input_ids=ref).logits - pm(input_ids=ref).logits).abs().max().item()
    assert calls["n"] > 0, "the merged model should decode MLA in latent space"
    assert torch.equal(gen_merged, gen_adapter)
    assert diff <= 1e-4

    _base_weight_decode(monkeypatch)
    with torch.no_grad():
        gen_buggy = pm.generate(input_ids=x, max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new)
    assert not torch.equal(gen_buggy, gen_adapter), "the case does not discriminate base vs adapted kv_b_proj"


def test_static_cache_generation_with_adapter():
    """cache_implementation="static" (pre-allocated cache) with an adapter and after merging == dynamic greedy."""
    base = tiny("tiny-kda-first", initializer_range=0.1)
    x = torch.tensor([[5, 17, 33, 42, 61, 7, 99, 12]])
    kw = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6)
    try:
        with torch.no_grad():
            base.generate(input_ids=x, cache_implementation="static", **kw)
    except (AttributeError, TypeError) as e:  # static generate of the base model itself is fixed on another branch
        pytest.skip(f"static-cache generate of the base model fails in this checkout: {e}")
    pm = lora(base, seed=2, r=8, alpha=64)
    with torch.no_grad():
        want = pm.generate(input_ids=x, **kw)
        got = pm.generate(input_ids=x, cache_implementation="static", **kw)
        merged = copy.deepcopy(pm).merge_and_unload()
        got_merged = merged.generate(input_ids=x, cache_implementation="static", **kw)
    assert torch.equal(got, want) and torch.equal(got_merged, want)


def test_mla_decode_step_uses_adapted_kv_b_proj():
    """One MLA layer, one decode step with a cache: output with a kv_b_proj adapter == decompressed attention with
    the merged weight (max abs diff <= 1e-5), and differs from the absorbed path on the base weight."""
    from kimi_hybrid import KimiHybridCache

    m = tiny("tiny-mla-first", initializer_range=0.1)
    pm = get_peft_model(m, LoraConfig(r=4, lora_alpha=16, target_modules=["kv_b_proj"], init_lora_weights=False))
    attn = pm.base_model.model.model.layers[0].self_attn
    lay = attn.kv_b_proj
    w_merged = lay.get_base_layer().weight + lay.get_delta_weight("default")
    x = torch.randn(1, 6, m.config.hidden_size)
    cache = KimiHybridCache(m.config)
    with torch.no_grad():
        attn(x[:, :5], cache)
        cache.advance(5)
        y = attn(x[:, 5:], cache)
        latent = cache.layers[0].latent
        q = attn.q_proj(x[:, 5:]).view(1, 1, attn.num_heads, attn.qk_dim)
        plain = torch.nn.Linear(attn.r, w_merged.shape[0], bias=False)
        plain.weight.data.copy_(w_merged)
        ref_attn = copy.copy(attn)
        ref_attn.kv_b_proj = plain
        ref = ref_attn.o_proj(ref_attn._attend_latent(q, latent, None).reshape(1, 1, -1))
        base_attn = copy.copy(attn)
        base_attn.kv_b_proj = lay.get_base_layer()
        wrong = base_attn.o_proj(base_attn._attend_latent(q, latent, None).reshape(1, 1, -1))
    assert (y - ref).abs().max().item() <= 1e-5
    assert (y - wrong).abs().max().item() > 1e-3


def test_expert_adapter_is_applied_and_merges():
    """The fused expert weights are read through the parameter, so the ParamWrapper delta applies: the MoE layer's
    output changes with the adapter, and equals the merged layer's output (max abs diff <= 1e-5)."""
    m = tiny("tiny-kda-first")
    cfg = LoraConfig(r=4, lora_alpha=8, target_parameters=list(EXPERT_PARAMETERS), init_lora_weights=False)
    pm = get_peft_model(copy.deepcopy(m), cfg)
    x = torch.randn(2, 7, m.config.hidden_size)
    with torch.no_grad():
        y0 = m.model.layers[1].mlp(x)
        y1 = pm.base_model.model.model.layers[1].mlp(x)
        merged = pm.merge_and_unload()
        y2 = merged.model.layers[1].mlp(x)
    assert (y1 - y0).abs().max().item() > 1e-4
    assert (y1 - y2).abs().max().item() <= 1e-5
    assert type(merged.model.layers[1].mlp.experts).__name__ == "KimiExperts"


# ------------------------------------------------------------------------------------------------------------------
# 4. save / load
# ------------------------------------------------------------------------------------------------------------------

def test_adapter_and_merged_round_trip(tmp_path):
    base = tiny("tiny-kda-first", initializer_range=0.1)
    base.save_pretrained(tmp_path / "base")
    pm = lora(base, seed=4)
    x = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        want = pm(input_ids=x).logits

    pm.save_pretrained(tmp_path / "adapter")
    files = set(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= files
    acfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert set(acfg["target_parameters"]) == set(EXPERT_PARAMETERS)
    assert "q_conv1d" not in acfg["target_modules"]

    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    with torch.no_grad():
        got = loaded(input_ids=x).logits
    assert torch.equal(got, want)

    merge_and_save(loaded, str(tmp_path / "merged"))
    mfiles = set(os.listdir(tmp_path / "merged"))
    assert {"config.json", "model.safetensors", "modeling_kimi_hybrid.py", "configuration_kimi_hybrid.py",
            "cache_kimi_hybrid.py"} <= mfiles
    mcfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "AutoModelForCausalLM" in mcfg["auto_map"]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        merged_logits = again(input_ids=x).logits
    assert (merged_logits - want).abs().max().item() <= 1e-4

    # the merged folder also loads as remote code, in a process that never imported the bundle
    torch.save(x, tmp_path / "x.pt")
    torch.save(merged_logits, tmp_path / "want.pt")
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'merged')!r}, trust_remote_code=True)\n"
        "assert 'transformers_modules' in type(m).__module__, type(m).__module__\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r}); w = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "with torch.no_grad(): d = (m(input_ids=x).logits - w).abs().max().item()\n"
        "assert d <= 1e-5, d\n"
    )
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), PYTHONPATH="")
    res = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


# ------------------------------------------------------------------------------------------------------------------
# GPU variants (skip without CUDA)
# ------------------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _one_triton_config(request):
    """GPU tests: one Triton config per FLA kernel (kernels/testing.py; correctness does not depend on it)."""
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        from kimi_hybrid.kernels.testing import limit_triton_autotuning

        limit_triton_autotuning()
    yield


@gpu
@pytest.mark.gpu
def test_gpu_bf16_training_and_merged_generation():
    """bf16 on CUDA (FLA kernels when installed): a few LoRA steps reduce the loss on a fixed batch; greedy tokens
    of the adapter and of the merged model agree on the first 4 tokens (bf16 merging rounds the weights)."""
    m = tiny("tiny-kda-first", initializer_range=0.1).to("cuda", torch.bfloat16)
    pm = get_peft_model(m, recommended_lora_config(m.config, r=8, alpha=16))
    enable_gradient_checkpointing(pm)
    pm.train()
    rows = _fixed_dataset()
    batch = {k: v.cuda() for k, v in packing_collator()(rows).items()}
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for _ in range(10):
        loss = pm(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    pm.eval()
    x = torch.tensor([[5, 17, 33, 42, 61, 7]], device="cuda")
    with torch.no_grad():
        a = pm.generate(input_ids=x, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        b = copy.deepcopy(pm).merge_and_unload().generate(input_ids=x, max_new_tokens=4, do_sample=False,
                                                           min_new_tokens=4)
    assert torch.equal(a, b)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
def test_gpu_lora_grads_match_cpu_reference(preset):
    """fp32, random non-zero adapters: the loss and every LoRA gradient on CUDA (FLA chunk_kda / conv backward, the
    grouped or batched expert path, SDPA) match the plain-PyTorch CPU backward. Tolerances: loss relative 1e-4,
    each gradient's relative L2 error 2e-2 (FLA's Triton dots may run in TF32)."""
    rows = _fixed_dataset(n=4)
    batch = packing_collator()(rows)
    out = {}
    for dev in ("cpu", "cuda"):
        # linear head dim 32: the FLA kernels' smallest realistic tile shape
        base = tiny(preset, initializer_range=0.1,
                    linear_attn_config={"head_dim": 32, "num_heads": 2, "short_conv_kernel_size": 4})
        pm = lora(base, r=4, alpha=8).to(dev)
        enable_gradient_checkpointing(pm)
        pm.train()
        loss = pm(**{k: v.to(dev) for k, v in batch.items()}).loss
        loss.backward()
        out[dev] = (loss.item(), {n: g.cpu() for n, g in lora_grads(pm).items()})
    (l_cpu, g_cpu), (l_gpu, g_gpu) = out["cpu"], out["cuda"]
    assert abs(l_gpu - l_cpu) <= 1e-4 * abs(l_cpu), (l_cpu, l_gpu)
    assert g_cpu.keys() == g_gpu.keys() and len(g_cpu) > 0
    for n in g_cpu:
        err = ((g_gpu[n] - g_cpu[n]).norm() / g_cpu[n].norm().clamp_min(1e-12)).item()
        assert err < 2e-2, (n, err)


# ------------------------------------------------------------------------------------------------------------------
# 6. the fine-tuning example, end to end on a tiny random model
# ------------------------------------------------------------------------------------------------------------------

def test_finetune_example_end_to_end(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "models" / "kimi-hybrid-stdlib"))
    model = tiny(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                 bos_token_id=tok.bos_token_id)
    model.save_pretrained(tmp_path / "base")
    import finetune_lora as ex  # examples/ is on the test path (pyproject: [tool.pytest.ini_options] pythonpath)
    rep = ex.main(["--model", str(tmp_path / "base"), "--package", "json", "--steps", "10", "--seq-len", "64",
                   "--batch-size", "4", "--lr", "5e-2", "--rank", "4", "--alpha", "8", "--max-train-tokens", "1024",
                   "--max-eval-tokens", "256", "--max-new-tokens", "6", "--prompt", "import json",
                   "--out", str(tmp_path / "run")])
    assert rep["eval_files"] and rep["train_files"] and not set(rep["eval_files"]) & set(rep["train_files"])
    assert rep["heldout_loss_after"] < rep["heldout_loss_before"]
    assert rep["adapter_generation_equals_merged"]
    files = set(os.listdir(tmp_path / "run" / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer_config.json"} <= files
    assert (tmp_path / "run" / "merged" / "modeling_kimi_hybrid.py").exists()
    assert json.loads((tmp_path / "run" / "report.json").read_text())["package"] == "json"


def test_bench_script_cpu_smoke(tmp_path):
    """examples/bench_lora.py on tiny widths: native kimi_linear and ours share weights (fp32 logits agree to 1e-4)
    and both train a step with the same LoraConfig; the summary holds the headline fields for both."""
    import bench_lora as b  # examples/ is on the test path (pyproject: [tool.pytest.ini_options] pythonpath)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_PRESETS["tiny-kda-first"]))
    res = b.main(["--config", str(tmp_path / "tiny.json"), "--layers", "4", "--device", "cpu", "--seq-len", "16",
                  "--steps", "1", "--warmup", "1", "--out", str(tmp_path / "b.json")])
    assert res["parity"]["max_abs_logit_diff"] <= 1e-4
    assert res["ours"]["trainable_params"] == res["native"]["trainable_params"] > 0
    assert abs(res["ours"]["first_loss"] - res["native"]["first_loss"]) <= 1e-4
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["ours"]["tokens_per_s"] > 0
    for field in ("lora_train_tok_s", "lora_first_step_s", "lora_step_s", "lora_train_peak_gib"):
        assert set(saved["summary"][field]) == {"ours", "native"}
    assert saved["summary"]["lora_train_tok_s"]["ours"] == saved["ours"]["tokens_per_s"]


def test_bench_script_released_plan_tiny():
    """--tiny at 27 layers runs the released plan (MLA at 3, 7, ..., 23, 26, dense layer 0) for both models."""
    import bench_lora as b

    res = b.main(["--tiny", "--device", "cpu", "--seq-len", "8", "--steps", "1", "--warmup", "1",
                  "--models", "ours,native"])
    assert res["setup"]["layer_plan"].startswith("released: 27 layers, MLA at [3, 7, 11, 15, 19, 23, 26], dense at "
                                                 "[0]")
    assert res["parity"]["max_abs_logit_diff"] <= 1e-4
    assert res["summary"]["lora_step_s"]["ours"] > 0 and res["summary"]["lora_step_s"]["native"] > 0


def test_merged_adapter_exports_to_released_layout(tmp_path):
    """The serving path of docs/serving.md: adapter -> merge_and_save (our layout) -> export to the released
    Kimi-Linear layout -> transformers' native kimi_linear loads it (no remote code) with the same logits
    (max abs diff <= 1e-4, fp32)."""
    conv = pytest.importorskip("conversion.convert")
    if not hasattr(conv, "convert_checkpoint"):
        pytest.skip("the checkpoint converter is not in this checkout")
    pm = lora(tiny("tiny-kda-first", initializer_range=0.1), seed=5)
    merged = merge_and_save(pm, str(tmp_path / "merged"))
    conv.convert_checkpoint(str(tmp_path / "merged"), str(tmp_path / "released"), src_format="ours",
                            dst_format="released")
    native = AutoModelForCausalLM.from_pretrained(tmp_path / "released")
    assert type(native).__name__ == "KimiLinearForCausalLM"
    x = torch.tensor([[5, 17, 33, 42, 61, 7, 9, 11]])
    with torch.no_grad():
        d = (merged(input_ids=x).logits - native(input_ids=x).logits).abs().max().item()
    assert d <= 1e-4


def test_attn_res_projection_would_be_bypassed():
    """K3 AttnRes reads its [1, D] projection weights directly: a LoRA on them changes nothing, so
    check_lora_targets refuses it (and the recommended config never targets it)."""
    m = tiny("tiny-k3")
    assert "self_attention_res_proj" not in recommended_lora_config(m.config, include_gates=True).target_modules
    x = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        want = m(input_ids=x).logits
    pm = get_peft_model(m, LoraConfig(r=2, target_modules=["self_attention_res_proj", "mlp_res_proj"],
                                      init_lora_weights=False))
    with torch.no_grad(), pytest.raises(ValueError, match="res_proj is wrapped by a PEFT adapter"):
        pm(input_ids=x)  # refused at the forward instead of silently skipping the adapter
    with pytest.raises(ValueError, match="must not wrap"):
        check_lora_targets(pm)
    # "all-linear" (PEFT / TRL's common default) would wrap them too: exclude_modules is the way out
    pm = get_peft_model(tiny("tiny-k3"), LoraConfig(r=2, target_modules="all-linear",
                                                    exclude_modules=["self_attention_res_proj", "mlp_res_proj",
                                                                     "output_attn_res_proj"]))
    with torch.no_grad():
        assert pm(input_ids=x).logits.shape == want.shape


def test_autotune_results_are_counted_and_cpu_models_get_no_notice(tmp_path, monkeypatch):
    """triton_autotune_results counts *.autotune.json below TRITON_CACHE_DIR; a CPU model never gets the
    cold-autotune notice (there is no Triton kernel to tune)."""
    from kimi_hybrid.app.lora import notice_cold_autotune, triton_autotune_results

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_autotune_results() == 0
    (tmp_path / "ab12").mkdir()
    (tmp_path / "ab12" / "chunk_kda_bwd.autotune.json").write_text("{}")
    (tmp_path / "ab12" / "chunk_kda_bwd.json").write_text("{}")
    assert triton_autotune_results() == 1
    assert triton_autotune_results(str(tmp_path / "missing")) == 0
    assert notice_cold_autotune(tiny()) is False
