"""The tokenizer of an exported folder loads with ``trust_remote_code=True`` where kimi-hybrid is not installed.

Two exports carry our tokenizer: ``kimi-hybrid export`` (a Hub folder in our layout, tested in test_hub.py) and
``kimi-hybrid-convert export`` (the released Kimi-Linear layout, for vLLM / SGLang). The second copies the source
folder's ``tokenizer_config.json``, whose ``auto_map`` names ``tokenization_kimi_hybrid.KimiHybridTokenizer``; the
code file has to come with it. The loader runs in ``python -I`` with a meta-path finder that refuses ``kimi_hybrid``
(as in test_hub.py), a fresh ``HF_HOME`` and ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kimi_hybrid import KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid.app import hub
from kimi_hybrid.conversion.convert import convert_checkpoint
from kimi_hybrid.tokenization_kimi_hybrid import KimiHybridTokenizer
from presets import preset_config

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "models" / "kimi-hybrid-stdlib"
TEXT = "def read_config(path):\n    with open(path) as f:\n        return f.read()  # 路径\n"

LOAD_TOKENIZER = textwrap.dedent(r"""
    import importlib, importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("kimi_hybrid", "modeling_kimi_hybrid", "app"):
                raise ModuleNotFoundError(f"blocked for the fresh-environment test: {name}")
            return None

    sys.meta_path.insert(0, Block())
    try:
        import kimi_hybrid  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("kimi_hybrid is importable: the environment is not fresh")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
    print(json.dumps({"class": type(tok).__module__ + "." + type(tok).__name__, "ids": tok(sys.argv[2]).input_ids,
                      "len": len(tok), "decoded": tok.decode(tok(sys.argv[2]).input_ids)}))
""")


def load_tokenizer_without_package(folder: Path, tmp_path: Path) -> dict:
    script = tmp_path / "load_tokenizer.py"
    script.write_text(LOAD_TOKENIZER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run([sys.executable, "-I", str(script), str(folder), TEXT], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tokenizer():
    return KimiHybridTokenizer.from_pretrained(str(EMBEDDED))


@pytest.fixture(scope="module")
def ours(tmp_path_factory, tokenizer) -> Path:
    cfg = preset_config("tiny-kda-first", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("ours") / "tiny"
    KimiHybridForCausalLM(cfg).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("source_has_code", [True, False])
def test_released_export_tokenizer_loads_without_the_package(ours, tokenizer, tmp_path, source_has_code):
    src = ours
    if not source_has_code:  # a model folder without code files: the export takes the installed package's copy
        src = tmp_path / "no-code"
        shutil.copytree(ours, src)
        for f in src.glob("*_kimi_hybrid.py"):
            f.unlink()
    out = tmp_path / "released"
    convert_checkpoint(str(src), str(out), src_format="ours", dst_format="released", progress=False)
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi_hybrid.KimiHybridTokenizer"
    code = out / "tokenization_kimi_hybrid.py"
    assert code.read_bytes() == (ROOT / "modeling_kimi_hybrid" / "tokenization_kimi_hybrid.py").read_bytes()
    res = load_tokenizer_without_package(out, tmp_path)
    assert res["class"].startswith("transformers_modules.") and res["class"].endswith(".KimiHybridTokenizer")
    assert res["ids"] == tokenizer(TEXT).input_ids and res["len"] == len(tokenizer) and res["decoded"] == TEXT


def test_hub_export_tokenizer_loads_without_the_package(ours, tokenizer, tmp_path):
    model = KimiHybridForCausalLM.from_pretrained(str(ours))
    folder = hub.prepare_hub_folder(model, tokenizer, tmp_path / "hub", repo_id="me/tiny")
    res = load_tokenizer_without_package(folder, tmp_path)
    assert res["ids"] == tokenizer(TEXT).input_ids and res["decoded"] == TEXT


def test_model_card_says_tiktoken_is_needed(ours, tokenizer, tmp_path):
    """The exported card states the pip line (tiktoken included), also when the card comes from the source folder
    (the embedded model's card did not say it)."""
    model = KimiHybridForCausalLM.from_pretrained(str(ours))
    (ours / "README.md").write_text("# a card without requirements\n")
    try:
        folder = hub.prepare_hub_folder(model, tokenizer, tmp_path / "hub")
    finally:
        (ours / "README.md").unlink()
    card = (folder / "README.md").read_text()
    assert card.startswith("# a card without requirements\n")
    assert hub.REQUIREMENTS_LINE in card and "tiktoken" in hub.REQUIREMENTS_LINE
    generated = hub.model_card(model, "me/tiny")
    assert hub.REQUIREMENTS_LINE in generated
    assert hub.with_requirements(generated) == generated  # stated once
