#!/usr/bin/env python
"""Build a permissively licensed Python source corpus from the running interpreter's standard library and
site-packages, and write its manifest.

What goes in:
  * the ``*.py`` files of the standard library (``sysconfig.get_paths()["stdlib"]``), licence PSF-2.0;
  * the ``*.py`` files each installed distribution lists in its ``*.dist-info/RECORD`` (site-packages from
    ``sysconfig`` purelib / platlib, or ``--site-packages``), when the distribution's licence is permissive.

Licence of a distribution, read from its ``METADATA``, first source that says something:
  1. ``License-Expression`` (PEP 639, an SPDX expression; ``OR`` needs one permissive side, ``AND`` all of them);
  2. the ``License ::`` trove classifiers (every one must be permissive; the bare ``OSI Approved`` says nothing);
  3. the free-text ``License`` field (an SPDX id or a common name such as "BSD License" / "Apache 2.0", else the
     first lines of a pasted licence text, recognised by their wording).
  Permissive: MIT(-0), BSD (0/2/3-clause), Apache-2.0, PSF-2.0 / Python-2.0, ISC, Zlib, Unlicense, CC0-1.0,
  BSL-1.0, HPND, NCSA, UPL-1.0, X11. Everything else (GPL, LGPL, MPL, proprietary, unknown) is left out and listed
  in the manifest with the reason.

What is left out of every package: directories named ``test``, ``tests``, ``idle_test``, ``__pycache__``,
``site-packages`` / ``dist-packages`` (inside the stdlib), vendored code (``_vendor``, ``vendor``, ``vendored``,
``_vendored``, ``third_party``, ``_third_party``: it carries other projects' licences), files larger than
``--max-file-bytes`` (generated tables), files that are not UTF-8, and exact duplicates: files are deduplicated by
the sha256 of their bytes, the train split first, so a held-out file identical to a train file is dropped from the
held-out split.

Split, by whole package: the distributions named by ``--heldout-packages`` form ``heldout_packages``; the stdlib
top-level modules named by ``--heldout-stdlib`` form ``heldout_stdlib``; everything else is ``train``.

Output (``--out``): ``python_corpus_manifest.json.gz``: interpreter, roots, rules, per split the totals, and per package
(name, version, licence, where the licence was read, split, root, files as ``[relative path, sha256, bytes]``),
plus the excluded distributions with their reason. ``examples/tokenize_corpus.py`` reads this manifest, re-reads
the files and checks their hashes.

Usage:
  python examples/build_python_corpus.py --out data
"""

from __future__ import annotations

import argparse
import csv
import email.parser
import gzip
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from prepare_stdlib_corpus import list_stdlib_files  # the same walk; this corpus excludes more folders

EXCLUDED_DIR_NAMES = frozenset({
    "test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages",
    "_vendor", "vendor", "vendored", "_vendored", "third_party", "_third_party",
})
DEFAULT_HELDOUT_PACKAGES = ("click", "jinja2", "networkx", "requests", "rich")
DEFAULT_HELDOUT_STDLIB = ("colorsys", "contextlib", "inspect", "logging", "multiprocessing", "plistlib",
                          "sysconfig", "tarfile", "tokenize")
STDLIB_NAME = "python-stdlib"
SPLITS = ("train", "heldout_packages", "heldout_stdlib")

PERMISSIVE_SPDX = frozenset({
    "MIT", "MIT-0", "MIT-CMU", "BSD-2-CLAUSE", "BSD-3-CLAUSE", "0BSD", "BSD", "APACHE-2.0", "APACHE-1.1",
    "PSF-2.0", "PYTHON-2.0", "PYTHON-2.0.1", "ISC", "ZLIB", "UNLICENSE", "CC0-1.0", "BSL-1.0", "HPND", "NCSA",
    "UPL-1.0", "X11", "CNRI-PYTHON",
})
# classifiers that state an approval, not a licence
META_CLASSIFIERS = ("License :: OSI Approved", "License :: DFSG approved")
# trove classifier (after "License :: OSI Approved :: " or "License :: ") -> SPDX-like id (None: not permissive)
CLASSIFIER_LICENCES = {
    "MIT License": "MIT", "MIT No Attribution License (MIT-0)": "MIT-0", "BSD License": "BSD",
    "Apache Software License": "Apache-2.0", "Python Software Foundation License": "PSF-2.0",
    "ISC License (ISCL)": "ISC", "zlib/libpng License": "Zlib", "The Unlicense (Unlicense)": "Unlicense",
    "Boost Software License 1.0 (BSL-1.0)": "BSL-1.0", "Universal Permissive License (UPL)": "UPL-1.0",
    "Historical Permission Notice and Disclaimer (HPND)": "HPND",
    "University of Illinois/NCSA Open Source License": "NCSA",
    "CC0 1.0 Universal (CC0 1.0) Public Domain Dedication": "CC0-1.0",
}
# free-text License field, lower-cased and stripped -> id
COMMON_LICENCE_NAMES = {
    "mit": "MIT", "mit license": "MIT", "the mit license": "MIT", "mit licence": "MIT", "expat": "MIT",
    "bsd": "BSD", "bsd license": "BSD", "new bsd": "BSD-3-Clause", "new bsd license": "BSD-3-Clause",
    "bsd 3-clause": "BSD-3-Clause", "3-clause bsd": "BSD-3-Clause", "3-clause bsd license": "BSD-3-Clause",
    "bsd 3-clause license": "BSD-3-Clause", "modified bsd": "BSD-3-Clause", "simplified bsd": "BSD-2-Clause",
    "bsd 2-clause": "BSD-2-Clause", "apache": "Apache-2.0", "apache 2": "Apache-2.0", "apache 2.0": "Apache-2.0",
    "apache-2": "Apache-2.0", "apache license 2.0": "Apache-2.0", "apache license, version 2.0": "Apache-2.0",
    "apache software license": "Apache-2.0", "apache license version 2.0": "Apache-2.0",
    "psf": "PSF-2.0", "psfl": "PSF-2.0", "python software foundation license": "PSF-2.0", "isc": "ISC",
    "isc license": "ISC", "zlib": "Zlib", "unlicense": "Unlicense", "public domain": None,
}


