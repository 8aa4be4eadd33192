"""Kimi K3 text backbone -> ours: language_model. prefix, vision keys skipped, MXFP4 experts dequantized exactly,
A_log [128] zero padding checked and sliced, fp32 tensors kept fp32, K3-only keys kept."""

import json
import os

import pytest
import torch

from conversion_fixtures import (
    k3_tensors,
    mxfp4_pack,
    mxfp4_reference_element,
    read_all,
    same_bytes,
    tiny_k3_config,
    write_checkpoint,
)

from kimi_hybrid.conversion.binding import CheckpointError
from kimi_hybrid.conversion.convert import convert_checkpoint
from kimi_hybrid.conversion.mxfp4 import MXFP4Error, dequantize_mxfp4


def test_dequantizer_against_per_element_restatement():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 96), generator=g, dtype=torch.uint8)
    packed = mxfp4_pack(codes)
    scale = torch.randint(100, 140, (5, 3), generator=g, dtype=torch.uint8)
    w32 = dequantize_mxfp4(packed, scale, dtype=torch.float32)
    wbf = dequantize_mxfp4(packed, scale)  # bf16 default
    assert w32.shape == (5, 96) and wbf.dtype == torch.bfloat16
    for o in range(5):
        for c in range(96):
            ref = mxfp4_reference_element(packed, scale, o, c)
            assert w32[o, c].item() == ref, (o, c)
            assert wbf[o, c].float().item() == ref, (o, c)  # bf16 is exact


def test_dequantizer_nibble_order_and_extremes():
    # one row: columns 0/1 in byte 0 -> low nibble is column 0
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x2F  # col0 = 0xF (-6), col1 = 0x2 (+1)
    scale = torch.full((1, 1), 127, dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale, dtype=torch.float32)
    assert w[0, 0].item() == -6.0 and w[0, 1].item() == 1.0
    # smallest and largest finite scales stay exact in bf16
    packed[0, 0] = 0x71  # col0 = 0.5, col1 = 6
    for s in (0, 252):
        scale[0, 0] = s
        w = dequantize_mxfp4(packed, scale)
        assert w[0, 0].float().item() == 0.5 * 2.0 ** (s - 127)
        assert w[0, 1].float().item() == 6.0 * 2.0 ** (s - 127)
    with pytest.raises(MXFP4Error, match="255"):
        dequantize_mxfp4(packed, torch.full((1, 1), 255, dtype=torch.uint8))
    with pytest.raises(MXFP4Error, match="scale shape"):
        dequantize_mxfp4(packed, torch.full((1, 2), 127, dtype=torch.uint8))


def _k3(tmp_path, **kw):
    k3 = tiny_k3_config()
    t = k3_tensors(k3, seed=5, **kw)
    write_checkpoint(str(tmp_path / "k3"), k3, t, 3)
    return k3, t


