"""transformers-native kimi_linear -> ours, and logits parity of the converted folders with the native model.

Parity contract: a tiny `transformers.KimiLinearForCausalLM` (random weights, every parameter and buffer
re-drawn) is (a) saved with `save_pretrained` (native layout; both transformers' default reverse-mapped names and
`save_original_format=False` fused names), (b) rebuilt as a released-layout folder by hand; every folder is
converted and loaded with `KimiHybridForCausalLM.from_pretrained`; fp32 logits must match the native model's with
max abs diff <= 1e-5.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conversion_fixtures import read_all, same_bytes, write_checkpoint

from kimi_hybrid.conversion.convert import convert_checkpoint
from kimi_hybrid.conversion.model_glue import model_package
from kimi_hybrid.conversion.state_dict import native_state_dict_to_ours

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

TOL = 1e-5


def _native_model(seed=0):
    torch.manual_seed(seed)
    cfg = KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                            "full_attn_layers": [3]},
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    m = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.normal_(0, 0.2)
        for _, b in m.named_buffers():
            if b.is_floating_point():
                b.normal_(0, 0.2)
    return cfg, m


def _released_from_native(sd, cfg) -> dict:
    """Released remote-code names built by hand from the native state dict (independent of the converter)."""
    out = {}
    H, P = cfg.linear_num_heads, cfg.linear_num_heads * cfg.linear_head_dim
    for k, v in sd.items():
        if ".self_attn.conv1d.weight" in k:
            base = k.replace("conv1d.weight", "")
            for j, n in enumerate("qkv"):
                out[f"{base}{n}_conv1d.weight"] = v[j * P:(j + 1) * P].clone()
        elif ".forget_gate." in k:
            out[k.replace("forget_gate.", "")] = v.clone()
        elif k.endswith("mlp.experts.gate_up_proj"):
            base = k.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
            F = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.w1.weight"] = v[e, :F].clone()
                out[f"{base}{e}.w3.weight"] = v[e, F:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            base = k.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
            for e in range(v.shape[0]):
                out[f"{base}{e}.w2.weight"] = v[e].clone()
        elif ".mlp.gate." in k or ".mlp.shared_experts." in k:
            out[k.replace(".mlp.", ".block_sparse_moe.")] = v.clone()
        else:
            out[k] = v.clone()
    assert out["model.layers.0.self_attn.A_log"].shape == (1, 1, H, 1)
    return out


def _released_config(cfg) -> dict:
    rel = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "float32",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "model_max_length": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "q_lora_rank": None, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "v_head_dim": 8, "mla_use_nope": True, "num_experts": 4, "num_experts_per_token": 2,
        "moe_intermediate_size": 16, "num_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "routed_scaling_factor": cfg.routed_scaling_factor, "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
        "linear_attn_config": {"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                               "full_attn_layers": [3]},
    }
    return rel


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def test_in_memory_native_to_ours_values():
    cfg, m = _native_model()
    sd = m.state_dict()
    ours = native_state_dict_to_ours(sd, cfg)
    P = 16
    conv = sd["model.layers.1.self_attn.conv1d.weight"]
    for j, n in enumerate("qkv"):
        assert same_bytes(ours[f"model.layers.1.self_attn.{n}_conv1d.weight"], conv[j * P:(j + 1) * P].contiguous())
    assert same_bytes(ours["model.layers.0.self_attn.A_log"], sd["model.layers.0.self_attn.forget_gate.A_log"].reshape(-1))
    assert same_bytes(ours["model.layers.2.mlp.experts.gate_up_proj"], sd["model.layers.2.mlp.experts.gate_up_proj"])
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in ours
    # the permissive legacy entry point in conversion/native.py agrees when given the config
    from kimi_hybrid.conversion.native import native_state_dict_views as legacy

    other = legacy(sd, cfg)
    assert set(other) == set(ours) and all(same_bytes(other[k], ours[k]) for k in ours)


def test_native_with_unknown_key_is_refused():
    from kimi_hybrid.conversion.binding import CheckpointError

    cfg, m = _native_model()
    sd = dict(m.state_dict())
    sd["model.layers.0.self_attn.surprise"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.surprise"):
        native_state_dict_to_ours(sd, cfg)


@pytest.mark.skipif(model_package() is None, reason="model bundle (modeling_kimi_hybrid) not available")
def test_converted_folders_match_native_logits(tmp_path):
    pkg = model_package()
    cfg, m = _native_model(seed=1)
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    ref = _logits(m, ids)

    # native folders: transformers' default (reverse-mapped names) and the fused in-memory names
    m.save_pretrained(tmp_path / "native_saved")
    m.save_pretrained(tmp_path / "native_fused", save_original_format=False)
    # released folder built by hand from the native weights, 2 shards with layer 2's experts split
    rel_sd = _released_from_native(m.state_dict(), cfg)
    keys = list(rel_sd)
    cut = keys.index("model.layers.2.block_sparse_moe.experts.2.w1.weight")
    write_checkpoint(str(tmp_path / "released"), _released_config(cfg), rel_sd, [keys[:cut], keys[cut:]])

    outs = {}
    for name, fmt in (("native_saved", "native"), ("native_fused", "native"), ("released", "released")):
        rep = convert_checkpoint(str(tmp_path / name), str(tmp_path / f"ours_{name}"), progress=False)
        assert rep["source"]["format"] == fmt
        model = pkg.KimiHybridForCausalLM.from_pretrained(str(tmp_path / f"ours_{name}"), dtype=torch.float32).eval()
        outs[name] = _logits(model, ids)
        diff = (outs[name] - ref).abs().max().item()
        assert diff <= TOL, (name, diff)
    assert read_all(str(tmp_path / "ours_native_fused")).keys() == read_all(str(tmp_path / "ours_released")).keys()
    variants = {json.loads((tmp_path / f"ours_{n}" / "conversion_report.json").read_text())["source"]["variant"]
                for n in ("native_saved", "native_fused")}
    assert variants == {"saved", "fused"}


@pytest.mark.skipif(model_package() is None, reason="model bundle (modeling_kimi_hybrid) not available")
def test_converted_folder_loads_with_trust_remote_code_in_a_clean_process(tmp_path):
    """The output folder carries the bundle code + auto_map: a process that never imports kimi-hybrid loads it
    through AutoModelForCausalLM(trust_remote_code=True) and gets the native logits."""
    cfg, m = _native_model(seed=2)
    m.save_pretrained(tmp_path / "native")
    convert_checkpoint(str(tmp_path / "native"), str(tmp_path / "ours"), progress=False)
    conf = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert conf["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_hybrid.KimiHybridForCausalLM"
    assert os.path.isfile(tmp_path / "ours" / "modeling_kimi_hybrid.py")
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.save({"ids": ids, "ref": _logits(m, ids)}, tmp_path / "ref.pt")
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"d = torch.load({str(tmp_path / 'ref.pt')!r})\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ours')!r}, trust_remote_code=True, dtype=torch.float32).eval()\n"
        "assert 'kimi_hybrid' not in sys.modules and 'modeling_kimi_hybrid' not in sys.modules, 'package was imported'\n"
        "assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
        "with torch.no_grad(): out = m(d['ids']).logits.float()\n"
        "print('DIFF', (out - d['ref']).abs().max().item())\n"
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    diff = float(r.stdout.split("DIFF")[-1])
    assert diff <= TOL


@pytest.mark.skipif(model_package() is None, reason="model bundle (modeling_kimi_hybrid) not available")
def test_export_of_a_model_saved_by_save_pretrained(tmp_path):
    """The fine-tune path: released -> ours -> KimiHybridForCausalLM.save_pretrained -> export -> released, bit-exact
    (fp32 weights so the model's load/save does not cast)."""
    pkg = model_package()
    cfg, m = _native_model(seed=3)
    rel_sd = _released_from_native(m.state_dict(), cfg)
    write_checkpoint(str(tmp_path / "released"), _released_config(cfg), rel_sd, 2)
    convert_checkpoint(str(tmp_path / "released"), str(tmp_path / "ours"), progress=False)
    model = pkg.KimiHybridForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32)
    model.save_pretrained(str(tmp_path / "saved"))
    convert_checkpoint(str(tmp_path / "saved"), str(tmp_path / "export"), src_format="ours", dst_format="released",
                       progress=False)
    back = read_all(str(tmp_path / "export"))
    assert set(back) == set(rel_sd)
    bad = [k for k in rel_sd if not same_bytes(back[k], rel_sd[k].contiguous())]
    assert not bad, bad
    conf = json.loads((tmp_path / "export" / "config.json").read_text())
    assert conf["model_type"] == "kimi_linear" and conf["linear_attn_config"]["kda_layers"] == [1, 2, 4]
