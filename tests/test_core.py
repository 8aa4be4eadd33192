"""Core: config, model, cache, generation, save/load and parity with transformers' native kimi_linear (CPU, fp32).

Tolerances: logits compared as max absolute difference <= 1e-5 (fp32) unless stated.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from conversion_fixtures import released_config_dict
from kimi_hybrid import KimiHybridCache, KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid.cache_kimi_hybrid import layer_tensors
from presets import preset_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ["tiny-kda-first", "tiny-mla-first", "tiny-k3"]
TOL = 1e-5


def tiny(name, seed=0, **over):
    torch.manual_seed(seed)
    cfg = preset_config(name, **over)
    model = KimiHybridForCausalLM(cfg).eval()
    with torch.no_grad():  # a non-zero correction bias exercises "bias only chooses"
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.2)
    return model


# ------------------------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------------------------

RELEASED_48B = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                 "AutoModel": "modeling_kimi.KimiLinearModel",
                 "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
    "bos_token_id": 163584, "dtype": "bfloat16", "eos_token_id": 163586, "first_k_dense_replace": 1,
    "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear",
    "moe_intermediate_size": 1024, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1,
    "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 163839, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "transformers_version": "4.57.0", "use_cache": True, "use_grouped_topk": True, "v_head_dim": 128,
    "vocab_size": 163840,
}


def test_released_config_json_is_read_as_released(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_48B))
    cfg = KimiHybridConfig.from_pretrained(tmp_path)
    assert cfg.model_type == "kimi_hybrid"
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert cfg.layer_types.count("linear_attention") == 20
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 26
    assert cfg.max_position_embeddings == 1048576
    assert cfg.linear_num_heads == 32 and cfg.linear_head_dim == 128 and cfg.linear_conv_kernel_size == 4
    preset = KimiHybridConfig.from_preset("kimi-linear-48b-a3b")
    for k in RELEASED_48B:
        if k in ("architectures", "auto_map", "model_type", "dtype", "transformers_version", "model_max_length",
                 "rope_theta", "rope_scaling"):
            continue
        assert getattr(preset, k) == getattr(cfg, k), k
    assert cfg.released_rope_theta == 10000.0 and cfg.released_rope_scaling is None
    assert str(cfg.dtype).endswith("bfloat16")
    back = released_config_dict(cfg)
    assert back["dtype"] == "bfloat16" and back["rope_theta"] == 10000.0 and "rope_scaling" in back
    assert back["model_type"] == "kimi_linear" and back["model_max_length"] == 1048576
    assert back["linear_attn_config"]["kda_layers"] == RELEASED_48B["linear_attn_config"]["kda_layers"]
    assert back["linear_attn_config"]["full_attn_layers"] == RELEASED_48B["linear_attn_config"]["full_attn_layers"]


def test_48b_preset_parameter_count_on_meta():
    cfg = KimiHybridConfig.from_preset("kimi-linear-48b-a3b")
    with torch.device("meta"):
        model = KimiHybridForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == 49_122_681_728


@pytest.mark.parametrize("bad, match", [
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [2, 3, 4]}}, "listed twice"),
    ({"linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [4]}}, r"layers \[3\]"),
    ({"linear_attn_config": {"kda_layers": [0, 1, 2], "full_attn_layers": [4]}}, "outside 1..4"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"moe_router_activation_func": "relu"}, "moe_router_activation_func"),
    ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ({"qk_rope_head_dim": 0}, "qk_rope_head_dim=0"),
    ({"linear_attn_config": {"head_dim": 0, "num_heads": 2, "kda_layers": [1, 2, 3], "full_attn_layers": [4]}},
     "head_dim=0"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types has 3 entries"),
    ({"num_experts_per_token": 99}, "num_experts_per_token"),
])
def test_invalid_configs_name_the_field(bad, match):
    kw = dict(num_hidden_layers=4, vocab_size=32, hidden_size=16, num_attention_heads=2, num_experts=8,
              num_experts_per_token=2, linear_attn_config={"head_dim": 8, "num_heads": 2})
    if "layer_types" not in bad and "linear_attn_config" not in bad:
        kw["linear_attn_config"]["kda_layers"] = [1, 2, 3]
        kw["linear_attn_config"]["full_attn_layers"] = [4]
    kw.update(bad)
    with pytest.raises((ValueError, KeyError), match=match):
        KimiHybridConfig(**kw)


def test_unknown_preset():
    with pytest.raises(KeyError, match="known presets"):
        KimiHybridConfig.from_preset("kimi-linear-nope")


# ------------------------------------------------------------------------------------------------------------------
# forward / cache
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PRESETS)
def test_prefill_plus_decode_equals_full_forward(name):
    model = tiny(name)
    ids = torch.randint(3, model.config.vocab_size, (2, 19))
    with torch.no_grad():
        full = model(ids).logits
        for split in (1, 7, 12):
            out = model(ids[:, :split], use_cache=True)
            cache, pieces = out.past_key_values, [out.logits]
            for t in range(split, 19):
                o = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                pieces.append(o.logits)
            inc = torch.cat(pieces, 1)
            assert (inc - full).abs().max() < TOL, (name, split)
            assert cache.get_seq_length() == 19
            # multi-token continuation (a chunk) after a prefill
            out = model(ids[:, :split], use_cache=True)
            o2 = model(ids[:, split:], past_key_values=out.past_key_values, use_cache=True)
            assert (o2.logits - full[:, split:]).abs().max() < TOL


@pytest.mark.parametrize("name", PRESETS)
def test_left_padded_batch_equals_each_row_alone(name):
    model = tiny(name, seed=1)
    rows = [torch.randint(3, 128, (n,)) for n in (9, 5, 1)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        for i, r in enumerate(rows):
            alone = model(r[None]).logits[0]
            assert (batch[i, T - len(r):] - alone).abs().max() < TOL
            g_alone = model.generate(r[None], attention_mask=torch.ones(1, len(r), dtype=torch.long),
                                     max_new_tokens=6, do_sample=False)
            assert torch.equal(gen[i, T:], g_alone[0, len(r):])


def test_greedy_generate_equals_no_cache_recompute():
    model = tiny("tiny-kda-first", seed=2)
    ids = torch.randint(3, 128, (1, 6))
    out = model.generate(ids, max_new_tokens=10, do_sample=False)
    seq = ids
    with torch.no_grad():
        for _ in range(10):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    sampled = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=5, temperature=0.8)
    assert sampled.shape == (1, 11)


def test_loss_and_logits_to_keep():
    model = tiny("tiny-mla-first", seed=3)
    ids = torch.randint(3, 128, (2, 8))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 128).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert abs(out.loss.item() - ref.item()) < 1e-6
    last = model(ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, 128) and (last[:, 0] - out.logits[:, -1]).abs().max() < TOL
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters()
               if p.requires_grad and "e_score" not in n and ".experts." not in n)


def test_memory_report_matches_formula_and_tensors():
    model = tiny("tiny-kda-first")
    cfg = model.config
    B = 3
    reports = []
    for T in (5, 17):
        with torch.no_grad():
            cache = model(torch.randint(3, 128, (B, T)), past_key_values=KimiHybridCache(cfg),
                          use_cache=True).past_key_values
        rep = cache.memory_report()
        held = {"kda": 0, "mla": 0}
        for kind, layer in zip(cfg.layer_types, cache.layers):
            for t in layer_tensors(layer).values():
                held["kda" if kind == "linear_attention" else "mla"] += t.numel() * t.element_size()
        assert rep["kda_bytes"] == held["kda"] and rep["mla_bytes"] == held["mla"]
        n_mla = cfg.layer_types.count("full_attention")
        n_kda = cfg.layer_types.count("linear_attention")
        assert rep["mla_bytes"] == n_mla * T * B * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
        H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_size
        assert rep["kda_bytes"] == n_kda * B * (H * K * K * 4 + 3 * H * K * W * 4)
        assert rep["total_bytes"] == rep["kda_bytes"] + rep["mla_bytes"] + rep["mask_bytes"] + rep["hidden_bytes"]
        reports.append(rep)
    assert reports[0]["kda_bytes"] == reports[1]["kda_bytes"]  # fixed size, whatever T
    assert reports[1]["mla_bytes"] - reports[0]["mla_bytes"] == 12 * reports[0]["mla_bytes_per_token"]
    for kind, layer in zip(cfg.layer_types, cache.layers):
        if kind == "linear_attention":
            assert layer.recurrent_states[0].dtype == torch.float32


def test_mla_cache_holds_only_the_latent():
    model = tiny("tiny-mla-first")
    with torch.no_grad():
        cache = model(torch.randint(3, 128, (2, 7)), past_key_values=KimiHybridCache(model.config),
                      use_cache=True).past_key_values
    cfg = model.config
    for kind, layer in zip(cfg.layer_types, cache.layers):
        if kind == "full_attention":
            assert list(layer_tensors(layer)) == ["latent"]
            assert layer.latent.shape == (2, 7, cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def test_latent_decode_equals_decompressed():
    model = tiny("tiny-mla-first", seed=4)
    ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        c = model(ids[:, :10], use_cache=True).past_key_values
        absorbed = model(ids[:, 10:], past_key_values=c, use_cache=True).logits
        model.config.mla_absorb_max_q_len = 0  # force the decompressed path
        c = model(ids[:, :10], use_cache=True).past_key_values
        decomp = model(ids[:, 10:], past_key_values=c, use_cache=True).logits
    assert (absorbed - decomp).abs().max() < TOL


def test_bf16_save_load_keeps_fp32_parameters(tmp_path):
    model = tiny("tiny-kda-first")
    model.save_pretrained(tmp_path)
    for f in ("configuration_kimi_hybrid.py", "modeling_kimi_hybrid.py", "cache_kimi_hybrid.py",
              "kda_kimi_hybrid.py"):
        assert (tmp_path / f).exists(), f
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "kimi_hybrid"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_hybrid.KimiHybridForCausalLM"
    loaded = KimiHybridForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    fp32 = {n for n, p in loaded.named_parameters() if p.dtype == torch.float32}
    assert fp32 and all(n.endswith(("A_log", "dt_bias", "e_score_correction_bias")) for n in fp32)
    n_kda = loaded.config.layer_types.count("linear_attention")
    n_moe = loaded.config.mlp_layer_types.count("sparse")
    assert len(fp32) == 2 * n_kda + n_moe
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    sd = model.state_dict()
    for n, p in loaded.named_parameters():
        if n in fp32:
            assert torch.equal(p, sd[n])


def test_auto_model_generate_installed(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tiny("tiny-kda-first")
    model.save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)).__name__ == "KimiHybridConfig"
    auto = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 128, (1, 5))
    assert torch.equal(auto.generate(ids, max_new_tokens=4, do_sample=False),
                       model.generate(ids, max_new_tokens=4, do_sample=False))


def test_trust_remote_code_without_the_package(tmp_path):
    """Load the saved folder in a new process where neither kimi_hybrid nor the repo can be imported."""
    model = tiny("tiny-mla-first")
    model.save_pretrained(tmp_path / "m")
    ids = torch.randint(3, 128, (1, 5))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)[0].tolist()
    script = textwrap.dedent(f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('kimi_hybrid', 'modeling_kimi_hybrid'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import torch
        from transformers import AutoModelForCausalLM
        try:
            import kimi_hybrid
            raise SystemExit('package importable')
        except ImportError:
            pass
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r}, trust_remote_code=True)
        assert type(m).__module__.startswith('transformers_modules'), type(m).__module__
        out = m.generate(torch.tensor([{ids[0].tolist()}]), max_new_tokens=4, do_sample=False)
        print('TOKENS', out[0].tolist())
    """)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(tmp_path), env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [l for l in res.stdout.splitlines() if l.startswith("TOKENS")][0]
    assert json.loads(line.split(" ", 1)[1]) == expected