def test_k3_to_ours(tmp_path, capsys):
    k3, t = _k3(tmp_path)
    rep = convert_checkpoint(str(tmp_path / "k3"), str(tmp_path / "ours"), progress=False)
    err = capsys.readouterr().err
    assert "skipping 5 tensors that are not part of the text backbone: mm_projector (2), vision_tower (3)" in err
    assert rep["source"]["format"] == "k3" and rep["source"]["variant"] == "prefixed+mxfp4"
    assert rep["checks"]["skipped_sources"] == 5
    assert rep["sources"]["vision_tower.blocks.0.attn.qkv.weight"]["status"].startswith("skipped")
    assert rep["dequant_dtype"] == "BF16"
    ours = read_all(str(tmp_path / "ours"))
    assert not any(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in ours)
    text = k3["text_config"]
    H, F, L, E = 2, text["moe_intermediate_size"], text["routed_expert_hidden_size"], text["num_experts"]
    # A_log: [128] zero padded -> [H] fp32, values unchanged
    a = ours["model.layers.0.self_attn.A_log"]
    assert a.shape == (H,) and a.dtype == torch.float32
    assert torch.equal(a, t["language_model.model.layers.0.self_attn.A_log"][:H])
    # fp32 on disk stays fp32
    for k in ("model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.o_norm.weight",
              "model.layers.0.self_attn.dt_bias", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert ours[k].dtype == torch.float32, k
        assert same_bytes(ours[k], t["language_model." + k.replace(".mlp.", ".block_sparse_moe.")]), k
    # K3-only keys kept with our names
    for k in ("model.layers.0.self_attn.g_proj.weight", "model.layers.2.self_attn.g_proj.weight",
              "model.layers.2.self_attn.q_a_proj.weight", "model.layers.1.mlp.routed_expert_down_proj.weight",
              "model.layers.1.mlp.routed_expert_norm.weight", "model.layers.1.mlp.routed_expert_up_proj.weight",
              "model.layers.3.self_attention_res_proj.weight", "model.layers.3.mlp_res_norm.weight",
              "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight", "lm_head.weight"):
        assert k in ours, k
    assert same_bytes(ours["lm_head.weight"], t["language_model.lm_head.weight"])
    # experts: dequantized, stacked, exact
    gu, dn = ours["model.layers.3.mlp.experts.gate_up_proj"], ours["model.layers.3.mlp.experts.down_proj"]
    assert gu.shape == (E, 2 * F, L) and dn.shape == (E, L, F) and gu.dtype == torch.bfloat16
    p = "language_model.model.layers.3.block_sparse_moe.experts."
    for e in range(E):
        for w, view in (("w1", gu[e, :F]), ("w3", gu[e, F:]), ("w2", dn[e])):
            packed, scale = t[f"{p}{e}.{w}.weight_packed"], t[f"{p}{e}.{w}.weight_scale"]
            for (o, c) in ((0, 0), (1, 1), (view.shape[0] - 1, view.shape[1] - 1), (3, 17)):
                assert view[o, c].float().item() == mxfp4_reference_element(packed, scale, o, c)
            assert torch.equal(view.float(), dequantize_mxfp4(packed, scale, dtype=torch.float32))
    conf = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert conf["model_type"] == "kimi_hybrid" and conf["hidden_act"] == "situ"
    assert conf["routed_expert_hidden_size"] == L and conf["attn_res_block_size"] == 2
    assert conf["linear_attn_config"]["gate_lower_bound"] == -5.0
    assert "quantization_config" not in conf


def test_k3_nonzero_a_log_padding_is_refused(tmp_path):
    _k3(tmp_path, a_log_tail_zero=False)
    with pytest.raises(CheckpointError, match=r"A_log.*padding values are not zero"):
        convert_checkpoint(str(tmp_path / "k3"), str(tmp_path / "ours"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["k3"]


def test_k3_unknown_top_level_key_is_refused(tmp_path):
    k3 = tiny_k3_config()
    t = k3_tensors(k3, seed=5)
    t["audio_tower.w"] = torch.zeros(2, dtype=torch.bfloat16)
    write_checkpoint(str(tmp_path / "k3"), k3, t, 2)
    with pytest.raises(CheckpointError, match="audio_tower.w"):
        convert_checkpoint(str(tmp_path / "k3"), str(tmp_path / "ours"), progress=False)


def test_k3_bf16_expert_slice_without_mxfp4(tmp_path):
    """A bf16 K3 slice (experts stored as plain .weight) converts by byte copy."""
    k3 = tiny_k3_config()
    t = k3_tensors(k3, seed=6, mxfp4=False)
    write_checkpoint(str(tmp_path / "k3"), k3, t, 2)
    rep = convert_checkpoint(str(tmp_path / "k3"), str(tmp_path / "ours"), progress=False)
    assert rep["source"]["variant"] == "prefixed"
    ours = read_all(str(tmp_path / "ours"))
    F = k3["text_config"]["moe_intermediate_size"]
    assert same_bytes(ours["model.layers.1.mlp.experts.gate_up_proj"][2, F:].contiguous(),
                      t["language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight"])


def test_k3_converted_folder_loads_in_our_model(tmp_path):
    from kimi_hybrid.conversion.model_glue import model_package

    pkg = model_package()
    if pkg is None:
        pytest.skip("model bundle not available")
    _k3(tmp_path)
    convert_checkpoint(str(tmp_path / "k3"), str(tmp_path / "ours"), progress=False)
    m = pkg.KimiHybridForCausalLM.from_pretrained(str(tmp_path / "ours"))
    sd = m.state_dict()
    disk = read_all(str(tmp_path / "ours"))
    assert set(sd) == set(disk)
    assert sd["model.layers.0.self_attn.A_log"].dtype == torch.float32
    with torch.no_grad():
        out = m(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out.float()).all()
