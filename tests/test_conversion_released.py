"""Released Kimi-Linear layout <-> ours: inventory of the 48B config, configs, bit-exact streaming round trip."""

import json
import os

import pytest
import torch

from conversion_fixtures import (
    read_all,
    released_tensors,
    same_bytes,
    split_experts_across_shards,
    tiny_released_config,
    write_checkpoint,
)

from kimi_hybrid import conversion
from kimi_hybrid.conversion import config_io
from kimi_hybrid.conversion.__main__ import main as cli_main
from kimi_hybrid.conversion.convert import convert_checkpoint
from kimi_hybrid.conversion.inventory import inventory

PRESET = "kimi-linear-48b-a3b-instruct"


def test_packaged_48b_config_has_the_43_released_keys():
    cfg = config_io.preset_config(PRESET)
    assert len(cfg) == 43
    assert sorted(cfg) == config_io.RELEASED_KEYS
    assert cfg["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 27]
    assert cfg["model_max_length"] == 1048576 and "max_position_embeddings" not in cfg


def test_inventory_of_the_48b_config():
    inv = inventory(config_io.preset_config(PRESET))
    assert inv["source"]["tensors"] == 20_493
    assert inv["source"]["elements"] == 49_122_681_728
    assert inv["target"]["parameters"] == 49_122_681_728
    # bf16 everywhere except fp32 A_log (20x32), dt_bias (20x4096), e_score_correction_bias (26x256)
    assert inv["source"]["bytes"] == 2 * 49_122_681_728 + 2 * (20 * 32 + 20 * 4096 + 26 * 256)
    assert inv["layers"] == {"linear_attention": 20, "full_attention": 7, "dense_mlp": 1, "sparse_mlp": 26}
    tgt = {r["key"]: r for r in inv["target"]["keys"]}
    assert tgt["model.layers.1.mlp.experts.gate_up_proj"]["shape"] == [256, 2048, 2304]
    assert tgt["model.layers.1.mlp.experts.down_proj"]["shape"] == [256, 2304, 1024]
    assert tgt["model.layers.0.self_attn.A_log"] == {"key": "model.layers.0.self_attn.A_log", "shape": [32],
                                                      "dtype": "F32", "sources": 1}
    assert "model.layers.3.self_attn.kv_b_proj.weight" in tgt and "model.layers.3.self_attn.A_log" not in tgt
    assert len(tgt) == 20_493 - 26 * 768 + 26 * 2


def test_inventory_cli(tmp_path, capsys):
    out = tmp_path / "inv.json"
    assert cli_main(["inventory", "--preset", PRESET, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "20,493 tensors" in text and "49,122,681,728" in text
    assert json.loads(out.read_text())["source"]["tensors"] == 20_493


def test_released_config_round_trip_48b():
    rel = config_io.preset_config(PRESET)
    ours = conversion.released_config_to_ours(rel)
    assert ours["model_type"] == "kimi_hybrid"
    assert ours["max_position_embeddings"] == 1048576 and "model_max_length" not in ours
    mla = [i for i, t in enumerate(ours["layer_types"]) if t == "full_attention"]
    assert mla == [3, 7, 11, 15, 19, 23, 26]
    assert ours["mlp_layer_types"] == ["dense"] + ["sparse"] * 26
    assert ours["linear_num_heads"] == 32 and ours["linear_conv_kernel_size"] == 4
    back = conversion.ours_config_to_released(ours)
    assert back == rel and list(back) == sorted(rel)


def _convert_pair(tmp_path, bias_dtype=torch.float32):
    cfg = tiny_released_config()
    t = released_tensors(cfg, seed=1, bias_dtype=bias_dtype)
    shards = split_experts_across_shards(cfg, t)
    write_checkpoint(str(tmp_path / "rel"), cfg, t, shards)
    rep = convert_checkpoint(str(tmp_path / "rel"), str(tmp_path / "ours"), progress=False, max_shard_size="20KB")
    return cfg, t, rep


def test_fixture_really_splits_experts_across_shards(tmp_path):
    cfg = tiny_released_config()
    t = released_tensors(cfg)
    first, second = split_experts_across_shards(cfg, t)
    experts = [k for k in t if k.startswith("model.layers.1.block_sparse_moe.experts.")]
    assert any(k in first for k in experts) and any(k in second for k in experts)
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in first
    assert "model.layers.1.block_sparse_moe.experts.0.w3.weight" in second


def test_released_to_ours_layout(tmp_path):
    cfg, t, rep = _convert_pair(tmp_path)
    ours = read_all(str(tmp_path / "ours"))
    F, E, D = cfg["moe_intermediate_size"], cfg["num_experts"], cfg["hidden_size"]
    for i in (1, 2, 3):
        gu = ours[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        dn = ours[f"model.layers.{i}.mlp.experts.down_proj"]
        assert gu.shape == (E, 2 * F, D) and dn.shape == (E, D, F) and gu.dtype == torch.bfloat16
        for e in range(E):
            src = f"model.layers.{i}.block_sparse_moe.experts.{e}."
            assert same_bytes(gu[e, :F].contiguous(), t[src + "w1.weight"])
            assert same_bytes(gu[e, F:].contiguous(), t[src + "w3.weight"])
            assert same_bytes(dn[e].contiguous(), t[src + "w2.weight"])
        assert same_bytes(ours[f"model.layers.{i}.mlp.gate.weight"], t[f"model.layers.{i}.block_sparse_moe.gate.weight"])
    a = ours["model.layers.0.self_attn.A_log"]
    assert a.shape == (2,) and a.dtype == torch.float32
    assert torch.equal(a, t["model.layers.0.self_attn.A_log"].reshape(-1))
    assert ours["model.layers.0.self_attn.dt_bias"].dtype == torch.float32
    assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert "model.layers.0.mlp.gate_proj.weight" in ours  # dense layer keeps mlp.
    assert not any("block_sparse_moe" in k for k in ours)
    assert len(rep["destination"]["shards"]) > 1  # max_shard_size forced several output shards
    conf = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert conf["model_type"] == "kimi_hybrid"
    assert conf["layer_types"] == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert conf["linear_attn_config"]["kda_layers"] == [1, 2, 4]
    for f in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "rel" / f).read_bytes()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_report_accounts_for_every_source_tensor(tmp_path):
    cfg, t, rep = _convert_pair(tmp_path)
    on_disk = json.loads((tmp_path / "ours" / "conversion_report.json").read_text())
    assert on_disk["checks"] == rep["checks"]
    srcs = rep["sources"]
    assert set(srcs) == set(t)
    import hashlib

    for k, v in t.items():
        e = srcs[k]
        assert e["status"] == "used" and e["destinations"]
        assert e["dtype"] == {torch.bfloat16: "BF16", torch.float32: "F32"}[v.dtype] and e["shape"] == list(v.shape)
        assert e["sha256"] == hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    ours = read_all(str(tmp_path / "ours"))
    for k, e in rep["destinations"].items():
        assert e["sha256"] == hashlib.sha256(ours[k].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        covered = sum(p["dst_elements"][1] - p["dst_elements"][0] for p in e["provenance"])
        assert covered == ours[k].numel()
    gu = rep["destinations"]["model.layers.1.mlp.experts.gate_up_proj"]["provenance"]
    assert [p["src"][0].rsplit(".", 2)[-2] for p in gu[:4]] == ["w1", "w3", "w1", "w3"]


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_round_trip_released_ours_released_bit_exact(tmp_path, bias_dtype):
    cfg, t, _ = _convert_pair(tmp_path, bias_dtype)
    if bias_dtype == torch.bfloat16:  # ours keeps e_score_correction_bias in fp32 whatever the source
        assert read_all(str(tmp_path / "ours"))["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    rep = convert_checkpoint(str(tmp_path / "ours"), str(tmp_path / "back"), progress=False)
    assert rep["source"]["format"] == "ours" and rep["destination"]["format"] == "released"
    back = read_all(str(tmp_path / "back"))
    assert set(back) == set(t)
    bad = [k for k in t if not same_bytes(back[k], t[k])]
    assert not bad, bad
    # every field comes back but auto_map, which named remote code (configuration_kimi.py, ...) the folder lacks
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == {k: v for k, v in cfg.items()
                                                                          if k != "auto_map"}
    src_sha = {k: e["sha256"] for k, e in json.loads((tmp_path / "ours" / "conversion_report.json").read_text())["sources"].items()}
    dst_sha = {k: e["sha256"] for k, e in rep["destinations"].items()}
    assert src_sha == dst_sha


def test_in_memory_round_trip_matches_streaming(tmp_path):
    cfg, t, _ = _convert_pair(tmp_path)
    ours_mem = conversion.released_state_dict_to_ours(t, cfg)
    ours_disk = read_all(str(tmp_path / "ours"))
    assert set(ours_mem) == set(ours_disk)
    assert all(same_bytes(ours_mem[k], ours_disk[k]) for k in ours_mem)
    back = conversion.ours_state_dict_to_released(ours_mem, conversion.released_config_to_ours(cfg))
    assert all(same_bytes(back[k], t[k]) for k in t)


def test_cli_convert_and_export(tmp_path):
    cfg = tiny_released_config()
    t = released_tensors(cfg, seed=3)
    write_checkpoint(str(tmp_path / "rel"), cfg, t, 3)
    assert cli_main([str(tmp_path / "rel"), str(tmp_path / "ours"), "--no-progress", "--checksum", "crc32"]) == 0
    assert cli_main(["export", str(tmp_path / "ours"), str(tmp_path / "back"), "--no-progress"]) == 0
    back = read_all(str(tmp_path / "back"))
    assert set(back) == set(t) and all(same_bytes(back[k], t[k]) for k in t)
    # refuses to overwrite, unless asked
    assert cli_main([str(tmp_path / "rel"), str(tmp_path / "ours"), "--no-progress"]) == 2
    assert cli_main([str(tmp_path / "rel"), str(tmp_path / "ours"), "--no-progress", "--overwrite"]) == 0
    assert sorted(p for p in os.listdir(tmp_path)) == ["back", "ours", "rel"]


def test_tied_embeddings_convert_and_load_tied(tmp_path):
    """tie_word_embeddings=True: the released checkpoint has no lm_head; the converted folder loads with lm_head tied
    to the embedding (same storage), strict loading finds nothing missing, and the logits use the embedding."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_released_config(tie_word_embeddings=True)
    t = released_tensors(cfg, seed=3)
    t.pop("lm_head.weight", None)
    write_checkpoint(str(tmp_path / "src"), cfg, t, 2)
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "ours"), progress=False)
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert m.config.tie_word_embeddings
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert torch.equal(m.model.embed_tokens.weight, t["model.embed_tokens.weight"].float())
    ids = torch.randint(3, cfg["vocab_size"], (1, 7))
    with torch.no_grad():
        h = m.model(ids).last_hidden_state
        assert torch.allclose(m(ids).logits, h @ t["model.embed_tokens.weight"].float().T, atol=1e-5)