def test_cache_of_another_model_is_refused():
    a, b = tiny("tiny-kda-first"), tiny("tiny-mla-first")
    for given in (None, KimiHybridCache(a.config)):  # the default (a transformers DynamicCache) and ours
        with torch.no_grad():
            cache = a(torch.randint(3, 128, (1, 4)), past_key_values=given, use_cache=True).past_key_values
            with pytest.raises(ValueError, match="another model"):
                b(torch.randint(3, 128, (1, 1)), past_key_values=cache, use_cache=True)
            with pytest.raises(ValueError, match="batch"):
                a(torch.randint(3, 128, (2, 1)), past_key_values=cache, use_cache=True)


# ------------------------------------------------------------------------------------------------------------------
# parity with transformers' native kimi_linear (an implementation nobody here wrote)
# ------------------------------------------------------------------------------------------------------------------

def native_pair(order):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from kimi_hybrid.conversion.native import native_state_dict_views

    ours_cfg = preset_config(order)
    ncfg = KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, layer_types=ours_cfg.layer_types, mlp_layer_types=ours_cfg.mlp_layer_types,
        linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.446, pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
    )
    ncfg._attn_implementation = "eager"
    torch.manual_seed(0)
    native = KimiLinearForCausalLM(ncfg).eval()
    with torch.no_grad():
        for n, b in list(native.named_buffers()) + list(native.named_parameters()):
            if "e_score_correction_bias" in n:
                b.normal_(0, 0.2)
    ours = KimiHybridForCausalLM(ours_cfg).eval()
    missing, unexpected = ours.load_state_dict(native_state_dict_views(native.state_dict(), ncfg), strict=True)
    assert not missing and not unexpected
    return native, ours


