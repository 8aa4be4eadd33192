"""``kimi-hybrid``: generate and chat with a KimiHybrid model from the command line.

Subcommands:

* ``generate --prompt TEXT``: stream a completion of the prompt;
* ``chat``: an interactive chat (one user message per line on stdin; ``/reset`` clears the history, ``/exit`` or
  end of input ends it), rendered with the tokenizer's chat template;
* ``export --out DIR`` / ``push --repo-id NAME``: write a self-contained Hub folder (bundle code, weights,
  tokenizer, model card) / upload it (see :mod:`kimi_hybrid.app.hub`); by default the weights keep the dtype the
  source checkpoint was saved in (``--dtype stored``). ``--out`` may not be the model folder (nor inside it or
  contain it); a non-empty folder that is not a previous export needs ``--overwrite``.

* ``memory``: the cache memory planner (:mod:`kimi_hybrid.app.memory`): cache bytes per token and per sequence,
  the largest context and batch on a GPU of a given size, compared with all-MLA and plain-MHA caches, and a plot.

Decoding: greedy with a repetition penalty and an n-gram block by default (``DEFAULT_DECODING``, the setting that
kept the embedded model from looping; ``--sample`` samples instead). ``generate`` heals a prompt that ends inside
a token (``--no-heal`` turns it off): the last prompt token is taken back and the first generated tokens must
re-spell its text, so ``"def f(x):"`` continues as if the prompt had been ``"def f(x):\n"`` (see
:class:`TokenHealing`).

Option values are checked before anything is loaded; user errors (an out-of-range option, no CUDA for
``--device cuda``, an invalid config.json, a truncated or corrupt weights file, a Hub id that cannot be reached,
``push`` without network, an option value argparse rejects, an output path that cannot be written, an empty
prompt) end with a one-line ``kimi-hybrid: ...`` message and exit status 1
(``KIMI_HYBRID_DEBUG=1`` shows the traceback instead).

The default model is the embedded one, ``models/kimi-hybrid-stdlib`` next to the sources (a ~14M-parameter 3:1
KDA:MLA MoE model trained on the CPython standard library: it writes Python-like text, it is not an assistant).
``--model PATH_OR_REPO`` loads any checkpoint in our layout or a released Kimi-Linear one (a folder or a Hub repo
id), always as :class:`KimiHybridForCausalLM` (transformers' Auto classes would map ``kimi_linear`` to their own
class); ``--trust-remote-code`` runs the classes the folder's own ``auto_map`` names instead (one stderr line says
which). Stdout closed by its reader (``| head``) ends quietly with status 141; Ctrl-C with one line and 130.

After each generation the cache memory of :class:`KimiHybridCache` (``cache.memory_report()``) is printed as a
table: KDA layers hold a constant conv window + fp32 state, MLA layers a latent that grows per token.

``python -m kimi_hybrid.app.cli`` works as well.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from kimi_hybrid.app.memory import format_memory_report  # the table users get too (print_memory_report)

REPO_ROOT = Path(__file__).resolve().parents[1]  # the source tree (editable install): models/ lives there
EMBEDDED_MODEL_NAME = "kimi-hybrid-stdlib"
ENV_DEFAULT_MODEL = "KIMI_HYBRID_DEFAULT_MODEL"

# Default decoding of `generate` and `chat`: greedy with a repetition penalty and an n-gram block, the setting that
# kept the embedded model from looping. Distinct-4-gram ratio of 200-token completions, mean (min) over six prompts
# (examples/decoding_sweep.py, examples/results/decoding_sweep.json): greedy 0.10 (0.025), + penalty 1.2
# 0.70 (0.32), + 8-gram block 0.59 (0.48), both 0.90 (0.84), penalty 1.3 + 8-gram block 1.00 (0.99). An n-gram
# block of n <= 4 would make that ratio 1.0 by construction and forbid the repeats code needs. To retune: edit these
# two numbers, re-run the sweep.
DEFAULT_DECODING = {"repetition_penalty": 1.2, "no_repeat_ngram_size": 8}


# ---------------------------------------------------------------------------------------------------------------
# locating and loading
# ---------------------------------------------------------------------------------------------------------------

def default_model_path() -> Path:
    """The embedded model: ``$KIMI_HYBRID_DEFAULT_MODEL`` if set, else ``models/kimi-hybrid-stdlib`` of the
    source tree this file belongs to (the package is installed in editable mode, so that tree is the checkout)."""
    env = os.environ.get(ENV_DEFAULT_MODEL)
    return Path(env) if env else REPO_ROOT / "models" / EMBEDDED_MODEL_NAME


def resolve_model(model: Optional[str]) -> str:
    """``--model`` value -> a folder path or a Hub repo id. Raises SystemExit with a hint if the embedded model's
    weights are missing."""
    if model:
        local = Path(model).expanduser()
        if local.exists():
            if not (local / "config.json").is_file():
                raise SystemExit(f"kimi-hybrid: {local} has no config.json; pass a model folder (or a Hub repo id)")
            return str(local)
        looks_local = model.startswith(("/", ".", "~")) or model.count("/") != 1 or model.endswith("/")
        if looks_local:
            raise SystemExit(f"kimi-hybrid: no such model folder: {model} (and it is not a Hub repo id of the form "
                             "owner/name)")
        return model
    path = default_model_path()
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"kimi-hybrid: the embedded model was not found at {path} (no config.json). Install the package from a "
            f"source checkout (pip install -e .), set {ENV_DEFAULT_MODEL}, or pass --model PATH_OR_REPO.")
    return str(path)


def pick_device(name: str) -> str:
    """``--device`` value -> a device string. ``auto``: cuda if available, else cpu. Raises SystemExit with a
    one-line message for a device string torch does not know and for CUDA devices this machine does not have."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"kimi-hybrid: unknown --device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("kimi-hybrid: CUDA is not available on this machine; use --device cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise SystemExit(f"kimi-hybrid: --device {name}: this machine has {n} CUDA device(s) "
                             f"(cuda:0 .. cuda:{n - 1})")
    return name


SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def stored_dtype(model: str) -> Optional[str]:
    """The dtype a local checkpoint folder was saved in, as a name (``"bfloat16"``, ...): the ``dtype`` field of its
    config.json (``torch_dtype`` in older saves), else the floating-point dtype of its safetensors weights (read
    from the file header: the dtype of most of the bytes). None if unknown (a Hub repo id, no weights, unreadable)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    name = (cfg.get("dtype") or cfg.get("torch_dtype")) if isinstance(cfg, dict) else None
    if isinstance(name, str) and name != "auto":
        return name.replace("torch.", "")
    weights = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    try:
        if not weights.is_file() and index.is_file():
            shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
            weights = folder / sorted(set(shards))[0]
        with open(weights, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError, KeyError, IndexError):
        return None
    nbytes: Dict[str, int] = {}
    for key, info in header.items():
        if key != "__metadata__" and info.get("dtype") in SAFETENSORS_DTYPES:
            start, end = info["data_offsets"]
            nbytes[info["dtype"]] = nbytes.get(info["dtype"], 0) + end - start
    # the dtype of most of the bytes: a few small parameters may be kept in fp32 (A_log, dt_bias, router bias)
    return SAFETENSORS_DTYPES[max(nbytes, key=nbytes.get)] if nbytes else None


def pick_dtype(name: str, device: str, model: Optional[str] = None):
    """``--dtype`` value -> a torch dtype. ``auto``: bf16 on CUDA, fp32 elsewhere (CPU matmuls are fastest and most
    accurate in fp32). ``stored`` (the default of export / push): the dtype the checkpoint ``model`` was saved in
    (see :func:`stored_dtype`); for a Hub repo id it is ``"auto"``, which makes transformers read it the same way."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name == "stored":
        found = stored_dtype(model) if model else None
        if found is None:
            return "auto"
        name = found
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}[name]
    except KeyError:
        raise SystemExit(f"kimi-hybrid: unknown --dtype {name!r}; use one of {DTYPE_CHOICES}") from None


def _read_tokenizer_config(model: str) -> Dict[str, Any]:
    cfg = Path(model) / "tokenizer_config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}
    return {}


# tokenizer classes of the tiktoken.model folders our tokenizer reads: ours and the released Kimi remote code's
OUR_TOKENIZER_CLASSES = ("KimiHybridTokenizer", "TikTokenTokenizer")


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split("\n")[0].split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_hub_id(model: str) -> bool:
    return not Path(model).exists()


def _hub_unreachable(model: str, e: BaseException) -> SystemExit:
    return SystemExit(f"kimi-hybrid: cannot load {model!r} from the Hugging Face Hub ({_first_line(e, 160)}); "
                      "check the repo id and the network (or HF_HUB_OFFLINE), or pass a local folder")


