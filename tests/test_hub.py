"""Tests of the Hub bundle (app/hub.py): the prepared folder is complete, it loads with ``trust_remote_code=True``
in a fresh interpreter where our package cannot be imported, and ``push`` uploads every needed file (the Hub calls
are mocked: the Hub is unreachable here).

How the "fresh environment" is made (robust on a machine where ``kimi_hybrid`` is installed editable): the loader
runs in a subprocess started with ``python -I`` (isolated mode: no PYTHONPATH, no user site-packages, neither the
current directory nor the script's folder on ``sys.path``), in a temporary working directory, with a fresh
``HF_HOME`` (so transformers' remote-code module cache starts empty) and ``HF_HUB_OFFLINE=1``. Isolated mode still
processes the ``.pth`` files of site-packages, which is where an editable install puts its import hook, so the
script first puts a finder at the front of ``sys.meta_path`` that refuses every module whose top-level name is
``kimi_hybrid``, ``modeling_kimi_hybrid`` or ``app`` (what this repository provides). transformers' remote-code
modules are named ``transformers_modules.<folder>.<file>`` and are not affected. The script then asserts that the
blocked names really cannot be imported, that the loaded classes come from ``transformers_modules``, and that no
loaded module's file lies inside this repository; and it checks the logits against the ones computed here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch

from kimi_hybrid.app import hub
from kimi_hybrid import KimiHybridForCausalLM
from kimi_hybrid.tokenization_kimi_hybrid import KimiHybridTokenizer
from presets import preset_config

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "modeling_kimi_hybrid"
EMBEDDED = ROOT / "models" / "kimi-hybrid-stdlib"
HAS_WEIGHTS = (EMBEDDED / "config.json").is_file() and any(
    (EMBEDDED / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
PROMPT = "def greet(name):\n    return f'hello {name}'\n"


@pytest.fixture(scope="module")
def tokenizer():
    return KimiHybridTokenizer.from_pretrained(str(EMBEDDED))


@pytest.fixture(scope="module")
def model(tokenizer):
    cfg = preset_config(
        "tiny-mla-first", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return KimiHybridForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, model, tokenizer) -> Path:
    return hub.prepare_hub_folder(model, tokenizer, tmp_path_factory.mktemp("hub") / "bundle", repo_id="me/tiny")


def test_folder_is_complete(folder, model):
    assert hub.missing_files(folder) == []
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "kimi_hybrid"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_hybrid.KimiHybridForCausalLM"
    assert cfg["auto_map"]["AutoConfig"] == "configuration_kimi_hybrid.KimiHybridConfig"
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tcfg["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi_hybrid.KimiHybridTokenizer"
    for name in hub.BUNDLE_REQUIRED:  # byte-identical copies of this checkout's bundle
        assert (folder / name).read_bytes() == (BUNDLE / name).read_bytes(), name
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == model.config.eos_token_id
    card = (folder / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card and "trust_remote_code=True" in card
    assert f"{sum(p.numel() for p in model.parameters()):,}" in card


def test_missing_files_names_what_is_missing(folder, tmp_path):
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(folder, copy)
    (copy / "kda_kimi_hybrid.py").unlink()
    cfg = json.loads((copy / "config.json").read_text())
    del cfg["auto_map"]
    (copy / "config.json").write_text(json.dumps(cfg))
    assert set(hub.missing_files(copy)) == {"kda_kimi_hybrid.py", "config.json:auto_map.AutoConfig",
                                            "config.json:auto_map.AutoModelForCausalLM"}


FRESH_SCRIPT = textwrap.dedent(r"""
    import importlib, importlib.abc, json, os, sys
    BLOCKED = {"kimi_hybrid", "modeling_kimi_hybrid", "app"}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"blocked for the fresh-environment test: {name}")
            return None

    sys.meta_path.insert(0, Block())
    for name in BLOCKED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{name} is importable: the environment is not fresh")

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, repo_root, prompt = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3]
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    report = out.past_key_values.memory_report()
    inside = sorted(n for n, m in list(sys.modules.items())
                    if getattr(m, "__file__", None) and os.path.realpath(m.__file__).startswith(repo_root + os.sep))
    np.save(os.path.join(os.getcwd(), "logits.npy"), logits.numpy())
    print(json.dumps({
        "model_class": type(model).__module__ + "." + type(model).__name__,
        "tokenizer_class": type(tok).__module__ + "." + type(tok).__name__,
        "cache_class": type(out.past_key_values).__module__,
        "ids": ids[0].tolist(), "len_tok": len(tok), "new_tokens": out.sequences.shape[1] - ids.shape[1],
        "kda_bytes": report["kda_bytes"], "modules_from_repo": inside,
        "blocked_loaded": sorted(n for n in sys.modules if n.split(".")[0] in BLOCKED),
    }))
