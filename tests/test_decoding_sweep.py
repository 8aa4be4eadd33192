"""``examples/decoding_sweep.py`` measures each setting as it is named, whatever the model folder's
``generation_config.json`` sets (the embedded one sets a repetition penalty and an 8-gram block): its "greedy" is
plain greedy decoding. Token ids compared exactly (CPU, fp32)."""

import torch
from transformers import GenerationConfig

import decoding_sweep
from kimi_hybrid import KimiHybridForCausalLM
from presets import preset_config


def test_greedy_setting_overrides_the_folders_decoding_defaults():
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(preset_config("tiny-kda-first")).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False, pad_token_id=0)
    model.generation_config = GenerationConfig(repetition_penalty=3.0, no_repeat_ngram_size=2, pad_token_id=0)
    biased = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                            do_sample=False, pad_token_id=0)
    assert not torch.equal(plain, biased)  # the folder's settings change greedy output here
    swept = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                           pad_token_id=0, **decoding_sweep.decoding_kwargs("greedy"))
    assert torch.equal(swept, plain)


def test_explicit_lengths_win_over_the_folders_generation_config():
    """The embedded folder sets no length: a user's ``max_length`` and ``max_new_tokens`` both hold, without
    transformers' "Both ... seem to have been set" warning (a folder's ``max_new_tokens`` overrode a user's
    ``max_length``; a folder's ``max_length`` makes every ``max_new_tokens`` call warn)."""
    from pathlib import Path

    import pytest
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    folder = Path(__file__).resolve().parents[1] / "models" / "kimi-hybrid-stdlib"
    if not any((folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        pytest.skip("the embedded model's weights are not in this checkout")
    model = KimiHybridForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([[8192, 400, 401, 402]])
    with CaptureLogger(logging.get_logger("transformers.generation.utils")) as cl:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_length=ids.shape[1] + 2)
        assert out.shape[1] == ids.shape[1] + 2
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3)
        assert out.shape[1] == ids.shape[1] + 3
    assert "seem to have been set" not in cl.out, cl.out
