"""Hugging Face Hub folders for KimiHybrid models: a self-contained bundle that loads with ``trust_remote_code``.

:func:`prepare_hub_folder` writes everything a user of the Hub needs, into one flat folder:

* ``config.json`` with ``auto_map`` (``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` -> the bundle files),
  ``generation_config.json`` and the weights (``model.safetensors``, or shards + ``model.safetensors.index.json``);
* the bundle code, flat and with relative imports only: every ``*_kimi_hybrid.py`` file of the model package
  (configuration, modeling, cache, KDA kernels, tokenizer);
* the tokenizer files (``tiktoken.model`` and ``tokenizer_config.json`` with its own ``auto_map`` and the
  special-token names);
* a model card ``README.md`` (Hub metadata + architecture + usage), unless one is given or found next to the
  source weights (then :func:`export_card` makes it true for the folder: code shipped, weights layout written,
  ``trust_remote_code`` usage, the side files it names copied); either way it states the pip line the folder
  needs (``tiktoken`` included).

The folder is written into a temporary folder and moved into place when complete (an interruption leaves the
target as it was); writing over an earlier export removes its weights (no stale shard index); written files get
the mode of a plain new file.

:func:`push` prepares such a folder in a temporary directory, checks it with :func:`missing_files`, and uploads it
with ``huggingface_hub.HfApi.create_repo`` + ``upload_folder``.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from kimi_hybrid.bundle import AUTO_MAP, BUNDLE_REQUIRED, TOKENIZER_AUTO_MAP
from kimi_hybrid.bundle import bundle_files as _bundle_files_of
from kimi_hybrid.bundle import write_auto_map, write_bundle

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")  # transformers 5 writes no special_tokens_map.json


def bundle_dir(model) -> Path:
    """The folder of the model package's source files (where ``modeling_kimi_hybrid.py`` of ``model`` lives): the
    installed package, or the Hub folder's own bundle of a model loaded with ``trust_remote_code``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return Path(inspect.getfile(type(base))).resolve().parent


def bundle_files(model) -> List[Path]:
    """Every flat ``*_kimi_hybrid.py`` bundle file next to the model's class. Raises FileNotFoundError naming any
    required file that is missing."""
    return _bundle_files_of(bundle_dir(model))


def missing_files(folder: Union[str, Path]) -> List[str]:
    """The files a user needs that ``folder`` lacks (empty list = complete): config.json (with ``auto_map`` for
    AutoConfig and AutoModelForCausalLM), weights (``model.safetensors`` or an index with every shard),
    generation_config.json, the bundle .py files, the tokenizer files (tokenizer_config.json with an AutoTokenizer
    ``auto_map``) and README.md."""
    folder = Path(folder)
    missing: List[str] = []
    cfg = folder / "config.json"
    if not cfg.is_file():
        missing.append("config.json")
    else:
        amap = json.loads(cfg.read_text(encoding="utf-8")).get("auto_map") or {}
        for key in ("AutoConfig", "AutoModelForCausalLM"):
            if key not in amap:
                missing.append(f"config.json:auto_map.{key}")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        missing += [s for s in sorted(shards) if not (folder / s).is_file()]
    elif not (folder / "model.safetensors").is_file():
        missing.append("model.safetensors")
    for name in ("generation_config.json", "README.md", *BUNDLE_REQUIRED, *TOKENIZER_FILES):
        if not (folder / name).is_file():
            missing.append(name)
    tcfg = folder / "tokenizer_config.json"
    if tcfg.is_file() and "AutoTokenizer" not in (json.loads(tcfg.read_text(encoding="utf-8")).get("auto_map") or {}):
        missing.append("tokenizer_config.json:auto_map.AutoTokenizer")
    return missing


def _transformers_requirement() -> str:
    """The transformers version range this package declares (its installed metadata), e.g. ``>=5.17,<6``."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        for req in requires("kimi-hybrid") or []:
            spec = req[len("transformers"):].split(";")[0].strip() if req.startswith("transformers") else ""
            if spec and spec[0] in "<>=!~":
                return spec.replace(" ", "")
    except PackageNotFoundError:  # pragma: no cover - a checkout that is not installed
        pass
    return ">=5.17"


REQUIREMENTS_LINE = f'pip install torch "transformers{_transformers_requirement()}" tiktoken'
REQUIREMENTS_NOTE = f"""
## Requirements

