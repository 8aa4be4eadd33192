"""Fast CPU tests of the default-model pipeline: the corpus builder (examples/build_python_corpus.py), the parallel
tokenizer (examples/tokenize_corpus.py), the training helpers (examples/train_default_model.py) and the arms of
examples/ablation_ratio.py. No training run: that is a GPU job.

The example scripts are imported as top-level modules (pyproject puts examples/ on pytest's pythonpath); they import
the installed ``kimi_hybrid``."""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import subprocess
import sys
from email.message import Message
from pathlib import Path

import numpy as np
import pytest
import torch

from presets import preset_config

# examples/ is on the test path (pyproject's pytest pythonpath)
import build_python_corpus as bpc
import tokenize_corpus as tkc
import train_default_model as tdm

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "kimi-hybrid-stdlib"


@pytest.fixture(scope="module")
def tokenizer():
    return tdm.KimiHybridTokenizer.from_pretrained(str(SHIPPED))


# ---------------------------------------------------------------------------------------------------------------
# model shape
# ---------------------------------------------------------------------------------------------------------------

def test_stdlib_config_matches_tokenizer(tokenizer):
    cfg = tdm.stdlib_config(tokenizer)
    assert cfg.vocab_size == len(tokenizer) == 8448
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert cfg.layer_types == [tdm.KDA, tdm.KDA, tdm.KDA, tdm.MLA] * 2
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 7
    with torch.device("meta"):
        n = sum(p.numel() for p in tdm.KimiHybridForCausalLM(cfg).parameters())
    assert 10e6 <= n <= 30e6 and n * 2 < 30e6  # the ablation's shape: bf16 under 30 MB


def test_default_config_keeps_every_path_and_fits_60_mb(tokenizer):
    cfg = tdm.default_config(tokenizer)
    assert cfg.layer_types == [tdm.KDA, tdm.KDA, tdm.KDA, tdm.MLA] * 2  # 3:1 KDA:MLA
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 7  # layer 0 dense, the others MoE
    assert cfg.num_experts == 8 and cfg.num_experts_per_token == 2 and cfg.num_shared_experts == 1
    with torch.device("meta"):
        model = tdm.KimiHybridForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    n_fp32 = sum(p.numel() for name, p in model.named_parameters() if any(k in name for k in tdm.FP32_PARAMS))
    assert 2 * (n - n_fp32) + 4 * n_fp32 <= 60e6  # shipped bf16 (+ the fp32 keep-list) within 60 MB
    assert n == 27_597_788  # the shape the model card reports


# ---------------------------------------------------------------------------------------------------------------
# corpus builder: licences
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expr, ok", [
    ("MIT", True), ("BSD-3-Clause", True), ("Apache-2.0 WITH LLVM-exception", True), ("mit", True),
    ("BSD-3-Clause AND 0BSD AND MIT AND Zlib AND CC0-1.0", True), ("MPL-2.0 AND MIT", False),
    ("MIT OR GPL-3.0-only", True), ("GPL-3.0-only", False), ("(MIT OR GPL-2.0) AND LGPL-3.0", False),
    ("(MIT OR GPL-2.0) AND (Apache-2.0 OR LGPL-3.0)", True), ("LicenseRef-NVIDIA-Proprietary", False),
])
def test_spdx_expressions(expr, ok):
    assert bpc.spdx_is_permissive(expr) is ok


@pytest.mark.parametrize("bad", ["MIT AND", "(MIT", "MIT)", "AND MIT"])
def test_spdx_expression_errors(bad):
    with pytest.raises(ValueError, match="licence expression"):
        bpc.spdx_is_permissive(bad)


@pytest.mark.parametrize("text, want", [
    ("Apache 2.0 License", "Apache-2.0"), ("BSD License", "BSD"), ("new BSD", "BSD-3-Clause"), ("MIT", "MIT"),
    ("PSF", "PSF-2.0"), ("UNKNOWN", None), ("", None), ("GNU General Public License v3", None),
    ("Copyright (c) 2020 X\n\nPermission is hereby granted, free of charge, to any person obtaining", "MIT"),
    ("Copyright (c) 2008 Y\nAll rights reserved.\n\nRedistribution and use in source and binary forms, with",
     "BSD"),
])
def test_licence_field_text(text, want):
    assert bpc.licence_from_text(text) == want


def _meta(**fields) -> Message:
    m = Message()
    for key, value in fields.items():
        for v in value if isinstance(value, list) else [value]:
            m[key.replace("_", "-")] = v
    return m