def check_hub_reachable(model: str) -> None:
    """For a Hub repo id whose config.json is not in the local cache: one HEAD request for it, without retries
    (huggingface_hub retries a download of an uncached file 5 times with backoff, ~30-50 s, when the Hub cannot be
    reached). Raises SystemExit with one line when it fails (no network, an unroutable ``HF_ENDPOINT``, no such
    repo). Does nothing for local folders, cached files and with ``HF_HUB_OFFLINE`` (transformers then reads the
    cache only and fails at once)."""
    if not _is_hub_id(model):
        return
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(model, "config.json"), str):
        return
    try:
        get_hf_file_metadata(hf_hub_url(model, "config.json"), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except _network_errors() as e:
        raise _hub_unreachable(model, e) from None


def _config_dict(model: str) -> Dict[str, Any]:
    """config.json of a folder or Hub repo as a dict. Raises SystemExit (one line) when it is missing, not JSON
    or cannot be fetched."""
    from transformers import PretrainedConfig

    cfg_file = Path(model) / "config.json"
    if cfg_file.is_file():
        try:
            raw = json.loads(cfg_file.read_text(encoding="utf-8"))
        except ValueError as e:
            raise SystemExit(f"kimi-hybrid: invalid model config in {model}: config.json is not valid JSON ({e})") \
                from None
        if not isinstance(raw, dict):
            raise SystemExit(f"kimi-hybrid: invalid model config in {model}: config.json does not hold a JSON object")
        return raw
    try:
        return PretrainedConfig.get_config_dict(model)[0]
    except OSError as e:
        if _is_hub_id(model):
            raise _hub_unreachable(model, e) from None
        raise SystemExit(f"kimi-hybrid: cannot read the config of {model}: {_first_line(e)}") from None


def _refuse_unloadable(model: str, raw: Dict[str, Any]) -> None:
    """SystemExit (one line) for a config.json that is not a Kimi checkpoint, or one whose weights the model cannot
    read as they are (K3, quantized, transformers-native: the converter's command is given)."""
    from kimi_hybrid.conversion_kimi_hybrid import checkpoint_format, unmapped_reason

    try:
        checkpoint_format(raw)
    except ValueError:
        raise SystemExit(f"kimi-hybrid: {model} is not a KimiHybrid or Kimi-Linear checkpoint (config.json "
                         f"model_type {raw.get('model_type')!r}; expected kimi_hybrid or kimi_linear)") from None
    why = unmapped_reason(raw)
    if why is not None:
        out = str(model).rstrip("/\\") + "-kimi-hybrid"
        raise SystemExit(f"kimi-hybrid: {model} holds {why}; convert it once and load the output folder: "
                         f"kimi-hybrid-convert {model} {out}")


def load_config(model: str, trust_remote_code: bool = False):
    """The model's config: a ``KimiHybridConfig`` for our folders and released Kimi-Linear ones (``model_type
    kimi_linear``, read by ``KimiHybridConfig.from_released_dict``: transformers' AutoConfig would map it to its own
    ``KimiLinearConfig``); with ``trust_remote_code``, the config class the folder's own ``auto_map`` names.

    Raises SystemExit with ``invalid model config in <path>: <reason>`` when config.json is not valid JSON or the
    config class rejects it (its ValueError names the field, e.g. ``layer_types has 5 entries but num_hidden_layers
    is 8``), with the converter's command for checkpoints that need converting, and with ``cannot load <id> from the
    Hugging Face Hub`` when a repo id cannot be fetched."""
    from kimi_hybrid import KimiHybridConfig

    raw = _config_dict(model)
    try:
        if trust_remote_code:
            return remote_class(model, raw.get("auto_map"), "AutoConfig").from_pretrained(model)
        _refuse_unloadable(model, raw)
        if raw.get("model_type") == "kimi_hybrid" or not _is_hub_id(model):
            return KimiHybridConfig.from_pretrained(model)  # reads local released folders as well
        return KimiHybridConfig.from_released_dict(raw)
    except ValueError as e:
        raise SystemExit(f"kimi-hybrid: invalid model config in {model}: {e}") from None
    except OSError as e:
        if _is_hub_id(model):
            raise _hub_unreachable(model, e) from None
        raise SystemExit(f"kimi-hybrid: cannot read the config of {model}: {_first_line(e)}") from None


def remote_class(model: str, auto_map: Any, key: str):
    """The class ``auto_map[key]`` names in the folder / repo ``model`` (its own code, ``trust_remote_code``),
    loaded with transformers' ``get_class_from_dynamic_module``. The Auto classes prefer a registered class (ours,
    once ``kimi_hybrid`` is imported) over a folder's code; this does not. A list value (tokenizers: slow, fast)
    gives its first named class. Raises SystemExit when ``auto_map`` does not name one."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    ref = (auto_map or {}).get(key) if isinstance(auto_map, dict) else None
    if isinstance(ref, (list, tuple)):
        ref = next((r for r in ref if r), None)
    if not ref:
        raise SystemExit(f"kimi-hybrid: --trust-remote-code: {model} ships no code of its own ({key} is not in its "
                         "auto_map); leave the option out to use the installed kimi-hybrid")
    return get_class_from_dynamic_module(ref, model)


def broken_weights_file(model: str) -> Optional[Path]:
    """The first ``*.safetensors`` file of a local folder ``model`` that safetensors cannot open (a truncated file,
    a destroyed header), in name order; None when every file opens or ``model`` is not a folder. Opening reads
    only the header and checks it against the file size: no tensor data is read."""
    from safetensors import SafetensorError, safe_open

    folder = Path(model)
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError, ValueError):
            return path
    return None


def load_tokenizer(model: str, trust_remote_code: bool = False):
    """The tokenizer: a local folder whose ``tokenizer_config.json`` names ``KimiHybridTokenizer`` or the released
    ``TikTokenTokenizer`` is read by the installed :class:`KimiHybridTokenizer`; with ``trust_remote_code`` the
    folder's own class (its ``auto_map``) when it names one; anything else through ``AutoTokenizer``."""
    from transformers import AutoTokenizer

    from kimi_hybrid.tokenization_kimi_hybrid import KimiHybridTokenizer

    tcfg = _read_tokenizer_config(model)
    try:
        if trust_remote_code and (tcfg.get("auto_map") or {}).get("AutoTokenizer"):
            return remote_class(model, tcfg["auto_map"], "AutoTokenizer").from_pretrained(model)
        if tcfg.get("tokenizer_class") in OUR_TOKENIZER_CLASSES and not trust_remote_code:
            return KimiHybridTokenizer.from_pretrained(model)
        return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except OSError as e:
        if _is_hub_id(model):
            raise _hub_unreachable(model, e) from None
        raise SystemExit(f"kimi-hybrid: cannot load the tokenizer of {model}: {_first_line(e)}") from None


STRICT_LOADING_HINT = ("check that config.json belongs to these weights; a K3, quantized or transformers-native "
                       "kimi_linear checkpoint needs `kimi-hybrid-convert SRC OUT` first")


def _strict_loading_error(model: str, e: ValueError) -> SystemExit:
    """The model's strict-loading ValueError as the CLI's one line: the tensors it names, and what a CLI user can
    do (the library's advice to pass ``strict_loading=False`` is not an option of the CLI)."""
    what = _first_line(e, 100_000).split(". A K3")[0].split("; pass strict_loading")[0]
    named = re.match(r"checkpoint .*? does not match \w+: (.*)", what)  # the folder is named by our line already
    what = named.group(1) if named else what
    if len(what) > 300:
        what = what[:297] + "..."
    return SystemExit(f"kimi-hybrid: the weights in {model} do not match its config: {what}; {STRICT_LOADING_HINT}")


def load_model_and_tokenizer(model: str, device: str, dtype, trust_remote_code: bool = False):
    """Load ``(model, tokenizer)``; the model is put in eval mode on ``device`` in ``dtype``.

    Without ``trust_remote_code`` the model is always ours, :class:`KimiHybridForCausalLM` (a released Kimi-Linear
    folder too: its tensors are read through the registered conversion mapping; transformers' Auto classes would
    build their own ``KimiLinearForCausalLM`` for it). With it, the classes the folder's ``auto_map`` names, from its
    own code files (one stderr line says which).

    Raises SystemExit with one line for what a user has to fix: an unreadable config (:func:`load_config`), a Hub
    id that cannot be fetched, weights that are truncated or corrupt (safetensors cannot read them), a checkpoint
    whose tensors do not match the config (strict loading), a missing shard, a checkpoint that needs converting.
    """
    from safetensors import SafetensorError
    from transformers.utils import logging as hf_logging

    from kimi_hybrid import KimiHybridForCausalLM

    hf_logging.disable_progress_bar()
    check_hub_reachable(model)
    config = load_config(model, trust_remote_code)
    tokenizer = load_tokenizer(model, trust_remote_code)
    cls = KimiHybridForCausalLM
    if trust_remote_code:
        cls = remote_class(model, getattr(config, "auto_map", None), "AutoModelForCausalLM")
        print(f"kimi-hybrid: --trust-remote-code: running the folder's own {cls.__module__}.{cls.__name__}",
              file=sys.stderr)
    try:
        lm = cls.from_pretrained(model, config=config, dtype=dtype)
    except SafetensorError as e:
        broken = broken_weights_file(model)
        where = f"{broken} cannot be read" if broken else f"the weights in {model} cannot be read"
        raise SystemExit(f"kimi-hybrid: {where} ({_first_line(e)}): the file is truncated or corrupt; download or "
                         "convert it again") from None
    except OSError as e:
        if _is_hub_id(model):
            raise _hub_unreachable(model, e) from None
        raise SystemExit(f"kimi-hybrid: cannot load the weights in {model}: {_first_line(e)}") from None
    except ValueError as e:  # strict loading: missing / unexpected tensors, named
        raise _strict_loading_error(model, e) from None
    lm.to(device).eval()
    return lm, tokenizer


# ---------------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------------

def generation_kwargs(args, tokenizer) -> Dict[str, Any]:
    """``generate`` keyword arguments for the parsed options: greedy unless ``--sample`` (``--temperature 0`` is
    greedy too), plus ``repetition_penalty`` / ``no_repeat_ngram_size`` unless disabled (1.0 / 0)."""
    kw: Dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if not args.sample or args.temperature == 0:  # temperature 0 means greedy decoding
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kw.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.repetition_penalty and args.repetition_penalty != 1.0:
        kw["repetition_penalty"] = args.repetition_penalty
    if args.no_repeat_ngram_size:
        kw["no_repeat_ngram_size"] = args.no_repeat_ngram_size
    return kw


def token_bytes_table(tokenizer) -> List[Optional[bytes]]:
    """The bytes each token id spells, indexed by id (``None`` for special tokens, which never heal a prompt).

    For a tiktoken tokenizer (:class:`KimiHybridTokenizer`) the exact bytes of each BPE rank; for other tokenizers
    the UTF-8 of the decoded single token (a token that is only part of a character decodes to U+FFFD and will
    not match prompt text)."""
    n = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    enc = getattr(tokenizer, "tiktoken_encoding", None)
    n_ranks = getattr(tokenizer, "n_ranks", None)
    table: List[Optional[bytes]] = []
    for i in range(n):
        if i in special or (n_ranks is not None and i >= n_ranks):
            table.append(None)
        elif enc is not None:
            table.append(enc.decode_single_token_bytes(i))
        else:
            table.append(tokenizer.decode([i]).encode("utf-8"))
    return table


class TokenHealing:
    """Token healing (Guidance's idea; transformers' ``generate(token_healing=True)`` does the same with a soft
    bias): a prompt that ends inside a token is tokenized differently from the training text (``"):"`` is one
    token, but code has ``"):\n"``, another one), so the model sees a token it rarely saw at the end of a line.
    The last prompt token is taken back and the first generated tokens are constrained to re-spell its bytes:
    each must start with the removed text still to re-spell, or be a prefix of it.

    We do not use transformers' own (5.23): it strips the prompt's whitespace (trailing indentation matters in
    code), and it looks a tail up with its spaces written as the tokenizer's token for ``" "``, which for ours is
    ``[UNK]``: tails with a space (``" in"``) are not healed, or raise KeyError inside ``generate``.

    Built by :meth:`prepare` from the prompt ids; ``processor()`` is a transformers ``LogitsProcessor`` for
    ``generate(logits_processor=...)`` (batch of one row). ``removed_text`` is what the generated text starts
    with and the caller does not print again.
    """

    def __init__(self, table: List[Optional[bytes]], prompt_len: int, removed: bytes):
        self.table = table
        self.prompt_len = prompt_len  # length of the trimmed prompt
        self.removed = removed
        self.removed_text = removed.decode("utf-8")

    @classmethod
    def prepare(cls, tokenizer, ids: List[int], table: Optional[List[Optional[bytes]]] = None):
        """``(trimmed ids, TokenHealing or None)``. None (ids unchanged) when there is nothing to heal: an empty
        prompt, a special last token, last-token bytes that are not whole UTF-8 characters, or no longer token
        that starts with them. A one-token prompt is trimmed to the BOS token (or EOS when there is none)."""
        if not ids:
            return ids, None
        table = token_bytes_table(tokenizer) if table is None else table
        last = table[ids[-1]] if ids[-1] < len(table) else None
        if not last:
            return ids, None
        try:
            last.decode("utf-8")
        except UnicodeDecodeError:
            return ids, None
        if not any(b is not None and len(b) > len(last) and b.startswith(last) for b in table):
            return ids, None
        trimmed = list(ids[:-1])
        if not trimmed:
            start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
            if start is None:
                return ids, None
            trimmed = [start]
        return trimmed, cls(table, len(trimmed), last)

    def allowed(self, generated: List[int]) -> Optional[List[int]]:
        """Token ids allowed next after ``generated`` (ids after the trimmed prompt); None once the removed bytes
        are re-spelled (no constraint any more)."""
        done = b"".join(self.table[i] or b"" for i in generated)
        if len(done) >= len(self.removed):
            return None
        rest = self.removed[len(done):]
        return [i for i, b in enumerate(self.table) if b and (b.startswith(rest) or rest.startswith(b))]

    def processor(self):
        """A ``transformers.LogitsProcessor`` that sets every score outside :meth:`allowed` to -inf."""
        import torch
        from transformers import LogitsProcessor

        healing = self

        class HealingLogitsProcessor(LogitsProcessor):
            def __call__(self, input_ids, scores):
                for row in range(input_ids.shape[0]):
                    ok = healing.allowed(input_ids[row, healing.prompt_len:].tolist())
                    if ok is not None:
                        keep = torch.full_like(scores[row], float("-inf"))
                        idx = torch.tensor(ok, device=scores.device)
                        keep[idx] = scores[row, idx]
                        scores[row] = keep
                return scores

        return HealingLogitsProcessor()


def run_generation(model, tokenizer, input_ids, args, out=None, healing: Optional[TokenHealing] = None):
    """Generate (streaming the new text to ``out`` unless ``--no-stream``); returns ``(text, cache)``. With
    ``healing``, ``input_ids`` is the trimmed prompt and the re-spelled ``healing.removed_text`` is not printed
    again (nor returned)."""
    import torch
    from transformers import LogitsProcessorList

    from kimi_hybrid.compat_kimi_hybrid import output_cache

    out = out or sys.stdout
    skip = len(healing.removed_text) if healing else 0
    streamer = None if args.no_stream else _Streamer(tokenizer, out, skip_chars=skip)
    torch.manual_seed(args.seed)
    input_ids = input_ids.to(model.device)
    extra = {"logits_processor": LogitsProcessorList([healing.processor()])} if healing else {}
    res = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                         return_dict_in_generate=True, **generation_kwargs(args, tokenizer), **extra)
    new = res.sequences[0, input_ids.shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True)[skip:]
    if args.no_stream:
        out.write(text)
    out.write("\n")
    out.flush()
    return text, output_cache(res)  # the cache under either transformers' field name, no deprecation warning