""")


@pytest.fixture(scope="module")
def plain_saved(tmp_path_factory, model, tokenizer) -> Path:
    """A folder written by plain ``save_pretrained`` of the package's classes (no hub helper): transformers copies
    the code of the classes registered with ``register_for_auto_class`` (model, config and tokenizer)."""
    d = tmp_path_factory.mktemp("plain") / "saved"
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("which", ["hub_folder", "plain_save_pretrained"])
def test_loads_with_trust_remote_code_in_fresh_environment(which, folder, plain_saved, model, tokenizer, tmp_path):
    folder = folder if which == "hub_folder" else plain_saved
    script = tmp_path / "fresh_load.py"
    script.write_text(FRESH_SCRIPT)
    work = tmp_path / "cwd"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run([sys.executable, "-I", str(script), str(folder), str(ROOT), PROMPT], cwd=work, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["model_class"].startswith("transformers_modules.") and res["model_class"].endswith(
        ".modeling_kimi_hybrid.KimiHybridForCausalLM"), res
    assert res["tokenizer_class"].startswith("transformers_modules."), res
    assert res["cache_class"].startswith("transformers_modules."), res
    assert res["modules_from_repo"] == [] and res["blocked_loaded"] == [], res
    ids = tokenizer(PROMPT).input_ids
    assert res["ids"] == ids and res["len_tok"] == len(tokenizer) and res["new_tokens"] == 4
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits
    import numpy as np

    got = torch.from_numpy(np.load(work / "logits.npy"))
    # same weights, same code, same CPU: the fp32 logits agree to rounding (max abs error)
    assert (got - ref).abs().max().item() < 1e-5


def test_push_uploads_everything_a_user_needs(model, tokenizer):
    from huggingface_hub import HfApi

    seen = {}

    def fake_upload(self, *, folder_path, repo_id, **kw):
        folder = Path(folder_path)
        seen["files"] = hub.describe(folder)
        seen["missing"] = hub.missing_files(folder)
        seen["config"] = json.loads((folder / "config.json").read_text())
        seen["repo_id"], seen["kw"] = repo_id, kw
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            seen["keys"] = set(f.keys())
        return mock.Mock(commit_url=f"https://huggingface.co/{repo_id}/commit/abc")

    with mock.patch.object(HfApi, "create_repo", autospec=True) as create, \
            mock.patch.object(HfApi, "upload_folder", autospec=True, side_effect=fake_upload) as upload:
        url = hub.push(model, tokenizer, "me/kimi-tiny", private=True, token="hf_dummy")
    assert url == "https://huggingface.co/me/kimi-tiny/commit/abc"
    create.assert_called_once()
    assert create.call_args.kwargs["repo_id"] == "me/kimi-tiny"
    assert create.call_args.kwargs["private"] is True and create.call_args.kwargs["exist_ok"] is True
    upload.assert_called_once()
    assert seen["repo_id"] == "me/kimi-tiny" and seen["missing"] == []
    need = {"config.json", "generation_config.json", "model.safetensors", "README.md", "tiktoken.model",
            "tokenizer_config.json", *hub.BUNDLE_REQUIRED}
    assert need <= set(seen["files"]), need - set(seen["files"])
    assert seen["config"]["auto_map"] == hub.AUTO_MAP
    # save_pretrained writes the released Kimi-Linear names (the registered checkpoint-conversion mapping): the names
    # our converter's export gives the same state dict
    from kimi_hybrid.conversion import ours_state_dict_to_released

    assert seen["keys"] == set(ours_state_dict_to_released(model.state_dict(), model.config))


@pytest.mark.skipif(not HAS_WEIGHTS, reason="the embedded model's weights are not in this checkout")
def test_embedded_model_folder():
    """The shipped folder: weights + config + tokenizer + card; weights <= 60 MB in shards of <= 16 MiB,
    vocab == len(tokenizer); no model code
    (the package holds it once; ``save_pretrained`` / ``kimi-hybrid export`` write it into folders that leave the
    repository)."""
    files = {p.name: p.stat().st_size for p in EMBEDDED.iterdir() if p.is_file()}
    for name in ("config.json", "generation_config.json", "README.md", "tiktoken.model", "tokenizer_config.json"):
        assert name in files, name
    if "model.safetensors.index.json" in files:
        shards = set(json.loads((EMBEDDED / "model.safetensors.index.json").read_text())["weight_map"].values())
        assert shards <= set(files), shards - set(files)
    else:
        assert "model.safetensors" in files
    weights = {f: n for f, n in files.items() if f.endswith(".safetensors")}
    assert sum(weights.values()) <= 60e6 and max(weights.values()) <= 16 * 2**20, weights
    assert not [f for f in files if f.endswith(".py")], sorted(files)
    cfg = json.loads((EMBEDDED / "config.json").read_text())
    assert "auto_map" not in cfg and "auto_map" not in json.loads((EMBEDDED / "tokenizer_config.json").read_text())
    tok = KimiHybridTokenizer.from_pretrained(str(EMBEDDED))
    assert cfg["vocab_size"] == len(tok)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert cfg["layer_types"].count("linear_attention") == 3 * cfg["layer_types"].count("full_attention")


# ---------------------------------------------------------------------------------------------------------------
# writing over a folder, file modes, the card of an exported source folder
# ---------------------------------------------------------------------------------------------------------------

def test_rewrite_leaves_no_stale_weights_and_plain_file_modes(model, tokenizer, tmp_path):
    """A sharded export written over by a single-file one: the old shards and index are gone (transformers would
    read the index and ignore the new model.safetensors); every written file has the mode of a new plain file."""
    out = tmp_path / "bundle"
    hub.prepare_hub_folder(model, tokenizer, out, max_shard_size="1MB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) >= 2
    old = os.umask(0o022)
    try:
        hub.prepare_hub_folder(model, tokenizer, out)  # default 2GB shards: one file
    finally:
        os.umask(old)
    assert not (out / "model.safetensors.index.json").exists() and not list(out.glob("model-*.safetensors"))
    assert (out / "model.safetensors").is_file() and hub.missing_files(out) == []
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert set(modes.values()) == {0o644}, modes


def test_export_card_is_true_for_the_exported_folder(model, tokenizer, tmp_path):
    """A source folder's card that says the code is elsewhere, gives 4 shards, loads from the source path and
    names side files: in the export it says the code ships in the folder, gives the layout written, loads the
    folder with trust_remote_code=True, and the side files are copied."""
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="1MB")
    tokenizer.save_pretrained(src)
    (src / "train_metrics.json").write_text('{"loss": 1.0}\n')
    (src / "samples.txt").write_text("def f(): pass\n")
    (src / "README.md").write_text(textwrap.dedent("""\
        # tiny

        Loading it needs the `kimi_hybrid` package (the code is not in this folder) and `tiktoken` (the tokenizer).

        | weights | bfloat16 safetensors in 4 shards of at most 15MB (fp32 biases) |

        ## Usage

        ```python
        import kimi_hybrid
        tok = AutoTokenizer.from_pretrained("models/src")
        ```

        ## Files

        `train_metrics.json` (the record), `samples.txt`, `missing.json`.
        """))
    loaded = KimiHybridForCausalLM.from_pretrained(str(src))
    out = hub.prepare_hub_folder(loaded, tokenizer, tmp_path / "out", repo_id="me/tiny")
    card = (out / "README.md").read_text()
    assert "the code is not in this folder" not in card and "models/src" not in card
    assert "import kimi_hybrid" not in card and "4 shards" not in card
    size = (out / "model.safetensors").stat().st_size
    assert f"| weights | float32 safetensors in one file `model.safetensors` of {size / 1e6:.1f} MB (fp32 biases) |" \
        in card
    assert 'AutoTokenizer.from_pretrained("me/tiny", trust_remote_code=True)' in card
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny", trust_remote_code=True)' in card
    assert "## Files" in card  # the sections after Usage are kept
    assert (out / "train_metrics.json").read_text() == '{"loss": 1.0}\n'
    assert (out / "samples.txt").read_text() == "def f(): pass\n"
    assert not (out / "missing.json").exists()