def test_licence_sources_in_priority_order():
    # License-Expression wins over classifiers and the License field
    got = bpc.distribution_licence(_meta(License_Expression="MPL-2.0", License="MIT",
                                         Classifier="License :: OSI Approved :: MIT License"))
    assert got[:2] == (None, "License-Expression")
    # classifiers: every one must be permissive; the bare approval classifiers say nothing
    got = bpc.distribution_licence(_meta(Classifier=["License :: OSI Approved", "License :: DFSG approved",
                                                     "License :: OSI Approved :: MIT License"], License="GPL"))
    assert got[:2] == ("MIT", "classifier")
    got = bpc.distribution_licence(_meta(Classifier=["License :: OSI Approved :: MIT License",
                                                     "License :: OSI Approved :: GNU General Public License (GPL)"]))
    assert got[0] is None
    # neither: the free-text field
    assert bpc.distribution_licence(_meta(License="BSD-3-Clause"))[:2] == ("BSD-3-Clause", "License")
    assert bpc.distribution_licence(_meta())[0] is None


# ---------------------------------------------------------------------------------------------------------------
# corpus builder + tokenizer on a synthetic environment
# ---------------------------------------------------------------------------------------------------------------

def _dist(site: Path, name: str, version: str, files: dict, **meta) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}"]
    for key, value in meta.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"{key.replace('_', '-')}: {v}")
    (info / "METADATA").write_text("\n".join(lines) + "\n\n")
    record = []
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
        record.append(f"{rel},,")
    record.append(f"{info.name}/METADATA,,")
    (info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture()
def fake_env(tmp_path):
    site, std = tmp_path / "site-packages", tmp_path / "stdlib"
    shared = "def shared():\n    return 1\n"
    _dist(site, "alpha", "1.0", {"alpha/__init__.py": "A = 1\n", "alpha/core.py": "def f(x):\n    return x\n",
                                 "alpha/tests/test_core.py": "def test(): pass\n",
                                 "alpha/_vendor/six.py": "# vendored\n", "alpha/data.json": "{}",
                                 "alpha/big.py": "x = 1\n" * 100, "alpha/latin.py": b"s = '\xe9'\n",
                                 "alpha/copy.py": shared},
          License_Expression="MIT")
    _dist(site, "Beta_Pkg", "2.0", {"beta_pkg/__init__.py": "B = 2\n", "beta_pkg/copy.py": shared},
          Classifier="License :: OSI Approved :: BSD License")
    _dist(site, "gamma", "3.0", {"gamma/__init__.py": "G = 3\n"}, License="GPL-3.0-or-later")
    for rel, text in {"os.py": "import sys\n", "json/__init__.py": "J = 1\n", "json/decoder.py": "D = 1\n",
                      "test/test_os.py": "T = 1\n", "site-packages/x.py": "X = 1\n"}.items():
        (std / rel).parent.mkdir(parents=True, exist_ok=True)
        (std / rel).write_text(text)
    return tmp_path, site, std


def test_build_manifest_split_licences_dedup(fake_env):
    tmp, site, std = fake_env
    m = bpc.build(tmp / "out", [site], std, ["beta-pkg", "missing-one"], ["json"], max_file_bytes=500,
                  log=lambda *_: None)
    with gzip.open(tmp / "out" / "python_corpus_manifest.json.gz", "rt") as fh:
        assert json.load(fh) == m
    by = {(p["name"], p["split"]): p for p in m["packages"]}
    assert set(by) == {("python-stdlib", "train"), ("python-stdlib", "heldout_stdlib"), ("alpha", "train"),
                       ("beta-pkg", "heldout_packages")}
    alpha = by[("alpha", "train")]
    assert (alpha["version"], alpha["licence"], alpha["licence_source"]) == ("1.0", "MIT", "License-Expression")
    # tests, vendored code, non-.py, too large and non-UTF-8 files are left out
    assert [f[0] for f in alpha["files"]] == ["alpha/__init__.py", "alpha/copy.py", "alpha/core.py"]
    data = (site / "alpha/core.py").read_bytes()
    assert alpha["files"][2] == ["alpha/core.py", hashlib.sha256(data).hexdigest(), len(data)]
    # the held-out copy of a train file is dropped from the held-out split
    assert [f[0] for f in by[("beta-pkg", "heldout_packages")]["files"]] == ["beta_pkg/__init__.py"]
    assert [f[0] for f in by[("python-stdlib", "train")]["files"]] == ["os.py"]
    assert [f[0] for f in by[("python-stdlib", "heldout_stdlib")]["files"]] == ["json/__init__.py",
                                                                                 "json/decoder.py"]
    assert m["skipped"] == {"duplicates": 1, "too_large": 1, "not_utf8": 1, "missing": 0}
    assert [e["name"] for e in m["excluded_distributions"]] == ["gamma"]
    assert m["heldout_packages_missing"] == ["missing-one"]
    assert m["splits"]["heldout_packages"]["packages"] == ["beta-pkg"]
    assert m["splits"]["train"]["num_files"] == 4 and m["splits"]["heldout_stdlib"]["num_files"] == 2


def test_build_refuses_a_missing_site_dir(tmp_path, capsys):
    assert bpc.main(["--out", str(tmp_path / "o"), "--site-packages", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_tokenize_from_manifest(fake_env, tokenizer):
    tmp, site, std = fake_env
    manifest = bpc.build(tmp / "out", [site], std, ["beta-pkg"], ["json"], log=lambda *_: None)
    # the command line, with worker processes
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tokenize_corpus.py"), "--manifest",
                           str(tmp / "out" / "python_corpus_manifest.json.gz"), "--tokenizer", str(SHIPPED),
                           "--out", str(tmp / "ids"), "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp / "ids" / "tokenized_meta.json").read_text())
    eos = tokenizer.eos_token_id
    for split in ("train", "heldout_packages", "heldout_stdlib"):
        want = []
        for p in manifest["packages"]:
            if p["split"] == split:
                for rel, _h, _n in p["files"]:
                    want += tokenizer.encode_ids((Path(p["root"]) / rel).read_text(), allow_special=False) + [eos]
        got = np.load(tmp / "ids" / f"{split}_ids.npy")
        assert got.dtype == np.uint16 and got.tolist() == want
        assert meta["splits"][split]["num_ids_with_eos"] == len(want)
    same = tkc.tokenize(manifest, tokenizer, tmp / "ids1", workers=1, log=lambda *_: None)
    assert np.array_equal(np.load(tmp / "ids1" / "train_ids.npy"), np.load(tmp / "ids" / "train_ids.npy"))
    assert same["splits"]["train"]["tokens_per_package"] == meta["splits"]["train"]["tokens_per_package"]
    (site / "alpha/core.py").write_text("changed\n")
    with pytest.raises(ValueError, match="alpha/core.py: sha256 differs"):
        tkc.tokenize(manifest, tokenizer, tmp / "ids2", workers=1, log=lambda *_: None)


# ---------------------------------------------------------------------------------------------------------------
# training helpers
# ---------------------------------------------------------------------------------------------------------------

def test_lr_schedule():
    peak, warm, total = 1e-3, 10, 110
    assert tdm.lr_at(0, total, peak, warm, 0.1) == pytest.approx(peak / warm)
    assert tdm.lr_at(warm - 1, total, peak, warm, 0.1) == pytest.approx(peak)
    assert tdm.lr_at(warm, total, peak, warm, 0.1) == pytest.approx(peak)
    assert tdm.lr_at(60, total, peak, warm, 0.1) == pytest.approx(peak * (0.1 + 0.9 * 0.5))
    assert tdm.lr_at(total, total, peak, warm, 0.1) == pytest.approx(0.1 * peak)


def test_batches_are_seeded_and_windows_cover_the_split():
    ids = torch.arange(10_000)
    a = tdm.sample_batch(ids, 64, 4, torch.Generator().manual_seed(1))
    b = tdm.sample_batch(ids, 64, 4, torch.Generator().manual_seed(1))
    assert a.shape == (4, 65) and torch.equal(a, b)
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 64, dtype=a.dtype))  # contiguous windows
    w = tdm.eval_windows(ids, 1000)
    assert w.shape == (10, 1000) and torch.equal(w.reshape(-1), ids)
    capped = tdm.eval_windows(ids, 1000, max_windows=3)  # evenly spaced: windows 0, round(4.5) = 4, 9
    assert capped.shape == (3, 1000) and capped[:, 0].tolist() == [0, 4000, 9000]


def test_bias_balancer_moves_towards_equal_load(tokenizer):
    cfg = preset_config("tiny-kda-first")
    torch.manual_seed(0)
    model = tdm.KimiHybridForCausalLM(cfg).train()
    bal = tdm.BiasBalancer(model, rate=0.5)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (2, 16)), use_cache=False)
    counts = [c.clone() for c in bal.counts]
    ratio = bal.update()
    assert ratio >= 1.0
    for router, c in zip(bal.routers, counts):
        want = 0.5 * torch.sign(c.mean() - c)
        assert torch.equal(router.e_score_correction_bias.data, want)
    bal.remove()


