#!/usr/bin/env python
"""Train a byte-level BPE on the stdlib train split and export it in the Kimi tiktoken format.

Training uses the Hugging Face ``tokenizers`` library (BPE model + BpeTrainer). The pre-tokenizer is the Kimi / K2
``pat_str`` (``KIMI_PAT_STR`` in modeling_kimi_hybrid/tokenization_kimi_hybrid.py, source cited there) followed by
the GPT-2 byte-level mapping, so the learned merges are exactly those tiktoken applies with the same regex.

Export: HF byte-level token strings use the GPT-2 byte<->unicode alphabet; they are mapped back to raw bytes.
Ranks: byte ``b`` gets rank ``b``; the i-th learned merge gets rank ``256 + i`` (tiktoken applies the lowest rank
first, HF the earliest merge first, so both agree). The export is verified: tiktoken ids == HF ids on held-out text.

Writes to ``--out``: ``tiktoken.model``, ``tokenizer_config.json``, ``special_tokens_map.json``.

Usage:
  python examples/train_tokenizer.py --train data/stdlib/train.txt --heldout data/stdlib/heldout.txt \\
      --out models/kimi-hybrid-stdlib --n-ranks 8192
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from kimi_hybrid import tokenization_kimi_hybrid as tk

AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi_hybrid.KimiHybridTokenizer", None]}


def iter_documents(path: Path, separator_prefix: str = "\n# <file: "):
    """Yield the corpus text in file-sized pieces (the trainer counts pre-tokenized words per piece)."""
    text = path.read_text(encoding="utf-8")
    start = 0
    while start < len(text):
        nxt = text.find(separator_prefix, start + 1)
        nxt = len(text) if nxt < 0 else nxt
        yield text[start:nxt]
        start = nxt


def train_bpe(train_file: Path, n_ranks: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tk.KIMI_PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_ranks,
        min_frequency=2,
        show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(iter_documents(train_file), trainer=trainer)
    return tokenizer


def export_ranks(tokenizer: Tokenizer) -> dict[bytes, int]:
    """HF BPE (GPT-2 alphabet strings + ordered merges) -> tiktoken ``{token_bytes: rank}``."""
    model = json.loads(tokenizer.to_str())["model"]
    byte_decoder = {char: byte for byte, char in tk.bytes_to_unicode().items()}

    def raw(token: str) -> bytes:
        return bytes(byte_decoder[char] for char in token)

    ranks = {bytes([b]): b for b in range(256)}
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        token = raw(left) + raw(right)
        if token in ranks:
            raise RuntimeError(f"merge produces an existing token {token!r}")
        ranks[token] = len(ranks)
    vocab_bytes = {raw(token) for token in model["vocab"]}
    if vocab_bytes != set(ranks):
        raise RuntimeError("HF vocab and exported ranks differ")
    return ranks


def tokenizer_config(n_ranks: int, chat_format: str, model_max_length: int) -> dict:
    layout = tk.SPECIAL_LAYOUTS[chat_format]
    decoder = {}
    for offset in range(tk.NUM_RESERVED_SPECIAL_TOKENS):
        token_id = n_ranks + offset
        name = layout.get(offset, f"<|reserved_token_{token_id}|>")
        decoder[str(token_id)] = {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": name not in tk._NON_SPECIAL_NAMES,
        }
    return {
        "tokenizer_class": "KimiHybridTokenizer",
        "auto_map": AUTO_MAP,
        "chat_format": chat_format,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": decoder,
        "chat_template": tk.CHAT_TEMPLATES[chat_format],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", default="data/stdlib/train.txt")
    parser.add_argument("--heldout", default="data/stdlib/heldout.txt")
    parser.add_argument("--out", default="models/kimi-hybrid-stdlib")
    parser.add_argument("--n-ranks", type=int, default=8192, help="BPE ranks including the 256 single bytes")
    parser.add_argument("--chat-format", default="kimi-linear", choices=list(tk.CHAT_FORMATS))
    parser.add_argument("--model-max-length", type=int, default=8192)
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = train_bpe(Path(args.train), args.n_ranks)
    ranks = export_ranks(hf)
    if len(ranks) != args.n_ranks:
        raise RuntimeError(f"trained {len(ranks)} ranks, wanted {args.n_ranks} (corpus too small?)")
    tk.write_ranks(ranks, str(out / "tiktoken.model"))

    config = tokenizer_config(args.n_ranks, args.chat_format, args.model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {key: config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    special_map["additional_special_tokens"] = [
        entry["content"]
        for entry in config["added_tokens_decoder"].values()
        if entry["special"] and entry["content"] not in special_map.values()
        and not entry["content"].startswith("<|reserved_token_")
    ]
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")

    # Verify the export: HF and tiktoken must give identical ids on held-out text, and the tokenizer must load.
    tok = tk.KimiHybridTokenizer.from_pretrained(str(out))
    heldout = Path(args.heldout).read_text(encoding="utf-8")
    sample = heldout[:300_000]
    hf_ids = hf.encode(sample).ids
    ours = tok.encode_ids(sample, allow_special=False)
    hf_to_rank = {i: ranks[bytes(tk_byte for tk_byte in _raw(hf.id_to_token(i)))] for i in set(hf_ids)}
    if [hf_to_rank[i] for i in hf_ids] != ours:
        raise RuntimeError("tiktoken export disagrees with the HF tokenizer on held-out text")
    n_tokens = len(tok.encode_ids(heldout, allow_special=False))
    n_bytes = len(heldout.encode("utf-8"))
    print(f"wrote {out}: {len(ranks)} ranks, vocab_size {tok.vocab_size}")
    print(f"held-out: {n_bytes:,} bytes, {n_tokens:,} tokens, {n_bytes / n_tokens:.3f} bytes/token")


_BYTE_DECODER = {char: byte for byte, char in tk.bytes_to_unicode().items()}


def _raw(token: str) -> list[int]:
    return [_BYTE_DECODER[char] for char in token]


if __name__ == "__main__":
    main()
