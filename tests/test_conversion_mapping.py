"""transformers' checkpoint-conversion mapping (``kimi_hybrid.conversion_kimi_hybrid``): ``from_pretrained`` loads a
released Kimi-Linear folder directly, equal tensor for tensor (values, shapes, dtypes) to what our streaming converter
writes from the same folder; ``save_pretrained`` writes the released names, so released -> ours -> save gives back the
source checkpoint exactly; our own layout (converter output, ``save_original_format=False``) loads unchanged and
saves the released names too (never a mixture); what the mapping cannot read (K3, quantized, transformers-native) is
refused before any weight is read, with the ``kimi-hybrid-convert`` command.

The released fixtures are written by hand from the published layout (``conversion_fixtures.py``), not by the mapping
or the converter.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conversion_fixtures import (
    read_all,
    released_tensors,
    split_experts_across_shards,
    tiny_k3_config,
    tiny_released_config,
    write_checkpoint,
)
from decoding_helpers import no_weight_reads
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kimi_hybrid import KimiHybridForCausalLM
from kimi_hybrid.conversion import convert_checkpoint
from kimi_hybrid.conversion_kimi_hybrid import checkpoint_conversion_mapping


def _equal_tensors(got: dict, want: dict) -> None:
    """Same names; every tensor of the same shape and dtype, bit for bit equal."""
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
           or not torch.equal(got[k], want[k])]
    assert not bad, bad[:5]


def _saved_tensors(folder) -> dict:
    folder = str(folder)
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return load_file(os.path.join(folder, "model.safetensors"))
    return read_all(folder)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A tiny released Kimi-Linear folder (KDA, KDA, MLA, KDA; layer 0 dense, 4 experts), its experts split across
    two shards, and our converter's output of it."""
    root = tmp_path_factory.mktemp("mapping")
    cfg = tiny_released_config()
    tensors = released_tensors(cfg)
    src = root / "released"
    write_checkpoint(str(src), cfg, tensors, shards=split_experts_across_shards(cfg, tensors))
    conv = root / "converted"
    convert_checkpoint(str(src), str(conv), progress=False)
    return {"root": root, "src": src, "tensors": tensors, "converted": conv, "config": cfg}