class _Streamer:
    """``TextStreamer`` that writes to a given stream (transformers' prints to stdout), leaving out the first
    ``skip_chars`` characters of the new text (a healed prompt's re-spelled tail)."""

    def __init__(self, tokenizer, out, skip_chars: int = 0):
        from transformers import TextStreamer

        state = {"skip": skip_chars}

        class Inner(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False):
                cut = min(state["skip"], len(text))
                state["skip"] -= cut
                out.write(text[cut:])
                out.flush()

        self._inner = Inner(tokenizer, skip_prompt=True, skip_special_tokens=True)

    def put(self, value):
        self._inner.put(value)

    def end(self):
        self._inner.end()


def print_report(cache, args, out=None) -> None:
    out = out or sys.stdout
    if args.no_memory_report or cache is None or not hasattr(cache, "memory_report"):
        return
    out.write(format_memory_report(cache.memory_report()) + "\n")
    out.flush()


def read_prompt(args, stdin=None, err=None) -> str:
    """The prompt of ``generate``: ``--prompt``, else all of stdin. When stdin is a terminal, one stderr line says
    that the prompt is read from it (end it with Ctrl-D). Raises SystemExit (one line) for an empty or
    whitespace-only prompt: the model would only continue its start-of-text token."""
    stdin = stdin or sys.stdin
    err = err or sys.stderr
    prompt = args.prompt
    source = "--prompt"
    if prompt is None:
        source = "stdin"
        if stdin.isatty():
            print("kimi-hybrid: reading the prompt from stdin (end it with Ctrl-D, or pass --prompt TEXT)",
                  file=err, flush=True)
        prompt = stdin.read()
    if not prompt.strip():
        raise SystemExit(f"kimi-hybrid: the prompt is empty ({source}); pass --prompt TEXT or pipe text into "
                         "kimi-hybrid generate")
    return prompt


