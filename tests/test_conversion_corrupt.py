"""Corrupt or mismatching inputs fail with a clear error and leave no output folder (nor a temporary one)."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from conversion_fixtures import released_tensors, tiny_released_config, write_checkpoint

from kimi_hybrid.conversion.binding import CheckpointError
from kimi_hybrid.conversion.convert import ConversionError, convert_checkpoint


def _ckpt(tmp_path, mutate=None, shards=2):
    cfg = tiny_released_config()
    t = released_tensors(cfg, seed=7)
    if mutate:
        mutate(t)
    names = write_checkpoint(str(tmp_path / "src"), cfg, t, shards)
    return cfg, t, names


def _assert_nothing_written(tmp_path):
    assert sorted(os.listdir(tmp_path)) == ["src"], os.listdir(tmp_path)


def _convert(tmp_path):
    return convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"), progress=False)


def test_truncated_shard(tmp_path):
    _, _, names = _ckpt(tmp_path)
    p = tmp_path / "src" / names[1]
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 100])
    with pytest.raises(ConversionError, match=r"truncated safetensors file.*" + names[1].replace(".", r"\.")
                       + "|" + names[1].replace(".", r"\.") + r".*truncated"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)


def test_truncated_header(tmp_path):
    _, _, names = _ckpt(tmp_path)
    p = tmp_path / "src" / names[0]
    p.write_bytes(p.read_bytes()[:50])
    with pytest.raises(ConversionError, match="truncated"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)


def test_wrong_shape_names_key_expected_and_got(tmp_path):
    def mutate(t):
        t["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(32, 7, dtype=torch.bfloat16)

    _ckpt(tmp_path, mutate)
    with pytest.raises(CheckpointError) as ei:
        _convert(tmp_path)
    msg = str(ei.value)
    assert "wrong shapes (1)" in msg
    assert "model.layers.2.self_attn.kv_b_proj.weight: expected [32, 8], got [32, 7]" in msg
    _assert_nothing_written(tmp_path)


def test_missing_index_entry(tmp_path):
    _ckpt(tmp_path)
    idx = tmp_path / "src" / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    del j["weight_map"]["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    idx.write_text(json.dumps(j))
    with pytest.raises(ConversionError, match=r"missing from the index \(1\):\n  model\.layers\.1\.block_sparse_moe"
                                              r"\.experts\.3\.w2\.weight"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)


def test_index_names_a_missing_shard_file(tmp_path):
    _, _, names = _ckpt(tmp_path)
    os.remove(tmp_path / "src" / names[1])
    with pytest.raises(ConversionError, match="shard files listed in the index are missing"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)


def test_unknown_and_missing_keys_are_all_listed(tmp_path):
    def mutate(t):
        t["model.layers.0.self_attn.mystery.weight"] = torch.zeros(3, dtype=torch.bfloat16)
        t["model.extra_head.weight"] = torch.zeros(3, dtype=torch.bfloat16)
        del t["model.layers.3.block_sparse_moe.experts.2.w3.weight"]
        del t["model.layers.0.self_attn.o_norm.weight"]

    _ckpt(tmp_path, mutate)
    with pytest.raises(CheckpointError) as ei:
        _convert(tmp_path)
    msg = str(ei.value)
    assert "unknown keys" in msg and "(2)" in msg
    assert "model.layers.0.self_attn.mystery.weight" in msg and "model.extra_head.weight" in msg
    assert "missing keys (required by the config) (2)" in msg
    assert "model.layers.3.block_sparse_moe.experts.2.w3.weight" in msg and "model.layers.0.self_attn.o_norm.weight" in msg
    _assert_nothing_written(tmp_path)


def test_wrong_dtype_of_fused_experts(tmp_path):
    def mutate(t):
        t["model.layers.2.block_sparse_moe.experts.1.w1.weight"] = t["model.layers.2.block_sparse_moe.experts.1.w1.weight"].float()

    _ckpt(tmp_path, mutate)
    with pytest.raises(CheckpointError, match="cannot fuse tensors of different dtypes"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)


def test_corrupt_json_header(tmp_path):
    _ckpt(tmp_path, shards=1)
    p = tmp_path / "src" / "model-00001-of-00001.safetensors"
    b = bytearray(p.read_bytes())
    b[8] = ord("X")  # first byte of the JSON header
    p.write_bytes(bytes(b))
    with pytest.raises(ConversionError, match="not valid JSON"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)


def test_existing_output_is_refused_and_kept(tmp_path):
    _ckpt(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="exists and is not empty"):
        _convert(tmp_path)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"), progress=False, overwrite=True)
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "conversion_report.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_failure_in_the_middle_removes_the_temporary_folder(tmp_path, monkeypatch):
    _ckpt(tmp_path)
    import kimi_hybrid.conversion.convert as cv

    calls = {"n": 0}
    real = cv.read_bytes

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 40:
            raise OSError("disk on fire")
        return real(*a, **k)

    monkeypatch.setattr(cv, "read_bytes", flaky)
    with pytest.raises(OSError, match="disk on fire"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)


def test_tensor_in_two_shards(tmp_path):
    _, t, names = _ckpt(tmp_path)
    # rewrite shard 2 with an extra copy of a tensor that lives in shard 1
    from safetensors import safe_open

    p = str(tmp_path / "src" / names[1])
    with safe_open(p, "pt") as f:
        d = {k: f.get_tensor(k) for k in f.keys()}
    d["model.embed_tokens.weight"] = t["model.embed_tokens.weight"]
    save_file(d, p, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="stored in both"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)


# ------------------------------------------------------------------------------------------------------------------
# argument and folder mistakes (found by a new-user trial): refused up front, the source untouched
# ------------------------------------------------------------------------------------------------------------------

def test_output_folder_containing_the_source_is_refused_even_with_overwrite(tmp_path):
    from kimi_hybrid.conversion.__main__ import main

    _ckpt(tmp_path)
    before = sorted(os.listdir(tmp_path / "src"))
    assert main([str(tmp_path / "src"), str(tmp_path), "--overwrite", "--no-progress"]) == 2
    assert sorted(os.listdir(tmp_path / "src")) == before  # the source survived
    with pytest.raises(ConversionError, match="contains the source folder"):
        convert_checkpoint(str(tmp_path / "src"), str(tmp_path), overwrite=True, progress=False)


@pytest.mark.parametrize("argv,msg", [
    (["--max-shard-size", "abc"], "cannot read the size 'abc'"),
    (["--max-shard-size", "0"], "must be positive"),
    (["--chunk-mb", "0"], "--chunk-mb >= 1"),
])
def test_bad_cli_values_are_refused_before_reading(tmp_path, capsys, argv, msg):
    from kimi_hybrid.conversion.__main__ import main

    _ckpt(tmp_path)
    assert main([str(tmp_path / "src"), str(tmp_path / "out"), "--no-progress", *argv]) == 2
    assert msg in capsys.readouterr().err
    _assert_nothing_written(tmp_path)


def test_config_problems_are_refused_before_any_tensor_is_written(tmp_path, capsys):
    from kimi_hybrid.conversion.__main__ import main

    _ckpt(tmp_path)
    cfg_path = tmp_path / "src" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text("{")
    assert main([str(tmp_path / "src"), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "config.json is not valid JSON" in capsys.readouterr().err
    # a config the model itself rejects (MLA shares one latent: kv heads must equal heads)
    cfg_path.write_text(json.dumps(dict(cfg, num_key_value_heads=cfg["num_attention_heads"] // 2)))
    with pytest.raises(ConversionError, match="the model rejects this config.*num_key_value_heads"):
        _convert(tmp_path)
    _assert_nothing_written(tmp_path)
    assert main([str(tmp_path / "missing"), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["inventory", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'; the shipped presets are: kimi-linear-48b-a3b" in capsys.readouterr().err


def test_stale_temporaries_removed_and_unlisted_shards_reported(tmp_path, capsys):
    """A killed conversion's `<out>.tmp-<pid>` (process gone) is removed by the next run; a .safetensors file that is
    not part of the checkpoint is named in a warning (its tensors are not converted)."""
    _ckpt(tmp_path)
    save_file({"stray": torch.zeros(2)}, str(tmp_path / "src" / "leftover.safetensors"))
    dead = 2 ** 22 + 12345  # above the default pid_max: no such process
    (tmp_path / f"out.tmp-{dead}").mkdir()
    (tmp_path / f"out.tmp-{dead}" / "model-00001.safetensors").write_bytes(b"partial")
    _convert(tmp_path)
    err = capsys.readouterr().err
    assert not (tmp_path / f"out.tmp-{dead}").exists()
    assert f"process {dead} is gone" in err
    assert "leftover.safetensors" in err and "ignored" in err
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_nonfinite_source_values_are_reported(tmp_path, capsys):
    """NaN / inf in the source are copied faithfully but never silently: a warning names the tensors and the report
    counts them (streamed and buffered sources alike)."""
    def mutate(t):
        t["model.embed_tokens.weight"][0, :3] = float("nan")
        t["model.layers.0.self_attn.A_log"].view(-1)[0] = float("inf")

    _ckpt(tmp_path, mutate)
    rep = _convert(tmp_path)
    assert rep["nonfinite_values"] == {"model.embed_tokens.weight": 3, "model.layers.0.self_attn.A_log": 1}
    err = capsys.readouterr().err
    assert "hold NaN / inf values" in err and "model.embed_tokens.weight (3)" in err
    clean = tmp_path / "clean"
    clean.mkdir()
    _, _, _ = _ckpt(clean)
    assert convert_checkpoint(str(clean / "src"), str(clean / "out"), progress=False)["nonfinite_values"] == {}
