"""``kimi-hybrid-convert export`` (our layout -> the released Kimi-Linear layout) writes a folder that the consumers
of that layout load as it is: transformers' native ``KimiLinearForCausalLM`` through ``AutoModelForCausalLM``, with
and without ``trust_remote_code`` (no ``auto_map`` naming remote code the folder does not ship). fp32 on CPU;
logits max |native - ours| <= 1e-4 (two implementations of the same math)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kimi_hybrid import KimiHybridForCausalLM
from kimi_hybrid.conversion.convert import convert_checkpoint
from presets import preset_config


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(preset_config("tiny-kda-first")).eval()
    root = tmp_path_factory.mktemp("released-export")
    model.save_pretrained(root / "ours")
    convert_checkpoint(str(root / "ours"), str(root / "released"), src_format="ours", dst_format="released",
                       progress=False)
    return model, root / "released"


def test_export_config_names_no_code_it_does_not_ship(exported):
    _, folder = exported
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "kimi_linear" and "auto_map" not in cfg


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_native_class_loads_the_export_as_it_is(exported, trust_remote_code):
    ours, folder = exported
    native = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=trust_remote_code,
                                                  dtype=torch.float32).eval()
    assert type(native).__module__.startswith("transformers.models.kimi_linear")
    ids = torch.tensor([[3, 17, 5, 60, 7, 99, 12]])
    with torch.no_grad():
        assert (native(ids).logits - ours(ids).logits).abs().max().item() <= 1e-4