def cmd_generate(args) -> int:
    import torch

    prompt = read_prompt(args)  # before loading: an empty prompt is refused at once
    model, tokenizer = _load(args)
    ids = tokenizer(prompt).input_ids
    healing = None
    if not ids:
        ids = _bos(tokenizer)
    elif not args.no_heal:
        ids, healing = TokenHealing.prepare(tokenizer, ids)
    if args.echo_prompt:
        sys.stdout.write(prompt)
    _, cache = run_generation(model, tokenizer, torch.tensor([ids]), args, healing=healing)
    print_report(cache, args)
    return 0


def _bos(tokenizer) -> List[int]:
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return [start]


CHAT_MARKER = "chat_trained"


def chat_trained(model, path: Optional[str] = None) -> Optional[bool]:
    """The model's ``chat_trained`` marker: ``generation_config.json`` of a model folder may say
    ``"chat_trained": false`` (a base / code model: it continues text, it does not follow chat turns) or ``true``.
    Read from the file of a local folder ``path`` (transformers drops unknown keys of a generation config saved
    with ``_from_model_config``), else from ``model.generation_config``. None when the model does not say."""
    value = None
    file = Path(path) / "generation_config.json" if path else None
    if file is not None and file.is_file():
        try:
            value = json.loads(file.read_text(encoding="utf-8")).get(CHAT_MARKER)
        except (OSError, ValueError, AttributeError):
            value = None
    if value is None:
        value = getattr(getattr(model, "generation_config", None), CHAT_MARKER, None)
    return value if isinstance(value, bool) else None


