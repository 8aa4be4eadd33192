#!/usr/bin/env python
"""Build an offline text corpus from the CPython standard library of the running interpreter.

What goes in:
  every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, read as UTF-8.

What is left out (and why):
  * ``site-packages/`` and ``dist-packages/``: third-party code, not the stdlib, and it differs per machine.
  * every directory named ``test``, ``tests``, ``idle_test`` or ``__pycache__`` at any depth. That drops the
    top-level ``test`` package (CPython's regression suite) and the suites embedded in packages
    (``idlelib/idle_test``, ``lib2to3/tests``, ``ctypes/test``, ``unittest/test``, ``tkinter/test``, ...).
    ``lib2to3/tests/data`` also holds deliberately malformed files. Test suites are large and repetitive, and
    they would dominate the corpus.
  * files that are not valid UTF-8 (a few encoding fixtures); their paths are listed in the manifest.

Split:
  by *module*, i.e. the first path component under the stdlib root (``json/decoder.py`` -> ``json``,
  ``os.py`` -> ``os``), so no package is split between train and held-out. A module is held out when
  ``int(sha1(f"{seed}:{module}").hexdigest(), 16) % 10000 < heldout_frac * 10000``. The split depends only on
  the module name, the seed and the fraction, not on the file system order or the Python version.

Output (in ``--out``):
  ``train.txt``, ``heldout.txt``: the files in sorted path order, each preceded by the separator line
  ``\\n# <file: RELPATH>\\n`` (RELPATH relative to the stdlib root, with ``/``).
  ``corpus_manifest.json``: Python version, stdlib root, seed, fraction, exclusion rules, per split the modules,
  file count, byte count (UTF-8 bytes of the written text file) and the per-module byte counts.

Usage:
  python examples/prepare_stdlib_corpus.py --out data/stdlib
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sysconfig
from pathlib import Path

from tqdm import tqdm

EXCLUDED_DIR_NAMES = ("test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages")
SEPARATOR = "\n# <file: {path}>\n"


def module_of(rel_path: str) -> str:
    """Top-level module name of a path relative to the stdlib root (``email/mime/text.py`` -> ``email``)."""
    first = rel_path.split("/", 1)[0]
    return first[:-3] if first.endswith(".py") else first


def is_heldout(module: str, seed: int, heldout_frac: float) -> bool:
    """Deterministic held-out decision for one module name (sha1 of ``"{seed}:{module}"``)."""
    digest = int(hashlib.sha1(f"{seed}:{module}".encode("utf-8")).hexdigest(), 16)
    return digest % 10000 < int(round(heldout_frac * 10000))


def list_stdlib_files(root: Path, excluded_dirs=EXCLUDED_DIR_NAMES) -> list[str]:
    """Sorted relative paths (``/``-separated) of the ``*.py`` files under ``root``, skipping folders named in
    ``excluded_dirs``."""
    kept = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in excluded_dirs)
        for name in filenames:
            if name.endswith(".py"):
                kept.append(Path(dirpath, name).relative_to(root).as_posix())
    return sorted(kept)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0, help="seed mixed into the module hash")
    parser.add_argument("--heldout-frac", type=float, default=0.05, help="fraction of modules held out")
    args = parser.parse_args(argv)

    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    files = list_stdlib_files(root)
    splits = {"train": [], "heldout": []}
    module_bytes = {"train": {}, "heldout": {}}
    skipped = []
    for rel in tqdm(files, desc="reading stdlib", unit="file"):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        module = module_of(rel)
        split = "heldout" if is_heldout(module, args.seed, args.heldout_frac) else "train"
        chunk = SEPARATOR.format(path=rel) + text
        splits[split].append(chunk)
        n = len(chunk.encode("utf-8"))
        module_bytes[split][module] = module_bytes[split].get(module, 0) + n

    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_root": str(root),
        "seed": args.seed,
        "heldout_frac": args.heldout_frac,
        "split_rule": "heldout iff int(sha1(f'{seed}:{module}'), 16) % 10000 < round(heldout_frac * 10000)",
        "module_rule": "first path component under the stdlib root, '.py' stripped",
        "excluded_dir_names": list(EXCLUDED_DIR_NAMES),
        "separator": SEPARATOR,
        "skipped_non_utf8": skipped,
        "splits": {},
    }
    for split, chunks in splits.items():
        text = "".join(chunks)
        path = out / f"{split}.txt"
        path.write_text(text, encoding="utf-8", newline="")
        manifest["splits"][split] = {
            "file": path.name,
            "num_files": len(chunks),
            "num_modules": len(module_bytes[split]),
            "num_bytes": len(text.encode("utf-8")),
            "modules": dict(sorted(module_bytes[split].items())),
        }
    (out / "corpus_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['num_modules']} modules, {info['num_files']} files, {info['num_bytes']:,} bytes")
    print(f"python {manifest['python_version']}; skipped (not UTF-8): {len(skipped)}; wrote {out}")
    return manifest


if __name__ == "__main__":
    main()