@pytest.mark.parametrize("order", ["tiny-kda-first", "tiny-mla-first"])
def test_parity_with_native_kimi_linear(order):
    native, ours = native_pair(order)
    ids = torch.randint(3, 128, (3, 13))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :12] = 0
    with torch.no_grad():
        a = native(ids, attention_mask=mask).logits
        b = ours(ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max() <= 1e-5
    ga = native.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    gb = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, gb)


# ---------------------------------------------------------------------------------------------------------------
# bad inputs: clear errors (found by a new-user trial: these used to fail deep inside torch or pass silently)
# ---------------------------------------------------------------------------------------------------------------

def test_bad_input_ids_and_masks_raise_clear_errors():
    m = tiny("tiny-kda-first")
    V = m.config.vocab_size
    ids = torch.randint(3, V, (2, 5))
    cases = [
        (dict(input_ids=ids[0]), "add the batch dimension"),
        (dict(input_ids=ids[:, :0]), "no tokens"),
        (dict(input_ids=ids.float()), "integer token ids"),
        (dict(input_ids=torch.tensor([[1, 2, V]])), rf"\[1, {V}\] but the vocabulary has {V}"),
        (dict(input_ids=torch.tensor([[-1, 2]])), "valid ids"),
        (dict(input_ids=ids, attention_mask=torch.ones(3, 5, dtype=torch.long)), "batch 3 but the input has batch 2"),
        (dict(input_ids=ids, attention_mask=torch.ones(2, 7, dtype=torch.long)), "7 columns for 5 tokens and no cached tokens"),
        (dict(inputs_embeds=torch.randn(2, 0, m.config.hidden_size)), "seq >= 1"),
    ]
    with torch.no_grad():
        for kw, msg in cases:
            with pytest.raises(ValueError, match=msg):
                m(**kw)
        cache = KimiHybridCache(m.config)
        m(ids, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="must have 6 \\(past \\+ new\\) or 1"):
            m(ids[:, :1], attention_mask=torch.ones(2, 4, dtype=torch.long), past_key_values=cache, use_cache=True)
        # the accepted forms still work: [B, past + T] and [B, T] with a cache
        m(ids[:, :1], attention_mask=torch.ones(2, 6, dtype=torch.long), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 0), ("num_hidden_layers", -2), ("hidden_size", 0),
                                         ("vocab_size", 2.5)])
