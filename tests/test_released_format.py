"""The released format has one source of truth: a folder the registered checkpoint-conversion mapping cannot read
(here a transformers-native one; K3 and quantized ones in test_conversion_mapping.py) is refused before any weight is
read, and the converters' tensor plan is the model's own state_dict (read on the meta device)."""

from __future__ import annotations

import json

import pytest
import torch
from conversion_fixtures import released_tensors, tiny_released_config, write_checkpoint
from decoding_helpers import no_weight_reads
from presets import preset_config

from kimi_hybrid import KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid.conversion import config_io
from kimi_hybrid.conversion.layouts import plan_for

TINY = ["tiny-kda-first", "tiny-mla-first", "tiny-k3", "tiny-k3-softplus", "tiny-k3-block4"]
FP32_SUFFIXES = (".self_attn.A_log", ".self_attn.dt_bias", ".gate.e_score_correction_bias")


_no_weight_reads = no_weight_reads

def test_from_pretrained_refuses_a_native_folder_before_reading_weights(tmp_path, monkeypatch):
    cfg = tiny_released_config(layer_types=["linear_attention", "linear_attention", "full_attention",
                                            "linear_attention"])
    src = tmp_path / "native"
    write_checkpoint(str(src), cfg, released_tensors(cfg))
    # the same patch stops the load of one of our folders at its first weight read: it does intercept the reads
    ours = tmp_path / "ours"
    KimiHybridForCausalLM(preset_config("tiny-kda-first")).save_pretrained(ours)
    _no_weight_reads(monkeypatch)
    with pytest.raises(AssertionError, match="a weight file was opened"):
        KimiHybridForCausalLM.from_pretrained(ours)
    with pytest.raises(ValueError) as err:
        KimiHybridForCausalLM.from_pretrained(src)
    msg = str(err.value)
    assert f"kimi-hybrid-convert {src} {src}-kimi-hybrid" in msg
    assert "'kimi_linear'" in msg and "no weight was loaded" in msg


def test_from_pretrained_refuses_a_k3_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": {}}))
    with pytest.raises(ValueError, match=r"(?s)'kimi_k3' checkpoint .* kimi-hybrid-convert /"):
        KimiHybridForCausalLM.from_pretrained(tmp_path)


def _model_tensors(cfg: KimiHybridConfig) -> dict:
    with torch.device("meta"):
        model = KimiHybridForCausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset", TINY + ["kimi-linear-48b-a3b"])
def test_tensor_plan_is_the_meta_models_state_dict(preset):
    """The plan the converter writes (read from the config as the converter reads it) has exactly the tensors of
    the model built from the preset: names, shapes, and fp32 for the parameters kept in fp32."""
    cfg = preset_config(preset)
    src_format = "k3" if cfg.is_k3 else "released"
    ours = config_io.to_ours(cfg.to_dict(), "ours")
    plan = plan_for(ours, src_format, variant="plain" if src_format == "k3" else "")
    want = _model_tensors(cfg)
    assert {k: d.shape for k, d in plan.dests.items()} == want
    assert {k for k, d in plan.dests.items() if d.dtype_rule == "fp32"} == {
        k for k in want if k.endswith(FP32_SUFFIXES)}
    if preset == "kimi-linear-48b-a3b":
        assert sum(torch.Size(s).numel() for s in want.values()) == 49_122_681_728
        assert len(plan.sources) == 20_493