def test_evaluate_matches_model_loss_and_counts_bytes(tokenizer):
    cfg = preset_config("tiny-mla-first")
    torch.manual_seed(0)
    model = tdm.KimiHybridForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3 * 32,))
    byte_lengths = torch.randint(0, 5, (cfg.vocab_size,))
    ev = tdm.evaluate(model, ids, 32, 2, torch.device("cpu"), None, byte_lengths=byte_lengths)
    with torch.no_grad():
        ref = model(input_ids=ids.view(3, 32), labels=ids.view(3, 32)).loss
    assert ev["tokens"] == 3 * 31 and ev["loss"] == pytest.approx(float(ref), rel=1e-5)
    assert ev["ppl"] == pytest.approx(math.exp(ev["loss"]))
    n_bytes = int(byte_lengths[ids.view(3, 32)[:, 1:]].sum())
    assert ev["bytes"] == n_bytes
    assert ev["bits_per_byte"] == pytest.approx(float(ref) * 93 / math.log(2) / n_bytes, rel=1e-5)


def test_token_byte_lengths(tokenizer):
    lengths = tdm.token_byte_lengths(tokenizer)
    assert lengths.shape == (8448,) and int(lengths[8192:].sum()) == 0  # specials: no bytes
    text = "def read_config(path):\n    return json.load(open(path))  # é\n"
    assert int(lengths[tokenizer.encode_ids(text)].sum()) == len(text.encode("utf-8"))


