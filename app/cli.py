"""``kimi-hybrid``: generate and chat with a KimiHybrid model from the command line.

Subcommands:

* ``generate --prompt TEXT``: stream a completion of the prompt;
* ``chat``: an interactive chat (one user message per line on stdin; ``/reset`` clears the history, ``/exit`` or
  end of input ends it), rendered with the tokenizer's chat template;
* ``export --out DIR`` / ``push --repo-id NAME``: write a self-contained Hub folder (bundle code, weights,
  tokenizer, model card) / upload it (see :mod:`kimi_hybrid.app.hub`); by default the weights keep the dtype the
  source checkpoint was saved in (``--dtype stored``).

Option values are checked before anything is loaded; user errors (an out-of-range option, no CUDA for
``--device cuda``, an invalid config.json) end with a one-line ``kimi-hybrid: ...`` message and exit status 1.

The default model is the embedded one, ``models/kimi-hybrid-stdlib`` next to the sources (a ~14M-parameter 3:1
KDA:MLA MoE model trained on the CPython standard library: it writes Python-like text, it is not an assistant).
``--model PATH_OR_REPO`` loads any checkpoint in our layout (a folder or a Hub repo id); ``--trust-remote-code``
lets a Hub folder's own bundle code be used instead of the installed package.

After each generation the cache memory of :class:`KimiHybridCache` (``cache.memory_report()``) is printed as a
table: KDA layers hold a constant conv window + fp32 state, MLA layers a latent that grows per token.

``python -m kimi_hybrid.app.cli`` (installed package) and ``python -m app.cli`` (source checkout) work as well.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL_NAME = "kimi-hybrid-stdlib"
ENV_DEFAULT_MODEL = "KIMI_HYBRID_DEFAULT_MODEL"


# ---------------------------------------------------------------------------------------------------------------
# locating and loading
# ---------------------------------------------------------------------------------------------------------------

def import_bundle():
    """Import the model package ``kimi_hybrid`` (which registers the Auto classes) and return it."""
    import kimi_hybrid as bundle

    return bundle


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
        raise SystemExit(f"kimi-hybrid: unknown --dtype {name!r}") from None


def _read_tokenizer_class(model: str) -> Optional[str]:
    cfg = Path(model) / "tokenizer_config.json"
    if cfg.is_file():
        try:
            return json.loads(cfg.read_text(encoding="utf-8")).get("tokenizer_class")
        except (OSError, ValueError):
            return None
    return None


def load_config(model: str, trust_remote_code: bool = False):
    """The model's config (``AutoConfig``). Raises SystemExit with ``invalid model config in <path>: <reason>`` when
    config.json is not valid JSON or the config class rejects it (its ValueError names the field, e.g.
    ``layer_types has 5 entries but num_hidden_layers is 8``)."""
    from transformers import AutoConfig

    cfg_file = Path(model) / "config.json"
    if cfg_file.is_file():
        try:
            json.loads(cfg_file.read_text(encoding="utf-8"))
        except ValueError as e:
            raise SystemExit(f"kimi-hybrid: invalid model config in {model}: config.json is not valid JSON ({e})") \
                from None
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise SystemExit(f"kimi-hybrid: invalid model config in {model}: {e}") from None


def load_model_and_tokenizer(model: str, device: str, dtype, trust_remote_code: bool = False):
    """Load ``(model, tokenizer)``; the model is put in eval mode on ``device`` in ``dtype``.

    The tokenizer of a local folder whose ``tokenizer_config.json`` names ``KimiHybridTokenizer`` is built from the
    installed class (no remote code needed); anything else goes through ``AutoTokenizer``.
    """
    bundle = import_bundle()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = load_config(model, trust_remote_code)
    if _read_tokenizer_class(model) == "KimiHybridTokenizer" and not trust_remote_code:
        from importlib import import_module

        tok_mod = import_module(bundle.__name__ + ".tokenization_kimi_hybrid")
        tokenizer = tok_mod.KimiHybridTokenizer.from_pretrained(model)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    lm = AutoModelForCausalLM.from_pretrained(model, config=config, dtype=dtype, trust_remote_code=trust_remote_code)
    lm.to(device).eval()
    return lm, tokenizer


# ---------------------------------------------------------------------------------------------------------------
# memory report
# ---------------------------------------------------------------------------------------------------------------

def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_memory_report(report: Dict[str, Any]) -> str:
    """A small table of ``KimiHybridCache.memory_report()``: bytes per layer type, the total, and the formula parts
    (constant KDA state, MLA bytes per token)."""
    per_layer: List[Tuple[str, int]] = list(report.get("per_layer", []))
    n_kda = sum(t == "linear_attention" for t, _ in per_layer)
    n_mla = sum(t == "full_attention" for t, _ in per_layer)
    rows = [
        ("KDA conv + fp32 state", str(n_kda), report["kda_bytes"], "constant"),
        ("MLA latent", str(n_mla), report["mla_bytes"], f"{report['mla_bytes_per_token']} B/token"),
        ("key-padding mask", "-", report["mask_bytes"], "1 B/token"),
    ]
    if report.get("hidden_bytes"):
        rows.append(("last hidden state", "-", report["hidden_bytes"], "1 per row"))
    if report.get("rollback_bytes"):
        rows.append(("rollback records", "-", report["rollback_bytes"], "assisted decoding"))
    rows.append(("total", str(n_kda + n_mla), report["total_bytes"], ""))
    head = (f"cache memory (KimiHybridCache.memory_report): {report['seen_tokens']} tokens, "
            f"batch {report['batch_size']}")
    w0 = max(len(r[0]) for r in rows + [("layer type", "", 0, "")])
    lines = [head, f"  {'layer type':<{w0}}  {'layers':>6}  {'bytes':>12}  {'human':>10}  note",
             f"  {'-' * w0}  {'-' * 6}  {'-' * 12}  {'-' * 10}  {'-' * 16}"]
    for name, layers, nbytes, note in rows:
        lines.append(f"  {name:<{w0}}  {layers:>6}  {nbytes:>12,}  {_human(nbytes):>10}  {note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------------

def generation_kwargs(args, tokenizer) -> Dict[str, Any]:
    kw: Dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if args.greedy or args.temperature == 0:  # temperature 0 means greedy decoding
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        kw.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.repetition_penalty and args.repetition_penalty != 1.0:
        kw["repetition_penalty"] = args.repetition_penalty
    return kw


def run_generation(model, tokenizer, input_ids, args, out=None):
    """Generate (streaming the new text to ``out`` unless ``--no-stream``); returns ``(text, cache)``."""
    import torch
    from transformers import TextStreamer

    out = out or sys.stdout
    streamer = None
    if not args.no_stream:
        streamer = _Streamer(tokenizer, out)
    torch.manual_seed(args.seed)
    input_ids = input_ids.to(model.device)
    res = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                         return_dict_in_generate=True, **generation_kwargs(args, tokenizer))
    new = res.sequences[0, input_ids.shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True)
    if args.no_stream:
        out.write(text)
    out.write("\n")
    out.flush()
    return text, res.past_key_values


class _Streamer:
    """``TextStreamer`` that writes to a given stream (transformers' prints to stdout)."""

    def __init__(self, tokenizer, out):
        from transformers import TextStreamer

        class Inner(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False):
                out.write(text)
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


def cmd_generate(args) -> int:
    model, tokenizer = _load(args)
    prompt = args.prompt
    if prompt is None:
        prompt = sys.stdin.read()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        ids = _bos(tokenizer)
    if args.echo_prompt:
        sys.stdout.write(prompt)
    _, cache = run_generation(model, tokenizer, ids, args)
    print_report(cache, args)
    return 0


def _bos(tokenizer):
    import torch

    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return torch.tensor([[start]])


def cmd_chat(args) -> int:
    model, tokenizer = _load(args)
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


def cmd_export(args) -> int:
    from importlib import import_module

    hub = import_module((__package__ or "app") + ".hub")
    model, tokenizer = _load(args)
    folder = hub.prepare_hub_folder(model, tokenizer, args.out, repo_id=args.repo_id)
    print(f"kimi-hybrid: wrote {folder}", file=sys.stderr)
    return 0


def cmd_push(args) -> int:
    from importlib import import_module

    hub = import_module((__package__ or "app") + ".hub")
    model, tokenizer = _load(args)
    url = hub.push(model, tokenizer, args.repo_id, private=args.private, token=args.token,
                   commit_message=args.commit_message)
    print(f"kimi-hybrid: pushed to {url}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------------------------

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


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="most tokens to generate, >= 1 (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature, >= 0; 0 means greedy decoding (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="nucleus sampling: keep the smallest set of tokens with this total probability, in (0, 1] "
                        "(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=50,
                   help="sample among the k most likely tokens, >= 0; 0 disables it (default: %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalty on tokens already present, > 0; 1.0 disables it (default: %(default)s)")
    p.add_argument("--greedy", action="store_true",
                   help="greedy decoding (ignores the sampling options; same as --temperature 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming it")
    p.add_argument("--no-memory-report", action="store_true", help="do not print the cache memory table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kimi-hybrid", description="Generate and chat with KimiHybrid models (KDA + MLA + MoE).")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion of --prompt (or of stdin)")
    g.add_argument("--prompt", default=None, help="prompt text (default: read stdin)")
    g.add_argument("--echo-prompt", action="store_true", help="print the prompt before the completion")
    _model_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with the chat template (one message per stdin line)")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--max-turns", type=int, default=0, help="stop after this many replies (0 = until EOF)")
    _model_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)
    e = sub.add_parser("export", help="write a self-contained Hub folder (code, weights, tokenizer, card)")
    e.add_argument("--out", required=True)
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
    if has("threads") and not args.threads >= 0:
        raise SystemExit(f"kimi-hybrid: --threads must be >= 0 (0 = torch's default; got {args.threads})")
    if has("max_turns") and not args.max_turns >= 0:
        raise SystemExit(f"kimi-hybrid: --max-turns must be >= 0 (0 = until end of input; got {args.max_turns})")


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