The modeling and tokenizer code ship in this folder (`trust_remote_code=True`); they need `torch`, `transformers`
and `tiktoken` (the tokenizer is a tiktoken BPE):

```bash
{REQUIREMENTS_LINE}
```
"""


def with_requirements(card: str) -> str:
    """``card`` with the Requirements section appended unless it already gives :data:`REQUIREMENTS_LINE`."""
    return card if REQUIREMENTS_LINE in card else card.rstrip("\n") + "\n" + REQUIREMENTS_NOTE


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def model_card(model, repo_id: Optional[str] = None, license: str = "mit", extra: str = "") -> str:
    """A model card: Hub metadata, the layer plan, parameter counts, the cache formula and a usage snippet."""
    from huggingface_hub import ModelCard, ModelCardData

    cfg = model.config
    n_total = sum(p.numel() for p in model.parameters())
    kinds = ["KDA" if t == "linear_attention" else "MLA" for t in cfg.layer_types]
    n_kda, n_mla = kinds.count("KDA"), kinds.count("MLA")
    lat = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    H, K = cfg.linear_attn_config["num_heads"], cfg.linear_attn_config["head_dim"]
    name = repo_id or "path/to/this/folder"
    data = ModelCardData(library_name="transformers", license=license, pipeline_tag="text-generation",
                         tags=["kimi-hybrid", "kimi-linear", "kda", "mla", "moe", "custom_code"])
    experts = (f"{cfg.num_experts} routed experts (top-{cfg.num_experts_per_token}) + {cfg.num_shared_experts} shared"
               if "sparse" in cfg.mlp_layer_types else "dense MLPs")
    body = f"""
# {repo_id.split('/')[-1] if repo_id else 'KimiHybrid model'}

A kimi-hybrid model: Kimi Delta Attention (KDA) layers interleaved with NoPE Multi-head
Latent Attention (MLA) layers and Mixture-of-Experts MLPs, the architecture of Kimi-Linear-48B-A3B.

| | |
|---|---|
| parameters | {_fmt_params(n_total)} ({n_total:,}) |
| layers | {cfg.num_hidden_layers}: {n_kda} KDA + {n_mla} MLA (`{' '.join(kinds)}`) |
| hidden size | {cfg.hidden_size} |
| KDA | {H} heads x {K}, short conv {cfg.linear_attn_config['short_conv_kernel_size']}, fp32 state {K}x{K} per head |
| MLA | {cfg.num_attention_heads} heads, nope {cfg.qk_nope_head_dim} / rope {cfg.qk_rope_head_dim} / v {cfg.v_head_dim}, kv_lora_rank {cfg.kv_lora_rank} (NoPE) |
| MLP | {experts}; layer types `{' '.join(cfg.mlp_layer_types)}` |
| vocabulary | {cfg.vocab_size} |

Decoding cache per sequence: the {n_kda} KDA layers hold a constant conv window + fp32 recurrent state, the {n_mla}
MLA layers {lat} latent values per token each (`KimiHybridCache.memory_report()` gives the exact bytes).

## Usage

The modeling and tokenizer code ship in this folder, so only `torch`, `transformers` and `tiktoken` are needed:

