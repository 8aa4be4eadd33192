#!/usr/bin/env python
"""Fine-tune a KimiHybrid model with LoRA on one CPython stdlib package and report held-out loss before / after.

The task. The default model (``models/kimi-hybrid-stdlib``) was pre-trained on the *train* split of the stdlib
corpus built by ``examples/prepare_stdlib_corpus.py``; a few packages are held out of it by module name (see that
model's ``corpus_manifest.json``). This script takes one held-out package (default ``multiprocessing``, 23 files the
base model never saw), splits its files deterministically into fine-tuning files and evaluation files (sha1 of
the path; ``--eval-frac``), fine-tunes a LoRA adapter on the first and reports the token-level cross-entropy on
the second before and after: does the adapter learn the package's idioms and vocabulary in a way that carries to
unseen files of the same package?

Data. Files are read from the running interpreter's stdlib with the corpus builder's exclusion rules, each prefixed
by the corpus separator line, tokenized with the model's tokenizer, ended by EOS, and cut into chunks of at most
``--seq-len`` tokens. Training batches pack several chunks into one row with ``DataCollatorWithFlattening``
(``position_ids`` restarting at 0: no attention or KDA state crosses a chunk boundary). Evaluation packs the same
way; the loss is the mean over every predicted token of the evaluation files.

Then: the adapter is saved (``adapter_config.json``, ``adapter_model.safetensors``, ``README.md`` and the
tokenizer: ready for ``push_to_hub``), merged into the base weights with ``merge_and_unload()`` and saved with the
bundle code, and both the adapted model and the merged model generate greedily from a prompt (the tokens must be
equal). A JSON report is written to ``OUT/report.json``.

Usage:
    python examples/finetune_lora.py --model models/kimi-hybrid-stdlib --out out/lora-multiprocessing
    python examples/finetune_lora.py --package logging --steps 100 --seq-len 512
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from kimi_hybrid.app.lora import merge_and_save, packing_collator, recommended_lora_config

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_MODEL = "models/kimi-hybrid-stdlib"


def _corpus_module():
    import prepare_stdlib_corpus  # the sibling script (examples/ is on sys.path: the folder of the script run)

    return prepare_stdlib_corpus


def package_files(package: str, eval_frac: float):
    """``(train_files, eval_files)``: ``[(relpath, text)]`` of one stdlib package, split by sha1 of the path (at
    least one file on each side when the package has two or more)."""
    corpus = _corpus_module()
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    rels = [r for r in corpus.list_stdlib_files(root) if corpus.module_of(r) == package]
    if len(rels) < 2:
        raise SystemExit(f"package {package!r} has {len(rels)} file(s) in {root}; pick one with several files")
    key = {r: int(hashlib.sha1(f"lora-eval:{r}".encode()).hexdigest(), 16) % 10000 for r in rels}
    ev = [r for r in rels if key[r] < eval_frac * 10000]
    if not ev:
        ev = [min(rels, key=key.get)]
    if len(ev) == len(rels):
        ev = ev[:-1]
    tr = [r for r in rels if r not in ev]

    def read(rs):
        out = []
        for r in rs:
            try:
                out.append((r, corpus.SEPARATOR.format(path=r) + (root / r).read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                continue
        return out

    return read(tr), read(ev)


def chunks(tokenizer, files, seq_len: int, max_tokens=None):
    """Token chunks of at most ``seq_len`` (at least 2 tokens), file by file, EOS after each file."""
    out, total = [], 0
    for _, text in files:
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + [tokenizer.eos_token_id]
        for i in range(0, len(ids), seq_len):
            c = ids[i:i + seq_len]
            if len(c) >= 2:
                out.append(c)
                total += len(c)
            if max_tokens and total >= max_tokens:
                return out
    return out


@torch.no_grad()
def heldout_loss(model, eval_chunks, rows_per_batch: int, device) -> float:
    """Mean next-token cross-entropy over every predicted token of ``eval_chunks`` (chunks packed per batch)."""
    model.eval()
    collate = packing_collator()
    loss_sum, count = 0.0, 0
    for i in range(0, len(eval_chunks), rows_per_batch):
        batch = collate([{"input_ids": c} for c in eval_chunks[i:i + rows_per_batch]])
        n = int((batch["labels"][:, 1:] != -100).sum())
        out = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
        loss_sum += out.loss.float().item() * n
        count += n
    return loss_sum / max(count, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="base model folder (default %(default)s)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model, else the stdlib one)")
    ap.add_argument("--package", default="multiprocessing", help="stdlib package to fine-tune on")
    ap.add_argument("--eval-frac", type=float, default=0.25, help="fraction of the package's files held out")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8, help="chunks per step (packed into one row)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--include-gates", action="store_true")
    ap.add_argument("--no-checkpointing", action="store_true", help="turn gradient checkpointing off")
    ap.add_argument("--max-train-tokens", type=int, default=None)
    ap.add_argument("--max-eval-tokens", type=int, default=65536)
    ap.add_argument("--prompt", default="from multiprocessing import")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="out/lora-stdlib")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok_path = args.tokenizer
    if tok_path is None:
        tok_path = args.model if (Path(args.model) / "tokenizer_config.json").exists() else str(ROOT / DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    if model.config.vocab_size < len(tokenizer):
        raise SystemExit(f"the model's vocab ({model.config.vocab_size}) is smaller than the tokenizer's "
                         f"({len(tokenizer)})")

    report = {"model": str(args.model), "package": args.package, "device": str(device), "dtype": str(dtype)}
    manifest = Path(args.model) / "corpus_manifest.json"
    if manifest.exists():
        splits = json.loads(manifest.read_text())["splits"]
        report["package_in_base_training"] = args.package in splits.get("train", {}).get("modules", {})
        if report["package_in_base_training"]:
            print(f"note: {args.package} was in the base model's training split; the task is then not held out")

    train_files, eval_files = package_files(args.package, args.eval_frac)
    train_chunks = chunks(tokenizer, train_files, args.seq_len, args.max_train_tokens)
    eval_chunks = chunks(tokenizer, eval_files, args.seq_len, args.max_eval_tokens)
    report.update(train_files=[r for r, _ in train_files], eval_files=[r for r, _ in eval_files],
                  train_tokens=sum(map(len, train_chunks)), eval_tokens=sum(map(len, eval_chunks)))
    print(f"{args.package}: fine-tune on {len(train_files)} files ({report['train_tokens']} tokens), evaluate on "
          f"{len(eval_files)} held-out files ({report['eval_tokens']} tokens)")

    t = time.perf_counter()
    report["heldout_loss_before"] = heldout_loss(model, eval_chunks, args.batch_size, device)
    print(f"held-out loss before: {report['heldout_loss_before']:.4f} "
          f"(ppl {math.exp(report['heldout_loss_before']):.2f}, {time.perf_counter() - t:.1f}s)")

    lora_cfg = recommended_lora_config(model.config, r=args.rank, alpha=args.alpha, include_gates=args.include_gates)
    pm = get_peft_model(model, lora_cfg)
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    report["trainable_params"] = trainable
    targs = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 20), weight_decay=0.0,
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[], seed=args.seed,
        use_cpu=device.type != "cuda", bf16=device.type == "cuda", gradient_checkpointing=not args.no_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=pm, args=targs, train_dataset=[{"input_ids": c} for c in train_chunks],
                      data_collator=packing_collator())
    t = time.perf_counter()
    trainer.train()
    report["train_s"] = round(time.perf_counter() - t, 1)
    report["train_log"] = [h for h in trainer.state.log_history if "loss" in h]
    report["heldout_loss_after"] = heldout_loss(pm, eval_chunks, args.batch_size, device)
    print(f"held-out loss after:  {report['heldout_loss_after']:.4f} "
          f"(ppl {math.exp(report['heldout_loss_after']):.2f}); trained {args.steps} steps in {report['train_s']}s")

    adapter_dir = out / "adapter"
    pm.save_pretrained(str(adapter_dir))
    tokenizer.save_pretrained(str(adapter_dir))
    report["adapter_dir"] = str(adapter_dir)

    prompt = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    pm.eval()
    with torch.no_grad():
        adapted_ids = pm.generate(input_ids=prompt, **gen_kw)
    merged = merge_and_save(pm, str(out / "merged"), tokenizer=tokenizer)
    merged.eval()
    with torch.no_grad():
        merged_ids = merged.generate(input_ids=prompt, **gen_kw)
    report["merged_dir"] = str(out / "merged")
    report["generation"] = tokenizer.decode(merged_ids[0], skip_special_tokens=True)
    report["adapter_generation_equals_merged"] = bool(torch.equal(adapted_ids, merged_ids))
    print("--- generation (merged model, greedy) ---")
    print(report["generation"])
    print(f"adapter and merged generations equal: {report['adapter_generation_equals_merged']}")
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