# ---------------------------------------------------------------------------------------------------------------
# licences
# ---------------------------------------------------------------------------------------------------------------

def spdx_is_permissive(expression: str) -> bool:
    """Whether an SPDX licence expression allows use under a permissive licence.

    ``A OR B``: one side permissive is enough; ``A AND B``: both must be; ``A WITH exception``: as ``A``;
    parentheses group. Identifiers are compared case-insensitively against ``PERMISSIVE_SPDX`` (a trailing ``+``
    is ignored). Raises ValueError on an expression that does not parse.
    """
    tokens = re.findall(r"\(|\)|[^\s()]+", expression)
    pos = 0

    def peek() -> Optional[str]:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"licence expression ends early: {expression!r}")
        pos += 1
        return tokens[pos - 1]

    def factor() -> bool:
        tok = take()
        if tok == "(":
            value = disjunction()
            if take() != ")":
                raise ValueError(f"unbalanced parentheses in licence expression {expression!r}")
            return value
        if tok.upper() in ("AND", "OR", "WITH", ")"):
            raise ValueError(f"unexpected {tok!r} in licence expression {expression!r}")
        if (peek() or "").upper() == "WITH":
            take()
            take()
        return tok.rstrip("+").upper() in PERMISSIVE_SPDX

    def conjunction() -> bool:
        value = factor()
        while (peek() or "").upper() == "AND":
            take()
            value = factor() and value
        return value

    def disjunction() -> bool:
        value = conjunction()
        while (peek() or "").upper() == "OR":
            take()
            value = conjunction() or value
        return value

    result = disjunction()
    if pos != len(tokens):
        raise ValueError(f"trailing text in licence expression {expression!r}")
    return result


def licence_from_text(text: str) -> Optional[str]:
    """An id for a free-text ``License`` field (an SPDX expression, a common name, or a pasted licence text),
    or None when it is not recognisably permissive."""
    text = text.strip()
    if not text or text.upper() in ("UNKNOWN", "NONE"):
        return None
    one_line = " ".join(text.split())
    key = one_line.lower().rstrip(".")
    short = re.sub(r"\b(the|license|licence)\b", " ", key)
    short = " ".join(short.replace(",", " ").split())
    for k in (key, short):
        if k in COMMON_LICENCE_NAMES:
            return COMMON_LICENCE_NAMES[k]
    if "\n" not in text and len(one_line) < 80:
        try:
            if spdx_is_permissive(one_line):
                return one_line
        except ValueError:
            pass
    head = one_line[:400].lower()
    if any(w in head for w in ("gpl", "general public", "mozilla", "mpl", "proprietary", "commercial")):
        return None
    if "apache license" in head:
        return "Apache-2.0"
    if "permission is hereby granted, free of charge" in head or re.search(r"\bmit license\b", head):
        return "MIT"
    if "redistribution and use in source and binary forms" in head or re.search(r"\bbsd\b", head):
        return "BSD"
    if "python software foundation" in head:
        return "PSF-2.0"
    if "permission to use, copy, modify, and/or distribute" in head:
        return "ISC"
    return None