```bash
{REQUIREMENTS_LINE}
```

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=64, do_sample=True, temperature=0.8, top_p=0.95)
print(tok.decode(out[0][ids.shape[1]:]))
```

`model.generate(..., return_dict_in_generate=True).past_key_values` is the `KimiHybridCache`; its
`memory_report()` gives the bytes per layer type.

With the `kimi-hybrid` package installed: `kimi-hybrid generate --model {name} --prompt "def fibonacci(n):"`.
{extra}"""
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))


WEIGHT_PATTERNS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")


def is_hub_folder(folder: Union[str, Path]) -> bool:
    """True when ``folder`` holds a previous export (its config.json has our ``auto_map`` and the bundle's
    modeling file is there): such a folder may be written over without ``--overwrite``."""
    folder = Path(folder)
    try:
        amap = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return amap.get("AutoModelForCausalLM") == AUTO_MAP.get("AutoModelForCausalLM") and all(
        (folder / name).is_file() for name in BUNDLE_REQUIRED)


def describe_weights(folder: Union[str, Path]) -> str:
    """How the weights of ``folder`` are stored, for a model card: ``"in one file `model.safetensors` of 55.2 MB"``
    or ``"in 4 shards of 55.2 MB in all (index `model.safetensors.index.json`)"`` (MB = 10^6 bytes)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        size = sum((folder / s).stat().st_size for s in shards)
        return f"in {len(shards)} shards of {size / 1e6:.1f} MB in all (index `model.safetensors.index.json`)"
    size = (folder / "model.safetensors").stat().st_size
    return f"in one file `model.safetensors` of {size / 1e6:.1f} MB"


def export_usage(name: str) -> str:
    """The Usage section of an exported folder's card: ``name`` is the repo id or a folder placeholder."""
    return f"""## Usage

The modeling and tokenizer code ship in this folder: it loads with `trust_remote_code=True`, without the
`kimi_hybrid` package.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
ids = tok("def read_config(path):", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=64, repetition_penalty=1.2, no_repeat_ngram_size=8)
print(tok.decode(out[0][ids.shape[1]:]))
```

With the `kimi-hybrid` package installed: `kimi-hybrid generate --model {name} --prompt "def read_config(path):"`.