def test_released_folder_loads_directly_and_equals_the_converter(released):
    """Every tensor the mapping loads equals what kimi-hybrid-convert writes: values, shapes and dtypes (bf16 weights,
    fp32 A_log / dt_bias / e_score_correction_bias); strict loading saw no missing or unexpected key."""
    model, info = KimiHybridForCausalLM.from_pretrained(released["src"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    _equal_tensors(model.state_dict(), read_all(str(released["converted"])))
    assert model.model.layers[0].self_attn.A_log.shape == (2,)


def test_released_round_trip_is_exact(released, tmp_path):
    """released -> ours (from_pretrained) -> save_pretrained writes the released checkpoint back exactly (names,
    shapes, dtypes, values); reloading that folder gives the same model, and saving it again the same file."""
    model = KimiHybridForCausalLM.from_pretrained(released["src"])
    model.save_pretrained(tmp_path / "saved")
    _equal_tensors(_saved_tensors(tmp_path / "saved"), released["tensors"])
    again = KimiHybridForCausalLM.from_pretrained(tmp_path / "saved")
    _equal_tensors(again.state_dict(), model.state_dict())
    again.save_pretrained(tmp_path / "saved2")
    _equal_tensors(_saved_tensors(tmp_path / "saved2"), released["tensors"])
    # the Auto class (the package registered it) reads the saved folder through the same mapping
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert type(auto) is KimiHybridForCausalLM
    _equal_tensors(auto.state_dict(), model.state_dict())


def test_our_layout_still_loads_and_saves_released_names(released, tmp_path):
    """A folder in our layout (the converter's output; save_original_format=False) loads unchanged; saving a model
    loaded from it writes the released names throughout, not our names with a reshaped A_log."""
    ours = KimiHybridForCausalLM.from_pretrained(released["converted"])
    _equal_tensors(ours.state_dict(), read_all(str(released["converted"])))
    ours.save_pretrained(tmp_path / "ours", save_original_format=False)
    _equal_tensors(_saved_tensors(tmp_path / "ours"), ours.state_dict())
    reloaded = KimiHybridForCausalLM.from_pretrained(tmp_path / "ours")
    _equal_tensors(reloaded.state_dict(), ours.state_dict())
    reloaded.save_pretrained(tmp_path / "released_again")
    _equal_tensors(_saved_tensors(tmp_path / "released_again"), released["tensors"])


def test_export_of_a_saved_folder_is_the_released_checkpoint(released, tmp_path):
    """kimi-hybrid-convert export reads a folder of ours in either tensor naming and writes the released source."""
    model = KimiHybridForCausalLM.from_pretrained(released["src"])
    for name, original in (("saved", True), ("ours", False)):
        model.save_pretrained(tmp_path / name, save_original_format=original)
        convert_checkpoint(str(tmp_path / name), str(tmp_path / f"{name}-export"), progress=False)
        _equal_tensors(read_all(str(tmp_path / f"{name}-export")), released["tensors"])


def test_dense_layer_keeps_mlp_names_and_only_moe_modules_are_renamed(released, tmp_path):
    """The reverse renaming touches the MoE sub-modules only: dense layer 0 saves as mlp.gate_proj (native's mapping
    would write block_sparse_moe.gate_proj)."""
    keys = set(_saved_tensors_after_save(released, tmp_path))
    assert "model.layers.0.mlp.gate_proj.weight" in keys
    assert not any(k.startswith("model.layers.0.block_sparse_moe.") for k in keys)
    assert not any(".mlp." in k for k in keys if not k.startswith("model.layers.0."))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in keys


def _saved_tensors_after_save(released, tmp_path):
    KimiHybridForCausalLM.from_pretrained(released["src"]).save_pretrained(tmp_path / "s")
    return _saved_tensors(tmp_path / "s")


def test_released_folder_with_a_missing_tensor_is_refused(released, tmp_path):
    """Strict loading still holds through the mapping: an expert tensor missing from the released folder is an
    error, not a randomly initialised slice."""
    cfg = released["config"]
    tensors = dict(released["tensors"])
    tensors.pop("model.layers.1.self_attn.dt_bias")
    write_checkpoint(str(tmp_path / "broken"), cfg, tensors)
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.dt_bias"):
        KimiHybridForCausalLM.from_pretrained(tmp_path / "broken")


_no_weight_reads = no_weight_reads

@pytest.mark.parametrize("kind", ["k3", "quantized", "native"])
def test_unmapped_folders_are_refused_with_the_convert_command(kind, tmp_path, monkeypatch):
    """K3 (prefix, MXFP4, padded A_log), a quantized released folder and a transformers-native kimi_linear folder are
    refused before any weight is read, with the command that converts them."""
    if kind == "k3":
        cfg = tiny_k3_config()
    elif kind == "quantized":
        cfg = tiny_released_config(quantization_config={"quant_method": "fp8"})
    else:
        cfg = tiny_released_config(layer_types=["linear_attention", "linear_attention", "full_attention",
                                                "linear_attention"])
    src = tmp_path / kind
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    _no_weight_reads(monkeypatch)
    with pytest.raises(ValueError) as err:
        KimiHybridForCausalLM.from_pretrained(src)
    msg = str(err.value)
    assert f"kimi-hybrid-convert {src} {src}-kimi-hybrid" in msg and "no weight was loaded" in msg


def test_mapping_is_registered_for_the_model_type():
    """transformers finds the mapping for our (custom-code) classes: registered under model_type kimi_hybrid."""
    from transformers.conversion_mapping import USER_REGISTERED_MAPPINGS, get_model_conversion_mapping

    from presets import preset_config

    assert "kimi_hybrid" in USER_REGISTERED_MAPPINGS
    with torch.device("meta"):
        model = KimiHybridForCausalLM(preset_config("tiny-kda-first"))
    got = get_model_conversion_mapping(model, add_legacy=False)
    assert [repr(t) for t in got] == [repr(t) for t in checkpoint_conversion_mapping()]