def distribution_licence(meta) -> Tuple[Optional[str], str, str]:
    """``(licence id or None, source, raw text)`` from a parsed METADATA message (see the module doc)."""
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        try:
            ok = spdx_is_permissive(expression)
        except ValueError:
            ok = False
        return (expression if ok else None), "License-Expression", expression
    classifiers = [c.strip() for c in meta.get_all("Classifier") or [] if c.strip().startswith("License ::")]
    named = [c.split("::")[-1].strip() for c in classifiers if c not in META_CLASSIFIERS]
    if named:
        ids = [CLASSIFIER_LICENCES.get(n) for n in named]
        if all(ids):
            return " AND ".join(sorted(set(ids))), "classifier", "; ".join(named)
        return None, "classifier", "; ".join(named)
    raw = meta.get("License") or ""
    return licence_from_text(raw), "License", " ".join(raw.split())[:200]


# ---------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------

def path_is_kept(rel: str) -> bool:
    """A ``/``-separated relative path to a ``.py`` file outside the excluded directories."""
    parts = rel.split("/")
    return rel.endswith(".py") and not rel.startswith("../") and not any(p in EXCLUDED_DIR_NAMES
                                                                         for p in parts[:-1])


def stdlib_files(root: Path) -> List[str]:
    """Sorted relative paths of the stdlib ``.py`` files kept by the exclusion rules."""
    return list_stdlib_files(root, EXCLUDED_DIR_NAMES)


def stdlib_module(rel: str) -> str:
    """Top-level module of a stdlib path (``email/mime/text.py`` -> ``email``, ``os.py`` -> ``os``)."""
    first = rel.split("/", 1)[0]
    return first[:-3] if first.endswith(".py") else first