"""


def export_card(card: str, source: Optional[Path], out: Path, repo_id: Optional[str] = None) -> str:
    """Adapt a source folder's model card to the exported folder ``out`` so that what it says is true there:

    * files of ``source`` the card names in backquotes (training records, samples, corpus manifests) and ``out``
      lacks are copied next to it (weights excepted);
    * a line saying the code is not in the folder becomes one saying it ships in it (``trust_remote_code=True``);
    * ``... safetensors in N shards of at most X`` becomes the dtype and layout that was written
      (:func:`describe_weights`);
    * the ``## Usage`` section becomes :func:`export_usage` (loading this folder, not the source path).
    """
    if source is not None and source.is_dir():
        for name in sorted(set(re.findall(r"`([^`/\s]+\.[A-Za-z0-9.]+)`", card))):
            src, dst = source / name, out / name
            if src.is_file() and not dst.exists() and not name.startswith("model"):
                shutil.copyfile(src, dst)
    lines = card.split("\n")
    lines = [("Loading it needs `torch`, `transformers` and `tiktoken` (the tokenizer); the modeling and tokenizer "
              "code ship in this folder (`trust_remote_code=True`, see Usage).")
             if "the code is not in this folder" in line else line for line in lines]
    card = "\n".join(lines)
    try:
        dtype = json.loads((out / "config.json").read_text(encoding="utf-8")).get("dtype")
    except (OSError, ValueError):
        dtype = None
    weights = describe_weights(out)
    card = re.sub(r"\b(bfloat16|float16|float32) safetensors in \d+ shards of at most \S+",
                  lambda m: f"{dtype or m.group(1)} safetensors {weights}", card)
    card = re.sub(r"## Usage\n.*?(?=^## |\Z)", lambda _: export_usage(repo_id or "path/to/this/folder"), card,
                  count=1, flags=re.S | re.M)
    return card


def _written_mode() -> int:
    """The mode a newly created file gets (0o666 less the process umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def prepare_hub_folder(model, tokenizer, out_dir: Union[str, Path], repo_id: Optional[str] = None,
                       card: Optional[str] = None, max_shard_size: Union[int, str] = "2GB",
                       safe_serialization: bool = True) -> Path:
    """Write a self-contained Hub folder for ``model`` + ``tokenizer`` into ``out_dir`` and return its path.

    The folder is written completely into a temporary folder next to ``out_dir`` and then moved into place, so an
    interruption or an error leaves ``out_dir`` as it was (the temporary folder is removed). Over an existing
    folder, the new files replace those of the same names, its old weights are removed (no stale shard index)
    and its other files are kept.

    ``card``: the README.md text; default: the README.md next to the model's source weights if there is one
    (``model.name_or_path``), else :func:`model_card`. Raises FileNotFoundError if the result misses a file
    (see :func:`missing_files`) or the model's class has no bundle files next to it (not a KimiHybrid model).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    bundle_files(base)  # before anything is written: a model of another class has no bundle to ship
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_hub_folder(base, tokenizer, tmp, out, repo_id, card, max_shard_size)
        _move_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hub_folder(base, tokenizer, tmp: Path, out: Path, repo_id: Optional[str], card: Optional[str],
                      max_shard_size: Union[int, str]) -> None:
    """Every file of the Hub folder ``out``, written into the new, empty folder ``tmp``; checked complete."""
    base.save_pretrained(tmp, max_shard_size=max_shard_size)
    # the auto_map and the bundle files are written explicitly: save_pretrained only copies the code of classes
    # registered with register_for_auto_class, and only the files the class's module imports
    write_auto_map(tmp / "config.json")
    write_bundle(tmp, bundle_dir(base))
    if not (tmp / "generation_config.json").is_file():
        from transformers import GenerationConfig

        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tcfg_path = tmp / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8"))
    tcfg["auto_map"] = dict(TOKENIZER_AUTO_MAP)
    tcfg_path.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if card is None:
        name = str(getattr(base, "name_or_path", "") or "")
        src = Path(name) / "README.md" if name and Path(name).is_dir() else None
        if src is not None and src.is_file():
            card = export_card(src.read_text(encoding="utf-8"), src.parent, tmp, repo_id)
        else:
            card = model_card(base, repo_id)
    (tmp / "README.md").write_text(with_requirements(card), encoding="utf-8")
    # files written through a temporary file (the weights) get mode 0600, the folder from mkdtemp 0700: give them
    # the modes a plain new file / folder gets (0644 / 0755 under the usual umask 022)
    mode = _written_mode()
    os.chmod(tmp, mode | ((mode & 0o444) >> 2))
    for path in tmp.iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)
    missing = missing_files(tmp)
    if missing:
        raise FileNotFoundError(f"the Hub folder {out} is incomplete: {missing}")


def _is_weights_file(name: str) -> bool:
    return any(Path(name).match(pattern) for pattern in WEIGHT_PATTERNS)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Make the complete folder ``tmp`` the folder ``out`` (same file system: renames only). A missing or empty
    ``out`` is replaced by one rename; over an existing one, ``out`` is renamed aside, ``tmp`` renamed to ``out``,
    and the old folder's files that the new one lacks (weights excepted) are moved back. Ctrl-C is held off for
    these few renames, so ``out`` is never missing or half-replaced."""
    import signal
    import threading

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            os.replace(tmp, out)
            return
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        aside.rmdir()
        os.replace(out, aside)
        os.replace(tmp, out)
        for old in aside.iterdir():
            if not (out / old.name).exists() and not _is_weights_file(old.name):
                os.replace(old, out / old.name)
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous)


def push(model, tokenizer, repo_id: str, private: bool = False, token: Optional[str] = None,
         commit_message: str = "Upload KimiHybrid model", card: Optional[str] = None,
         revision: Optional[str] = None, **upload_kwargs: Any) -> str:
    """Prepare the folder (temporary directory) and upload it to ``repo_id`` on the Hub; returns the commit URL.

    Calls ``HfApi.create_repo(repo_id, private=..., exist_ok=True)`` then ``HfApi.upload_folder`` with the whole
    folder in one commit.
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="kimi-hybrid-hub-") as tmp:
        folder = prepare_hub_folder(model, tokenizer, Path(tmp) / "bundle", repo_id=repo_id, card=card)
        api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message=commit_message, revision=revision, **upload_kwargs)
    return str(getattr(info, "commit_url", info))


def describe(folder: Union[str, Path]) -> Dict[str, Any]:
    """File names and sizes of a prepared folder (used by the CLI and tests)."""
    folder = Path(folder)
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