def test_distinct_ngram_ratio():
    assert tdm.distinct_ngram_ratio([1, 2, 3, 4, 5]) == 1.0
    assert tdm.distinct_ngram_ratio([1, 2, 3, 4] * 3) == pytest.approx(4 / 9)
    assert math.isnan(tdm.distinct_ngram_ratio([1, 2, 3]))


def test_train_step_error_is_recorded_not_raised():
    cfg = preset_config("tiny-mla-first")
    model = tdm.KimiHybridForCausalLM(cfg)
    logs = []
    summary = tdm.train(model, torch.arange(10), context=32, batch_size=2, steps=3, time_budget=1.0, lr=1e-3,
                        warmup=1, min_lr_ratio=0.1, weight_decay=0.0, seed=0, device=torch.device("cpu"),
                        amp_dtype=None, log=logs.append)
    assert summary["steps"] == 0 and summary["error"].startswith("step 1: RuntimeError")
    assert any("training stopped by an error" in line for line in logs)


def test_saved_folder_is_sharded_code_free_and_keeps_fp32_params(tmp_path, tokenizer):
    cfg = tdm.default_config(tokenizer, tiny=True)
    torch.manual_seed(0)
    model = tdm.KimiHybridForCausalLM(cfg)
    tdm.cast_for_shipping(model, torch.bfloat16)
    names = tdm.save_model_folder(model, tokenizer, tmp_path, max_shard_size="1500KB")
    # (the largest tensor, the 1.08 MB embedding, fits one shard; the header adds a few KB)
    assert len(names) >= 2 and all((tmp_path / n).stat().st_size <= 1_500_000 + 20_000 for n in names)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not list(tmp_path.glob("*.py")) and "auto_map" not in json.loads((tmp_path / "config.json").read_text())
    assert (tmp_path / "tiktoken.model").is_file()
    back = tdm.KimiHybridForCausalLM.from_pretrained(str(tmp_path))
    for (name, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
        want = torch.float32 if any(k in name for k in tdm.FP32_PARAMS) else torch.bfloat16
        assert p.dtype == q.dtype == want and torch.equal(p, q), name


def test_ablation_arms_have_equal_budget(tokenizer):
    import ablation_ratio as abl
    arms = abl.arms(tokenizer)
    h, m = arms["hybrid_3to1"], arms["all_mla"]
    assert h.layer_types.count(tdm.MLA) == 2 and m.layer_types.count(tdm.MLA) == 8
    nh, nm = abl._n_params(h), abl._n_params(m)
    assert abs(nh - nm) / nh < 0.01