def normalise_name(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_distributions(site_dirs: Iterable[Path]) -> List[Dict]:
    """One record per ``*.dist-info`` found: name, version, licence (see :func:`distribution_licence`), root,
    and the kept ``.py`` paths its RECORD lists (relative to the site directory, sorted)."""
    dists = []
    parser = email.parser.Parser()
    for site in site_dirs:
        if not site.is_dir():
            raise FileNotFoundError(f"site-packages directory {site} does not exist (pass --site-packages)")
        for info in sorted(site.glob("*.dist-info")):
            meta_path, record_path = info / "METADATA", info / "RECORD"
            if not meta_path.is_file():
                continue
            meta = parser.parsestr(meta_path.read_text(encoding="utf-8", errors="replace"), headersonly=True)
            licence, source, raw = distribution_licence(meta)
            files = []
            if record_path.is_file():
                with open(record_path, newline="", encoding="utf-8", errors="replace") as fh:
                    for row in csv.reader(fh):
                        if row and path_is_kept(row[0]):
                            files.append(row[0])
            dists.append({"name": normalise_name(meta.get("Name") or info.name.split("-")[0]),
                          "version": meta.get("Version") or "", "licence": licence, "licence_source": source,
                          "licence_raw": raw, "root": str(site), "candidates": sorted(set(files))})
    return dists


def _check_file(path: Path, max_file_bytes: int) -> Tuple[str, Optional[str], int]:
    """``(status, sha256, bytes)`` of one file; status is "ok", "missing", "too_large" or "not_utf8"."""
    try:
        data = path.read_bytes()
    except OSError:
        return "missing", None, 0
    if len(data) > max_file_bytes:
        return "too_large", None, len(data)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "not_utf8", None, len(data)
    return "ok", hashlib.sha256(data).hexdigest(), len(data)


def build(out: Path, site_dirs: List[Path], stdlib_root: Path, heldout_packages: Iterable[str],
          heldout_stdlib: Iterable[str], max_file_bytes: int = 1_000_000, log=print, workers: int = 8) -> Dict:
    """Build the manifest (see the module doc), write ``out/python_corpus_manifest.json.gz`` and return it."""
    heldout_packages = {normalise_name(p) for p in heldout_packages}
    heldout_stdlib = set(heldout_stdlib)
    packages: List[Dict] = []
    excluded: List[Dict] = []
    # stdlib: two entries (train modules, held-out modules)
    std_files = stdlib_files(stdlib_root)
    for split in ("train", "heldout_stdlib"):
        files = [f for f in std_files if (stdlib_module(f) in heldout_stdlib) == (split == "heldout_stdlib")]
        packages.append({"name": STDLIB_NAME, "version": platform.python_version(), "licence": "PSF-2.0",
                         "licence_source": "CPython", "split": split, "root": str(stdlib_root),
                         "modules": sorted({stdlib_module(f) for f in files}) if split != "train" else None,
                         "candidates": files})
    seen_names = set()
    for d in read_distributions(site_dirs):
        if d["name"] in seen_names:
            excluded.append({"name": d["name"], "version": d["version"], "reason": "duplicate dist-info"})
            continue
        seen_names.add(d["name"])
        if d["licence"] is None:
            excluded.append({"name": d["name"], "version": d["version"],
                             "reason": f"licence not permissive or unknown ({d['licence_source']}: "
                                       f"{d['licence_raw'][:120]!r})"})
            continue
        if not d["candidates"]:
            continue
        d["split"] = "heldout_packages" if d["name"] in heldout_packages else "train"
        packages.append(d)
    missing = sorted(heldout_packages - {p["name"] for p in packages if p["split"] == "heldout_packages"})
    # dedup by sha256: train first, then held-out
    order = {s: i for i, s in enumerate(SPLITS)}
    packages.sort(key=lambda p: (order[p["split"]], p["name"]))
    seen: Dict[str, Tuple[str, str]] = {}
    stats = {"duplicates": 0, "too_large": 0, "not_utf8": 0, "missing": 0}
    owned_paths = set()
    jobs = []
    for p in packages:
        rels = []
        for rel in p.pop("candidates"):
            if (p["root"], rel) not in owned_paths:  # a file listed by two distributions belongs to the first
                owned_paths.add((p["root"], rel))
                rels.append(rel)
        p["candidates"] = rels
        jobs += [Path(p["root"]) / rel for rel in rels]
    with ThreadPoolExecutor(max_workers=workers) as pool:  # reading and hashing release the GIL
        checked = dict(zip(jobs, pool.map(lambda path: _check_file(path, max_file_bytes), jobs)))
    for p in packages:
        root = Path(p["root"])
        kept = []
        for rel in p.pop("candidates"):
            status, digest, size = checked[root / rel]
            if status != "ok":
                stats[status] += 1
                continue
            if digest in seen:
                stats["duplicates"] += 1
                continue
            seen[digest] = (p["name"], rel)
            kept.append([rel, digest, size])
        p["files"] = kept
        p["num_files"] = len(kept)
        p["num_bytes"] = sum(f[2] for f in kept)
        p.pop("licence_raw", None)
    packages = [p for p in packages if p["files"]]
    splits = {}
    for s in SPLITS:
        members = [p for p in packages if p["split"] == s]
        splits[s] = {"num_packages": len(members), "packages": [p["name"] for p in members],
                     "num_files": sum(p["num_files"] for p in members),
                     "num_bytes": sum(p["num_bytes"] for p in members)}
    splits["heldout_stdlib"]["modules"] = sorted(heldout_stdlib)
    manifest = {
        "format": "kimi-hybrid python corpus manifest v1",
        "python_version": platform.python_version(), "python_executable": sys.executable,
        "stdlib_root": str(stdlib_root), "site_packages": [str(s) for s in site_dirs],
        "rules": {
            "files": "*.py listed in each distribution's RECORD (stdlib: every *.py under the root)",
            "excluded_dir_names": sorted(EXCLUDED_DIR_NAMES), "max_file_bytes": max_file_bytes,
            "licence": "License-Expression, else License classifiers, else the License field; permissive only",
            "permissive_ids": sorted(PERMISSIVE_SPDX),
            "dedup": "sha256 of the file bytes; train first, then held-out (held-out copies of train files dropped)",
            "split": "whole packages: heldout_packages by distribution name, heldout_stdlib by top-level module",
        },
        "heldout_packages_requested": sorted(heldout_packages), "heldout_packages_missing": missing,
        "skipped": stats, "splits": splits, "excluded_distributions": excluded, "packages": packages,
    }
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "python_corpus_manifest.json.gz", "wt", encoding="utf-8", compresslevel=9) as fh:
        json.dump(manifest, fh, separators=(",", ":"))
    for s in SPLITS:
        info = splits[s]
        log(f"{s}: {info['num_packages']} packages, {info['num_files']:,} files, {info['num_bytes']:,} bytes")
    log(f"excluded distributions: {len(excluded)}; skipped files: {stats}; held-out packages missing: {missing}")
    return manifest


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for python_corpus_manifest.json.gz (created)")
    parser.add_argument("--site-packages", nargs="*", default=None,
                        help="site-packages folders (default: this interpreter's purelib / platlib)")
    parser.add_argument("--stdlib", default=None, help="stdlib folder (default: this interpreter's)")
    parser.add_argument("--heldout-packages", default=",".join(DEFAULT_HELDOUT_PACKAGES),
                        help="comma-separated distribution names held out whole")
    parser.add_argument("--heldout-stdlib", default=",".join(DEFAULT_HELDOUT_STDLIB),
                        help="comma-separated top-level stdlib modules held out whole")
    parser.add_argument("--max-file-bytes", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="reader threads")
    args = parser.parse_args(argv)
    paths = sysconfig.get_paths()
    sites = args.site_packages if args.site_packages is not None else sorted({paths["purelib"], paths["platlib"]})
    try:
        build(Path(args.out), [Path(s) for s in sites], Path(args.stdlib or paths["stdlib"]),
              [p for p in args.heldout_packages.split(",") if p], [m for m in args.heldout_stdlib.split(",") if m],
              args.max_file_bytes, workers=args.workers)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