def cmd_chat(args) -> int:
    model, tokenizer = _load(args)
    if chat_trained(model, resolve_model(args.model)) is False:
        print("kimi-hybrid: this model has no chat training (generation_config.json: chat_trained = false): it "
              "continues text and will not follow your messages; `kimi-hybrid generate --prompt ...` shows what it "
              "does", file=sys.stderr)
    history: List[Dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("kimi-hybrid chat: one message per line; /reset clears the history, /exit (or Ctrl-D) quits.",
              file=sys.stderr)
    cache = None
    turns = 0
    while True:
        if interactive:
            sys.stderr.write("you> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            if interactive:  # Ctrl-D: end the prompt line, so the shell starts on a line of its own
                sys.stderr.write("\n")
            break
        msg = line.rstrip("\n")
        if msg.strip() in ("/exit", "/quit"):
            break
        if msg.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not msg.strip():
            continue
        history.append({"role": "user", "content": msg})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                            return_tensors="pt", return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if not hasattr(ids, "shape"):
            import torch

            ids = torch.tensor([ids])
        sys.stdout.write("assistant> ")
        sys.stdout.flush()
        reply, cache = run_generation(model, tokenizer, ids, args)
        history.append({"role": "assistant", "content": reply.strip()})
        turns += 1
        if args.max_turns and turns >= args.max_turns:
            break
    print_report(cache, args)
    return 0


def _load(args):
    import torch

    device = pick_device(args.device)
    path = resolve_model(args.model)
    dtype = pick_dtype(args.dtype, device, path)
    if args.threads:
        torch.set_num_threads(args.threads)
    shown = "stored dtype" if dtype == "auto" else str(dtype).replace("torch.", "")
    print(f"kimi-hybrid: loading {path} on {device} ({shown})", file=sys.stderr)
    return load_model_and_tokenizer(path, device, dtype, args.trust_remote_code)


def check_export_out(out: str, model: str, overwrite: bool = False) -> None:
    """Refuse an ``export --out`` folder before anything is loaded or written (SystemExit, one line): the source
    model folder itself, a folder inside it or one that contains it (writing would delete the source's weights),
    a path that is a file, and a non-empty folder that is not a previous export unless ``overwrite``. A previous
    export (:func:`kimi_hybrid.app.hub.is_hub_folder`) is written over: its old weights are removed first."""
    from kimi_hybrid.app import hub

    target = Path(out).expanduser().resolve()
    source = Path(model).expanduser()
    if source.is_dir():
        source = source.resolve()
        if target == source:
            raise SystemExit(f"kimi-hybrid: --out {out} is the model folder itself; export to another folder")
        if source in target.parents:
            raise SystemExit(f"kimi-hybrid: --out {out} is inside the model folder {source}; export to a folder "
                             "outside it")
        if target in source.parents:
            raise SystemExit(f"kimi-hybrid: --out {out} contains the model folder {source}; export to a folder "
                             "that does not")
    if target.exists() and not target.is_dir():
        raise SystemExit(f"kimi-hybrid: --out {out} is a file; give a folder")
    if target.is_dir() and any(target.iterdir()) and not hub.is_hub_folder(target) and not overwrite:
        raise SystemExit(f"kimi-hybrid: --out {out} is not empty and is not a previous export; choose an empty or "
                         "new folder, or pass --overwrite to write into it")


def cmd_export(args) -> int:
    from kimi_hybrid.app import hub

    check_export_out(args.out, resolve_model(args.model), args.overwrite)
    model, tokenizer = _load(args)
    _check_exportable(model)
    try:
        folder = hub.prepare_hub_folder(model, tokenizer, args.out, repo_id=args.repo_id)
    except KeyboardInterrupt:
        print(f"\nkimi-hybrid: interrupted; {args.out} was left as it was (the export is written to a temporary "
              "folder and moved into place only when complete)", file=sys.stderr)
        return 130
    except OSError as e:
        raise SystemExit(f"kimi-hybrid: cannot write {args.out}: {_first_line(e)}") from None
    print(f"kimi-hybrid: wrote {folder}", file=sys.stderr)
    return 0


def _check_exportable(model) -> None:
    """SystemExit (one line) when the loaded model has no kimi-hybrid bundle next to its class (a folder's own
    code of another model, run with --trust-remote-code): export and push ship that bundle."""
    from kimi_hybrid.app import hub

    try:
        hub.bundle_files(model)
    except FileNotFoundError as e:
        raise SystemExit(f"kimi-hybrid: cannot export {type(model).__name__}: it is not a kimi-hybrid model with its "
                         f"bundle code ({_first_line(e, 160)}); leave out --trust-remote-code to load the folder as "
                         "KimiHybridForCausalLM") from None


def _network_errors() -> Tuple[type, ...]:
    """Exception classes of a failed Hub call: OSError (requests, huggingface_hub's offline / token / HTTP errors
    derive from it), huggingface_hub's HTTP error, and the HTTP client's own (httpx or its fork, whichever
    huggingface_hub uses)."""
    from importlib import import_module

    errors: List[type] = [OSError]
    for module, name in (("huggingface_hub.errors", "HfHubHTTPError"), ("httpx", "HTTPError"),
                         ("httpx2", "HTTPError")):
        try:
            errors.append(getattr(import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def cmd_push(args) -> int:
    from kimi_hybrid.app import hub

    model, tokenizer = _load(args)
    _check_exportable(model)
    try:
        url = hub.push(model, tokenizer, args.repo_id, private=args.private, token=args.token,
                       commit_message=args.commit_message)
    except _network_errors() as e:
        raise SystemExit(f"kimi-hybrid: cannot push to {args.repo_id!r} on the Hugging Face Hub "
                         f"({_first_line(e, 160)}); check the network and the token (hf auth login, or --token), or "
                         "write the folder with `kimi-hybrid export --out DIR` and upload it later") from None
    print(f"kimi-hybrid: pushed to {url}", file=sys.stderr)
    return 0


def _check_writable(path: str, option: str) -> None:
    """Raise SystemExit (one line) if ``path`` cannot be written: a missing or unwritable parent folder, or a path
    that is a folder. Checked before any output is printed."""
    target = Path(path).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise SystemExit(f"kimi-hybrid: cannot write {path} ({option}): it is a folder; give a file name")
    if not parent.is_dir():
        raise SystemExit(f"kimi-hybrid: cannot write {path} ({option}): no such folder {parent}; create it first")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise SystemExit(f"kimi-hybrid: cannot write {path} ({option}): permission denied")


def cmd_memory(args) -> int:
    from kimi_hybrid.app import memory

    try:
        gpu = memory.parse_size(args.gpu_mem)
        reserve = memory.parse_size(args.reserve)
        # output paths and the plot's matplotlib are checked before the table is printed
        if args.json:
            _check_writable(args.json, "--json")
        if args.plot:
            _check_writable(args.plot, "--plot")
            memory.require_matplotlib()
        config = memory.load_config(preset=args.preset, config=args.config, model=args.model)
        name = args.preset or str(args.config or args.model)
        plan = memory.make_plan(config, name, gpu, args.context, weights_dtype=args.weights_dtype,
                                cache_dtype=args.cache_dtype, reserve_bytes=reserve)
        print(memory.format_plan(plan), flush=True)
        if args.json:
            try:
                Path(args.json).expanduser().write_text(json.dumps(plan.to_dict(), indent=2) + "\n",
                                                        encoding="utf-8")
            except OSError as e:
                raise SystemExit(f"kimi-hybrid: cannot write {args.json}: {_first_line(e)}") from None
        if args.plot:
            try:
                memory.plot_plan(plan, str(Path(args.plot).expanduser()),
                                 max_context=max(args.plot_max_context, 1024))
            except OSError as e:
                raise SystemExit(f"kimi-hybrid: cannot write {args.plot}: {_first_line(e)}") from None
            print(f"kimi-hybrid: wrote {args.plot}", file=sys.stderr)
    except memory.PlanError as e:
        raise SystemExit(f"kimi-hybrid: {e}") from None
    return 0


# ---------------------------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------------------------

DTYPE_CHOICES = "auto, stored, float32 (fp32), bfloat16 (bf16), float16 (fp16)"
DTYPE_HELP = "auto (bf16 on CUDA, fp32 on CPU), stored (the dtype the checkpoint was saved in), float32, bfloat16, " \
             "float16"


def _model_args(p: argparse.ArgumentParser, dtype_default: str = "auto") -> None:
    p.add_argument("--model", default=None,
                   help=f"folder or Hub repo id (default: the embedded {EMBEDDED_MODEL_NAME} model)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=dtype_default, help=f"{DTYPE_HELP} (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="use the bundle code inside the checkpoint folder instead of the installed package")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")


DECODING_HELP = (
    "Decoding: greedy with --repetition-penalty {repetition_penalty} and --no-repeat-ngram-size "
    "{no_repeat_ngram_size} by default: plain greedy decoding of the embedded model loops (over six prompts 10% of "
    "the 4-grams of a 200-token completion are distinct, 90% with these defaults); --sample samples with "
    "--temperature / --top-p / --top-k instead."
).format(**DEFAULT_DECODING)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="most tokens to generate, >= 1 (default: %(default)s)")
    p.add_argument("--sample", action="store_true",
                   help="sample with --temperature / --top-p / --top-k instead of decoding greedily")
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding (the default; overrides --sample, same as --temperature 0)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature with --sample, >= 0; 0 means greedy decoding (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="with --sample: keep the smallest set of tokens with this total probability, in (0, 1] "
                        "(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=50,
                   help="with --sample: sample among the k most likely tokens, >= 0; 0 disables it "
                        "(default: %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=DEFAULT_DECODING["repetition_penalty"],
                   help="penalise tokens already in the text (a score is divided by it if positive, multiplied if "
                        "negative), > 0; 1.0 disables it "
                        "(default: %(default)s)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=DEFAULT_DECODING["no_repeat_ngram_size"],
                   help="never repeat an n-gram of this many tokens, >= 0; 0 disables it (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of torch's random generator, for reproducible --sample output (default: %(default)s)")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming it")
    p.add_argument("--no-memory-report", action="store_true", help="do not print the cache memory table")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("kimi-hybrid")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout that is not installed
        ours = "unknown (not installed)"
    parts = [f"kimi-hybrid {ours}"]
    for dist in ("transformers", "torch"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:  # pragma: no cover
            pass
    return ", ".join(parts)


class _VersionAction(argparse.Action):
    """``--version``: print the package, transformers and torch versions (read lazily: no torch import)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors (an option value of the wrong type, a missing or unknown option) follow the
    CLI's rule for user errors: one line ``kimi-hybrid: <message> (see <prog> --help)`` and exit status 1, instead
    of argparse's usage block and status 2. ``add_subparsers`` builds the subcommand parsers with this class too."""

    def error(self, message: str):
        raise SystemExit(f"kimi-hybrid: {message} (see {self.prog} --help)")


def _join_negative_values(argv: List[str]) -> List[str]:
    """``--opt -5GB`` -> ``--opt=-5GB``: argparse reads a value starting with ``-`` that is not a plain number
    (``-5GB``, ``-1e3``) as an option and reports "expected one argument"; joined, the value reaches the option's
    own check, which says what is wrong with it (e.g. a size must be positive). Only ``--long`` options without
    ``=`` followed by a token of the form ``-<digit>...`` or ``-.<digit>...`` are joined."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if (tok.startswith("--") and "=" not in tok and i + 1 < len(argv)
                and re.match(r"-\.?[0-9]", argv[i + 1])):
            out.append(f"{tok}={argv[i + 1]}")
            i += 2
            continue
        out.append(tok)
        i += 1
    return out


def _preset_help() -> str:
    from kimi_hybrid.conversion.config_io import PRESET_ALIASES, RELEASED_PRESETS

    return f"{', '.join(RELEASED_PRESETS)} (aliases: {', '.join(PRESET_ALIASES)})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kimi-hybrid", description="Generate and chat with KimiHybrid models (KDA + MLA + MoE), export them, "
        "and plan their cache memory.", epilog=DECODING_HELP)
    parser.add_argument("--version", action=_VersionAction, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter
    g = sub.add_parser("generate", help="stream a completion of --prompt (or of stdin)", epilog=DECODING_HELP)
    g.add_argument("--prompt", default=None, help="prompt text (default: read stdin)")
    g.add_argument("--echo-prompt", action="store_true", help="print the prompt before the completion")
    g.add_argument("--no-heal", action="store_true",
                   help="do not heal a prompt that ends inside a token (by default the last prompt token is taken "
                        "back and the first generated tokens re-spell it, e.g. 'def f(x):' continues as "
                        "'def f(x):\\n')")
    _model_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with the chat template (one message per stdin line)",
                       epilog=DECODING_HELP + " A model whose generation_config.json says \"chat_trained\": false "
                       "(the embedded one) is told apart at start: it continues text, it is not an assistant.")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--max-turns", type=int, default=0, help="stop after this many replies (0 = until EOF)")
    _model_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)
    e = sub.add_parser("export", help="write a self-contained Hub folder (code, weights, tokenizer, card)")
    e.add_argument("--out", required=True,
                   help="folder to write (created if needed); it must be new, empty or a previous export, and not "
                        "the model folder")
    e.add_argument("--overwrite", action="store_true",
                   help="write into a non-empty --out that is not a previous export (files of the same names are "
                        "replaced, old weights removed)")
    e.add_argument("--repo-id", default=None, help="name used in the model card")
    _model_args(e, dtype_default="stored")
    e.set_defaults(func=cmd_export)
    u = sub.add_parser("push", help="upload a self-contained Hub folder to the Hugging Face Hub")
    u.add_argument("--repo-id", required=True)
    u.add_argument("--private", action="store_true")
    u.add_argument("--token", default=None, help="Hub token (default: the logged-in one)")
    u.add_argument("--commit-message", default="Upload KimiHybrid model")
    _model_args(u, dtype_default="stored")
    u.set_defaults(func=cmd_push)
    m = sub.add_parser(
        "memory", help="plan the cache memory of a model on a GPU (bytes per token / sequence, largest context "
        "and batch, compared with all-MLA and MHA)", formatter_class=fmt, description=(
            "Cache memory of a KimiHybrid model on one GPU. Give a preset, a config.json or a model folder.\n"
            "Per sequence the cache holds a fixed KDA part (fp32 recurrent state + conv windows) and the MLA\n"
            "latents (kv_lora_rank + qk_rope_head_dim values per token and MLA layer); the figures equal\n"
            "KimiHybridCache.memory_report(). Weights = parameters (model built on the meta device) x\n"
            "--weights-dtype. The same model with every layer MLA and with plain MHA\n"
            "(num_attention_heads x (qk_head_dim + v_head_dim) per token and layer) are shown for comparison."))
    src = m.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help=_preset_help())
    src.add_argument("--config", default=None, help="a config.json (ours, released Kimi-Linear or K3)")
    src.add_argument("--model", default=None, help="a model folder (its config.json)")
    m.add_argument("--gpu-mem", default="141GB",
                   help="GPU memory: 141GB (decimal units), 80GiB (binary units), ... (default: %(default)s, an H200)")
    m.add_argument("--context", type=int, default=131072,
                   help="context length (tokens) of the largest-batch answer (default: %(default)s)")
    m.add_argument("--weights-dtype", default="bfloat16",
                   help="bytes per weight: bfloat16, float16, float32, fp8, int8, int4, mxfp4, or none (weights not "
                        "on this GPU) (default: %(default)s)")
    m.add_argument("--cache-dtype", default="bfloat16",
                   help="dtype of the latents, conv windows and hidden state: bfloat16, float16, float32; the KDA "
                        "state is fp32 whatever this says (default: %(default)s)")
    m.add_argument("--reserve", default="0",
                   help="memory kept for activations / workspace, e.g. 8GiB (default: %(default)s)")
    m.add_argument("--plot", default=None,
                   help="write a PNG of weights + cache against context, the three caches and the GPU size "
                        "(needs matplotlib: pip install -e \".[bench]\")")
    m.add_argument("--plot-max-context", type=int, default=1 << 20,
                   help="right end of the plot, tokens (default: %(default)s)")
    m.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    m.set_defaults(func=cmd_memory)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Reject out-of-range option values up front, before anything is loaded: raises SystemExit with a one-line
    ``kimi-hybrid: ...`` message (exit status 1) instead of letting torch / transformers fail later with a
    traceback. Options a subcommand does not have are skipped."""

    def has(name: str) -> bool:
        return getattr(args, name, None) is not None

    # written as "not (valid)" so that NaN is rejected too
    if has("max_new_tokens") and not args.max_new_tokens >= 1:
        raise SystemExit(f"kimi-hybrid: --max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if has("temperature") and not args.temperature >= 0:
        raise SystemExit(f"kimi-hybrid: --temperature must be >= 0 (0 means greedy decoding; got {args.temperature})")
    if has("top_p") and not 0 < args.top_p <= 1:
        raise SystemExit(f"kimi-hybrid: --top-p must be in (0, 1] (got {args.top_p})")
    if has("top_k") and not args.top_k >= 0:
        raise SystemExit(f"kimi-hybrid: --top-k must be >= 0 (0 disables it; got {args.top_k})")
    if has("repetition_penalty") and not args.repetition_penalty > 0:
        raise SystemExit(f"kimi-hybrid: --repetition-penalty must be > 0 (1.0 disables it; got "
                         f"{args.repetition_penalty})")
    if has("no_repeat_ngram_size") and not args.no_repeat_ngram_size >= 0:
        raise SystemExit(f"kimi-hybrid: --no-repeat-ngram-size must be >= 0 (0 disables it; got "
                         f"{args.no_repeat_ngram_size})")
    if has("threads") and not args.threads >= 0:
        raise SystemExit(f"kimi-hybrid: --threads must be >= 0 (0 = torch's default; got {args.threads})")
    if has("max_turns") and not args.max_turns >= 0:
        raise SystemExit(f"kimi-hybrid: --max-turns must be >= 0 (0 = until end of input; got {args.max_turns})")
    if has("context") and not args.context >= 1:
        raise SystemExit(f"kimi-hybrid: --context must be >= 1 token (got {args.context})")
    if getattr(args, "repo_id", None) is not None:
        check_repo_id(args.repo_id)
    if getattr(args, "greedy", False):
        args.sample = False


def check_repo_id(repo_id: str) -> None:
    """Refuse a malformed Hub repo id (``--repo-id``) before anything is loaded: huggingface_hub's own rule
    (``name`` or ``owner/name``, letters, digits, ``-``, ``_``, ``.``, at most 96 characters). SystemExit, one
    line."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise SystemExit(f"kimi-hybrid: --repo-id {repo_id!r} is not a Hub repo id ({_first_line(e, 200)}); write "
                         "owner/name, e.g. me/kimi-hybrid-tiny") from None


OUT_OF_MEMORY_HINT = ("use a shorter prompt or fewer --max-new-tokens, --dtype bfloat16, or a machine (GPU) with more "
                      "memory; `kimi-hybrid memory --model MODEL` shows what the cache needs")


def is_out_of_memory(e: BaseException) -> bool:
    """torch's allocation failures: ``torch.OutOfMemoryError`` (CUDA) and the CPU allocator's RuntimeError
    (``DefaultCPUAllocator: can't allocate memory``), or a MemoryError."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (``| head``): point stdout at /dev/null, so that the interpreter's final flush does
    not fail again, and exit with 141 (128 + SIGPIPE) as a CLI killed by SIGPIPE does, printing nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


def main(argv: Optional[List[str]] = None) -> int:
    """The ``kimi-hybrid`` command. Returns the exit status: 0, 1 (a user error, one ``kimi-hybrid: ...`` line on
    stderr, raised as SystemExit), 130 (Ctrl-C, one line) or 141 (stdout closed by its reader, silent)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (the start-up handler of kimi_hybrid/__init__)
    try:
        args = build_parser().parse_args(_join_negative_values(sys.argv[1:] if argv is None else list(argv)))
        check_args(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\nkimi-hybrid: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except SystemExit:
        raise
    except Exception as e:  # a bug, not a user error: say so on one line unless asked for the traceback
        if os.environ.get("KIMI_HYBRID_DEBUG"):
            raise
        if is_out_of_memory(e):
            raise SystemExit(f"kimi-hybrid: out of memory ({_first_line(e, 160)}): {OUT_OF_MEMORY_HINT}") from None
        raise SystemExit(f"kimi-hybrid: unexpected {type(e).__name__}: {_first_line(e)} (set KIMI_HYBRID_DEBUG=1 "
                         "for the traceback; please report it)") from None


if __name__ == "__main__":
    sys.exit(main())