def test_config_rejects_non_positive_sizes(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        preset_config("tiny-kda-first", **{field: value})


def test_from_pretrained_refuses_missing_and_unexpected_tensors(tmp_path):
    """A checkpoint that lacks a tensor (transformers would initialise it randomly) or holds an extra one (it would be
    dropped) is refused with the names; strict_loading=False restores the lenient load; output_loading_info works."""
    from safetensors.torch import load_file, save_file

    m = tiny("tiny-kda-first")
    m.save_pretrained(tmp_path / "ok")
    loaded, info = KimiHybridForCausalLM.from_pretrained(tmp_path / "ok", output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    ids = torch.randint(3, m.config.vocab_size, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, m(ids).logits)
    sd = load_file(tmp_path / "ok" / "model.safetensors")
    for name, edit in (("missing", lambda d: d.pop("model.layers.0.self_attn.A_log")),
                       ("unexpected", lambda d: d.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))):
        folder = tmp_path / name
        m.save_pretrained(folder)
        d = dict(sd)
        edit(d)
        save_file(d, folder / "model.safetensors", metadata={"format": "pt"})
        key = "model.layers.0.self_attn.A_log" if name == "missing" else "model.layers.0.extra.weight"
        with pytest.raises(ValueError, match=rf"{name} .*{key.replace('.', '[.]')}.*kimi-hybrid-convert"):
            KimiHybridForCausalLM.from_pretrained(folder)
        lenient = KimiHybridForCausalLM.from_pretrained(folder, strict_loading=False)
        assert type(lenient) is KimiHybridForCausalLM


def test_tie_word_embeddings_ties_and_round_trips(tmp_path):
    """tie_word_embeddings=True (not the released setting) shares one tensor between lm_head and the embedding, saves
    it once, and reloads tied with the same logits; False keeps two tensors."""
    from safetensors import safe_open

    for tie in (True, False):
        m = tiny("tiny-kda-first", tie_word_embeddings=tie)
        assert (m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()) == tie
        m.save_pretrained(tmp_path / str(tie))
        with safe_open(str(tmp_path / str(tie) / "model.safetensors"), "pt") as f:
            assert ("lm_head.weight" in f.keys()) == (not tie)
        back = KimiHybridForCausalLM.from_pretrained(tmp_path / str(tie))
        assert (back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()) == tie
        ids = torch.randint(3, m.config.vocab_size, (1, 6))
        with torch.no_grad():
            assert torch.equal(back(ids).logits, m(ids).logits)


def test_meta_static_cache_memory_report_for_planning():
    """A static cache on the meta device (no memory) reports the bytes of the 48B shape: 43,909,120 B of KDA state
    + 8,064 B per position of MLA latent."""
    cfg = KimiHybridConfig.from_preset("kimi-linear-48b-a3b")
    rep = KimiHybridCache(cfg, max_cache_len=4096, batch_size=1, dtype=torch.bfloat16, device="meta").memory_report()
    assert rep["kda_bytes"] == 43_909_120 and rep["mla_bytes"] == 8_064 * 4096
