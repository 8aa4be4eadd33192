"""Streaming checkpoint converter: released Kimi-Linear / transformers-native kimi_linear / Kimi K3 -> ours, and
ours -> released Kimi-Linear (export for vLLM / SGLang / llama.cpp).

Memory design (bounded, independent of the number and size of shards):
1. Plan from config.json alone (`layouts.py`), then read every shard HEADER and bind (`binding.py`): unknown,
   missing, mis-shaped and mis-typed tensors are refused before a single byte is written.
2. Output shards are planned up front (names, dtypes, shapes, offsets are all known), created with their final
   header and preallocated. Destination tensors are ordered by the position of their last source so that an output
   shard fills while the matching source shards are read.
3. Sources are read shard by shard, tensor by tensor, in file order. A source whose pieces are byte copies (every
   Kimi-Linear rename / reshape / expert stacking / q-k-v conv split) is streamed through a fixed scratch buffer of
   `chunk_bytes` and each chunk is `pwrite`n straight into its place inside the fused destination: experts of one
   layer that span two source shards simply land in the same preallocated destination, no staging copy.
4. Sources that need math (K3 MXFP4 dequantization, a padded A_log check, a dtype cast) are loaded whole and kept
   in a small buffer only until every source of their piece has been read (packed + scale may sit in different
   shards); they are released as soon as their last piece is written. `peak_buffer_bytes` in the report measures it.
   Peak RSS is therefore about: interpreter + torch + chunk_bytes + (largest math source group), not a shard.
5. Verification: every output file header is re-read and checked against the plan, every destination byte is
   counted as written exactly once, and each destination tensor is hashed from disk. Every source tensor is hashed
   while it streams through (sha256 by default) and listed as used (with its destinations) or skipped (with why).
6. Atomic output: everything is written into `<out>.tmp-<pid>`, then `os.replace`d onto `<out>`; any error removes
   the temporary folder, so a folder named `<out>` is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import config_io
from .binding import Bound, bind, check_coverage, piece_values
from .layouts import Plan, detect_variant, plan_for
from .safetensors_io import (
    FileHeader,
    PlannedTensor,
    PreallocatedShard,
    SafetensorsError,
    TensorInfo,
    bytes_to_tensor,
    itemsize,
    numel,
    read_bytes,
    read_header,
    tensor_bytes,
)

REPORT_NAME = "conversion_report.json"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tiktoken.model", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "generation_config.json", "tokenization_kimi.py", "tokenizer.json",
)
DEFAULT_CHUNK = 64 << 20


class ConversionError(RuntimeError):
    """Conversion refused or failed; the output folder was not created."""


def log(msg: str) -> None:
    print(f"[kimi-hybrid-convert] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# checksums
# ---------------------------------------------------------------------------------------------------------------


class _Crc32:
    def __init__(self):
        self.v = 0

    def update(self, b):
        self.v = zlib.crc32(b, self.v)

    def hexdigest(self):
        return f"{self.v:08x}"


class _NoHash:
    def update(self, b):
        pass

    def hexdigest(self):
        return None


def new_hasher(kind: str):
    if kind == "sha256":
        return hashlib.sha256()
    if kind == "crc32":
        return _Crc32()
    if kind == "none":
        return _NoHash()
    raise ValueError(f"unknown checksum {kind!r} (sha256, crc32, none)")


def parse_size(s) -> int:
    """'5GB' / '500MB' / '2GiB' / 12345 -> bytes (> 0). Raises ConversionError on anything else."""
    if isinstance(s, int) and not isinstance(s, bool):
        n = s
    else:
        t = str(s).strip().upper()
        units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40, "KB": 10**3, "MB": 10**6,
                 "GB": 10**9, "TB": 10**12, "B": 1}
        mult, num = 1, t
        for u, m in units.items():
            if t.endswith(u):
                mult, num = m, t[: -len(u)]
                break
        try:
            n = int(float(num) * mult)
        except ValueError:
            raise ConversionError(f"cannot read the size {s!r}: use a number of bytes or e.g. 5GB, 500MB, 2GiB") \
                from None
    if n <= 0:
        raise ConversionError(f"the size {s!r} must be positive")
    return n


def check_folders(src_dir: str, out_dir: str) -> None:
    """Refuse an output folder that is the source, lies inside it, or contains it (``--overwrite`` would then
    delete the source). Symlinks are resolved first."""
    src, out = os.path.realpath(src_dir), os.path.realpath(out_dir)
    if out == src or out.startswith(src + os.sep):
        raise ConversionError("the output folder must not be the source folder or inside it")
    if src.startswith(out + os.sep):
        raise ConversionError(f"the output folder {out_dir} contains the source folder {src_dir}: writing it "
                              "(with --overwrite) would delete the source; choose another output folder")


# ---------------------------------------------------------------------------------------------------------------
# source checkpoint
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SourceCheckpoint:
    folder: str
    config: dict
    shards: list[str]  # file names, in read order
    headers: dict[str, FileHeader]  # file name -> header
    where: dict[str, tuple[str, TensorInfo]]  # tensor name -> (file name, info)

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for _, i in self.where.values())

    def present(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {k: (i.dtype, i.shape) for k, (_, i) in self.where.items()}


def open_checkpoint(folder: str) -> SourceCheckpoint:
    """Read config.json, the index (or a single model.safetensors) and every shard header; validate them."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise ConversionError(f"the source folder {folder} does not exist")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"{folder}: no config.json (is this a checkpoint folder?)")
    config = config_io.load_json(cfg_path)
    idx_path = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(idx_path):
        index = config_io.load_json(idx_path)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise ConversionError(f"{idx_path}: no weight_map")
        shards = sorted(set(wm.values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        wm = None
        shards = ["model.safetensors"]
    else:
        raise ConversionError(f"{folder}: neither {INDEX_NAME} nor model.safetensors found")
    missing_files = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if missing_files:
        raise ConversionError(f"{folder}: shard files listed in the index are missing: {missing_files}")
    unlisted = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors") and f not in shards)
    if unlisted:
        # not read: a leftover or a file of another checkpoint; said out loud, since its tensors are not converted
        log(f"warning: {len(unlisted)} .safetensors file(s) in {folder} are not part of this checkpoint "
            f"({'not in ' + INDEX_NAME if wm is not None else 'only model.safetensors is read'}) and are ignored: "
            + ", ".join(unlisted))
    headers: dict[str, FileHeader] = {}
    where: dict[str, tuple[str, TensorInfo]] = {}
    errors: list[str] = []
    for s in shards:
        try:
            h = read_header(os.path.join(folder, s))
        except SafetensorsError as e:
            raise ConversionError(str(e)) from None
        headers[s] = h
        for name, info in h.tensors.items():
            if name in where:
                errors.append(f"tensor {name} is stored in both {where[name][0]} and {s}")
            where[name] = (s, info)
    if wm is not None:
        not_in_index = sorted(n for n, (s, _) in where.items() if n not in wm)
        if not_in_index:
            errors.append(f"tensors stored in shards but missing from the index ({len(not_in_index)}):\n  "
                          + "\n  ".join(f"{n} (in {where[n][0]})" for n in not_in_index))
        absent = sorted(n for n in wm if n not in where)
        if absent:
            errors.append(f"index entries whose tensor is not in the named shard ({len(absent)}):\n  "
                          + "\n  ".join(f"{n} (index says {wm[n]})" for n in absent))
        wrong = sorted(n for n in wm if n in where and where[n][0] != wm[n])
        if wrong:
            errors.append(f"index names the wrong shard for ({len(wrong)}):\n  "
                          + "\n  ".join(f"{n}: index {wm[n]}, found in {where[n][0]}" for n in wrong))
    if errors:
        raise ConversionError(f"{folder}: inconsistent checkpoint:\n" + "\n".join(errors))
    return SourceCheckpoint(folder, config, shards, headers, where)


# ---------------------------------------------------------------------------------------------------------------
# atomic output folder
# ---------------------------------------------------------------------------------------------------------------


def _remove_stale_temporaries(out: str) -> None:
    """Delete ``<out>.tmp-<pid>`` / ``<out>.old-<pid>`` folders left by a conversion that was killed (SIGKILL, power
    loss: no cleanup ran) whose process no longer exists. They never look complete (no config.json is moved into
    ``out`` until the end), but they hold disk space."""
    parent, base = os.path.dirname(out), os.path.basename(out)
    for name in os.listdir(parent):
        for tag in (".tmp-", ".old-"):
            if not name.startswith(base + tag):
                continue
            pid = name[len(base + tag):]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
                continue  # that conversion is still running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue  # a live process of another user
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            log(f"removed {os.path.join(parent, name)}, left by an interrupted conversion (process {pid} is gone)")


# float dtype -> (integer view, exponent mask): a value is NaN or inf exactly when all its exponent bits are set
_EXPONENT_BITS = {"BF16": (torch.int16, 0x7F80), "F16": (torch.int16, 0x7C00), "F32": (torch.int32, 0x7F800000),
                  "F64": (torch.int64, 0x7FF0000000000000)}
_SCAN_ELEMS = 1 << 22  # integer work in slices: temporaries stay a few MB whatever the chunk size


def _count_nonfinite(buf, dtype: str) -> int:
    """Number of NaN / inf values in raw little-endian bytes of a float dtype (0 for other dtypes). Integer bit tests
    on a zero-copy view (no float upcast), in slices of 4M elements."""
    if dtype not in _EXPONENT_BITS or len(buf) == 0:
        return 0
    idt, mask = _EXPONENT_BITS[dtype]
    v = torch.frombuffer(buf, dtype=idt, count=len(buf) // itemsize(dtype))
    n = 0
    for i in range(0, v.numel(), _SCAN_ELEMS):
        n += int(((v[i:i + _SCAN_ELEMS] & mask) == mask).sum())
    return n


def _hash_and_scan(hasher, buf, dtype: str, counts: dict, key: str) -> None:
    """Worker-thread step of the streaming copy: checksum a chunk and count its non-finite values."""
    hasher.update(buf)
    n = _count_nonfinite(buf, dtype)
    if n:
        counts[key] = counts.get(key, 0) + n


@contextmanager
def atomic_output(out: str, overwrite: bool):
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        if not overwrite:
            raise ConversionError(f"output {out} exists and is not empty (pass --overwrite to replace it)")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    _remove_stale_temporaries(out)
    tmp = f"{out}.tmp-{os.getpid()}"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        yield tmp
        old = None
        if os.path.exists(out):
            if os.path.isdir(out) and not os.listdir(out):
                os.rmdir(out)
            else:
                old = f"{out}.old-{os.getpid()}"
                os.replace(out, old)
        os.replace(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------------------------
# output planning
# ---------------------------------------------------------------------------------------------------------------


def plan_output_shards(bound: Bound, order_key, max_shard: int, prefix: str = "model") -> dict[str, list[str]]:
    """Group destination tensors into output files of at most `max_shard` bytes (a bigger tensor gets its own)."""
    plan = bound.plan
    keys = sorted(plan.dests, key=order_key)
    groups: list[list[str]] = [[]]
    size = 0
    for k in keys:
        nb = numel(plan.dests[k].shape) * itemsize(bound.dst_dtype[k])
        if groups[-1] and size + nb > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nb
    n = len(groups)
    return {f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


# ---------------------------------------------------------------------------------------------------------------
# config, bundle, tokenizer
# ---------------------------------------------------------------------------------------------------------------


OUR_TOKENIZER_CODE = "tokenization_kimi_hybrid.py"


def _names_our_tokenizer_code(tokenizer_config: str) -> bool:
    """True when tokenizer_config.json's ``auto_map`` sends AutoTokenizer to our tokenizer file."""
    try:
        with open(tokenizer_config, encoding="utf-8") as f:
            amap = json.load(f).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return False
    target = amap.get("AutoTokenizer") if isinstance(amap, dict) else None
    targets = target if isinstance(target, (list, tuple)) else [target]
    return any(isinstance(t, str) and t.startswith(OUR_TOKENIZER_CODE[:-3] + ".") for t in targets)


def _our_tokenizer_code() -> str | None:
    """Path of the installed package's tokenizer file (None when the package is not importable)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("kimi_hybrid.tokenization_kimi_hybrid")
    except ImportError:
        return None
    return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None


def copy_side_files(src: str, dst: str) -> list[str]:
    """Copy the tokenizer / generation files of ``src`` that exist into ``dst``; returns the names copied.

    A tokenizer_config.json whose ``auto_map`` names our tokenizer (``tokenization_kimi_hybrid.KimiHybridTokenizer``)
    comes with that code file, from ``src`` or else from the installed package, so that the folder's tokenizer
    loads with ``trust_remote_code=True`` where kimi-hybrid is not installed."""
    copied = []
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, name))
            copied.append(name)
    if "tokenizer_config.json" in copied and _names_our_tokenizer_code(os.path.join(src, "tokenizer_config.json")):
        code = os.path.join(src, OUR_TOKENIZER_CODE)
        code = code if os.path.isfile(code) else _our_tokenizer_code()
        if code is None:
            log(f"warning: tokenizer_config.json names {OUR_TOKENIZER_CODE}, which is neither in {src} nor "
                "installed: the tokenizer will need the kimi-hybrid package")
        else:
            shutil.copyfile(code, os.path.join(dst, OUR_TOKENIZER_CODE))
            copied.append(OUR_TOKENIZER_CODE)
    return copied


# ---------------------------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------------------------


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except Exception:  # pragma: no cover
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)


def _export_dtype_overrides(src: SourceCheckpoint, plan: Plan) -> tuple[dict[str, str], dict | None]:
    """When exporting a folder we converted from a released checkpoint, restore the released dtypes and config
    recorded in its conversion report (e.g. a bf16 e_score_correction_bias that ours stores in fp32)."""
    p = os.path.join(src.folder, REPORT_NAME)
    if not os.path.isfile(p):
        return {}, None
    try:
        rep = config_io.load_json(p)
    except Exception:
        return {}, None
    if rep.get("source", {}).get("format") != "released":
        return {}, None
    over = {}
    for k, info in (rep.get("sources") or {}).items():
        if k in plan.dests and info.get("dtype"):
            over[k] = info["dtype"]
    return over, rep.get("source", {}).get("config")


@dataclass
class ConversionJob:
    """What the plan step decides before any byte is written: the source, its format and key variant, our config,
    the tensor plan bound to the source's tensors, and (for an export) the released dtypes and config to restore."""

    src: SourceCheckpoint
    fmt: str
    dst_format: str
    variant: str
    ours_cfg: dict
    plan: Plan
    bound: Bound
    canon: dict[str, str]  # source name as stored -> the plan's name
    template: dict | None


def plan_conversion(src_dir: str, src_format: str, dst_format: str | None, dequant_dtype: str) -> ConversionJob:
    """Step 1, plan: read config.json and every shard header, choose the formats, validate our config with the
    model, and bind the tensor plan to the source (unknown, missing, mis-shaped tensors are refused here)."""
    src = open_checkpoint(src_dir)
    fmt = config_io.detect_format(src.config) if src_format == "auto" else src_format
    if dst_format is None:
        dst_format = "released" if fmt == "ours" else "ours"
    if fmt == "ours" and dst_format == "ours":
        raise ConversionError(
            f"{src_dir} is already in kimi-hybrid's layout (config.json model_type 'kimi_hybrid') and needs no "
            f"conversion: load it as it is (kimi-hybrid generate --model {src_dir}), or export it to the released "
            f"layout with: kimi-hybrid-convert export {src_dir} OUT")
    try:
        ours_cfg = config_io.to_ours(src.config, fmt)
    except config_io.ConfigError as e:
        raise ConversionError(f"{src_dir}/config.json: {e}") from None
    if dst_format == "ours":  # the model's own validation, before any tensor is read or written
        from .model_glue import to_model_config

        try:
            to_model_config(ours_cfg)
        except ValueError as e:
            raise ConversionError(f"{src_dir}/config.json: the model rejects this config: {e}") from None
    variant = detect_variant(fmt, src.where)
    plan = plan_for(ours_cfg, fmt, dst_format, variant)
    check_coverage(plan)
    overrides, template = ({}, None)
    if fmt == "ours" and dst_format == "released":
        overrides, template = _export_dtype_overrides(src, plan)
    bound = bind(plan, src.present(), dequant_dtype=dequant_dtype, dtype_overrides=overrides)
    if bound.skipped:
        by: dict[str, int] = {}
        for n in bound.skipped:
            by[n.split(".", 1)[0]] = by.get(n.split(".", 1)[0], 0) + 1
        log(f"skipping {len(bound.skipped)} tensors that are not part of the text backbone: "
            + ", ".join(f"{k} ({v})" for k, v in sorted(by.items())))
    return ConversionJob(src, fmt, dst_format, variant, ours_cfg, plan, bound, bound.canonical_of(), template)


def plan_output_layout(job: ConversionJob, max_shard_bytes: int) -> dict[str, list[str]]:
    """Step 2, output layout: destination tensors ordered by the read position of their last source (an output shard
    fills while its source shards are read), grouped into files of at most ``max_shard_bytes``."""
    src, bound = job.src, job.bound
    shard_pos = {s: i for i, s in enumerate(src.shards)}

    def src_pos(ckey):
        s, info = src.where[bound.actual[ckey]]
        return (shard_pos[s], info.begin)

    last_src = {k: max(src_pos(s) for pc in d.pieces for s in pc.srcs) for k, d in job.plan.dests.items()}
    return plan_output_shards(bound, lambda k: (last_src[k], k), max_shard_bytes)


def source_uses(plan: Plan) -> dict[str, list]:
    """Which (destination, piece) pairs each planned source feeds."""
    uses: dict[str, list] = {k: [] for k in plan.sources}
    for dk, d in plan.dests.items():
        for pc in d.pieces:
            for s in pc.srcs:
                uses[s].append((dk, pc))
    return uses


class TensorMapper:
    """Step 3, read and map: every source tensor read once, in file order, hashed (and scanned for NaN / inf) as it
    passes, its pieces written into the preallocated output shards. Byte-copy pieces stream through two scratch
    buffers of ``chunk_bytes`` (chunk i hashed on the worker thread while chunk i + 1 is read); pieces that need math
    (MXFP4, a padded A_log, a cast) load their sources whole until the last one of the piece has arrived.

    After :meth:`run`: ``src_hash`` (plan name -> digest), ``nonfinite`` (source name -> count), ``peak_buffer``
    and ``bytes_read``; ``scratch`` / ``pending`` are reused by the verification."""

    def __init__(self, job: ConversionJob, writers: dict, dst_file: dict, pool, chunk_bytes: int, checksum: str):
        self.job, self.writers, self.dst_file, self.pool = job, writers, dst_file, pool
        self.chunk_bytes, self.checksum = chunk_bytes, checksum
        self.uses = source_uses(job.plan)
        self.scratch = [bytearray(chunk_bytes), bytearray(chunk_bytes)]
        self.pending = [None, None]
        self.slot = 0
        self.loaded: dict[str, torch.Tensor] = {}
        self.loaded_bytes = 0
        self.remaining = {k: len(v) for k, v in self.uses.items()}
        self.done_pieces: set[int] = set()
        self.src_hash: dict[str, str | None] = {}
        self.nonfinite: dict[str, int] = {}
        self.peak_buffer = 0
        self.bytes_read = 0

    def run(self, progress: bool) -> None:
        job = self.job
        total = sum(i.nbytes for n, (_, i) in job.src.where.items() if n in job.canon)
        bar = _progress(total, progress, f"{job.fmt} -> {job.dst_format}")
        for s in job.src.shards:
            h = job.src.headers[s]
            with open(h.path, "rb", buffering=0) as fh:
                for info in sorted(h.tensors.values(), key=lambda t: t.begin):
                    if info.name not in job.canon:
                        continue  # skipped (vision tower): not read
                    ckey = job.canon[info.name]
                    if all(pc.op == "copy" and job.bound.dst_dtype[dk] == info.dtype for dk, pc in self.uses[ckey]):
                        self.stream(fh, info, ckey)
                    else:
                        self.load_and_apply(fh, info, ckey)
                    if bar:
                        bar.update(info.nbytes)
                    self.bytes_read += info.nbytes
        if bar:
            bar.close()
        if self.loaded:
            raise ConversionError(f"internal: sources still buffered at the end: {sorted(self.loaded)}")

    def wait(self) -> None:
        for p in self.pending:
            if p is not None:
                p.result()
        self.pending = [None, None]

    def stream(self, fh, info: TensorInfo, ckey: str) -> None:
        """Byte-copy pieces: chunks of the source written straight into their destinations' element ranges."""
        hasher, cbytes, isz = new_hasher(self.checksum), self.chunk_bytes, itemsize(info.dtype)
        for cb in range(0, info.nbytes, cbytes):
            ce = min(info.nbytes, cb + cbytes)
            if self.pending[self.slot] is not None:
                self.pending[self.slot].result()
            buf = read_bytes(fh, info.begin + cb, ce - cb, self.scratch[self.slot])
            self.pending[self.slot] = self.pool.submit(_hash_and_scan, hasher, buf, info.dtype, self.nonfinite,
                                                       info.name)
            self.slot ^= 1
            for dk, pc in self.uses[ckey]:
                pb, pe = pc.src_el * isz, (pc.src_el + pc.numel) * isz
                lo, hi = max(pb, cb), min(pe, ce)
                if lo < hi:
                    self.writers[self.dst_file[dk]].write(dk, pc.dst_el * isz + (lo - pb), buf[lo - cb: hi - cb])
        self.wait()
        self.peak_buffer = max(self.peak_buffer, 2 * min(cbytes, info.nbytes) + self.loaded_bytes)
        self.src_hash[ckey] = hasher.hexdigest()

    def load_and_apply(self, fh, info: TensorInfo, ckey: str) -> None:
        """Math pieces: the source loaded whole; each piece whose sources are all loaded is computed and written,
        and a source is released once its last piece is written."""
        hasher = new_hasher(self.checksum)
        raw = read_bytes(fh, info.begin, info.nbytes)
        _hash_and_scan(hasher, raw, info.dtype, self.nonfinite, info.name)
        self.src_hash[ckey] = hasher.hexdigest()
        self.loaded[ckey] = bytes_to_tensor(raw, info.dtype, info.shape)
        self.loaded_bytes += info.nbytes
        self.peak_buffer = max(self.peak_buffer, self.loaded_bytes)
        dst_dtype = self.job.bound.dst_dtype
        for dk, pc in self.uses[ckey]:
            if id(pc) in self.done_pieces or not all(x in self.loaded for x in pc.srcs):
                continue
            vals = piece_values(pc.op, [self.loaded[x] for x in pc.srcs], pc, dst_dtype[dk])
            self.writers[self.dst_file[dk]].write(dk, pc.dst_el * itemsize(dst_dtype[dk]), tensor_bytes(vals))
            self.done_pieces.add(id(pc))
            for x in pc.srcs:
                self.remaining[x] -= 1
                if self.remaining[x] == 0 and x in self.loaded:
                    self.loaded_bytes -= self.loaded[x].numel() * self.loaded[x].element_size()
                    del self.loaded[x]


def verify_outputs(job: ConversionJob, tmp: str, layout: dict, writers: dict, mapper: TensorMapper,
                   verify: bool) -> dict[str, dict]:
    """Step 4, verify: every destination byte written once, each output header re-read against the plan, each
    destination tensor hashed from disk (unless ``verify`` is off). Returns the destinations' report entries;
    raises ConversionError listing every problem."""
    plan, dst_dtype, checksum = job.plan, job.bound.dst_dtype, mapper.checksum
    problems, dst_report = [], {}
    for f, ks in layout.items():
        w = writers[f]
        for k in ks:
            want = numel(plan.dests[k].shape) * itemsize(dst_dtype[k])
            if w.written[k] != want:
                problems.append(f"{k}: wrote {w.written[k]} of {want} bytes")
        hdr = read_header(os.path.join(tmp, f))
        if sorted(hdr.tensors) != sorted(ks):
            problems.append(f"{f}: header tensor set differs from the plan")
        with open(hdr.path, "rb", buffering=0) as fh:
            for k in ks:
                info = hdr.tensors[k]
                if info.dtype != dst_dtype[k] or info.shape != plan.dests[k].shape:
                    problems.append(f"{k}: written {info.dtype} {list(info.shape)}, planned "
                                    f"{dst_dtype[k]} {list(plan.dests[k].shape)}")
                hasher = new_hasher(checksum if verify else "none")
                if verify and checksum != "none":
                    hash_from_disk(fh, info, hasher, mapper)
                dst_report[k] = {
                    "file": f, "dtype": info.dtype, "shape": list(info.shape), "nbytes": info.nbytes,
                    checksum: hasher.hexdigest(), "provenance": provenance(job, k)}
    if problems:
        raise ConversionError("verification failed:\n  " + "\n  ".join(problems))
    return dst_report


def hash_from_disk(fh, info: TensorInfo, hasher, mapper: TensorMapper) -> None:
    """Hash one written tensor back from disk through the mapper's two scratch buffers (reads overlap hashing)."""
    cbytes = mapper.chunk_bytes
    for j, cb in enumerate(range(0, info.nbytes, cbytes)):
        if mapper.pending[j % 2] is not None:
            mapper.pending[j % 2].result()
        ce = min(info.nbytes, cb + cbytes)
        mapper.pending[j % 2] = mapper.pool.submit(hasher.update,
                                                   read_bytes(fh, info.begin + cb, ce - cb, mapper.scratch[j % 2]))
    mapper.wait()


def provenance(job: ConversionJob, key: str) -> list[dict]:
    """Where each piece of destination ``key`` came from (op, source names as stored, element ranges)."""
    return [{"op": pc.op, "src": [job.bound.actual[x] for x in pc.srcs],
             "src_elements": [pc.src_el, pc.src_el + pc.numel] if pc.op != "mxfp4" else None,
             "dst_elements": [pc.dst_el, pc.dst_el + pc.numel]}
            for pc in job.plan.dests[key].pieces]


def source_report(job: ConversionJob, src_hash: dict, checksum: str) -> dict[str, dict]:
    """Step 5, account for every source tensor: used (its digest and destinations) or skipped (and why). Raises
    ConversionError for a used source that fed no destination."""
    used_by: dict[str, list[str]] = {}
    for dk, d in job.plan.dests.items():
        for pc in d.pieces:
            for x in pc.srcs:
                lst = used_by.setdefault(x, [])
                if not lst or lst[-1] != dk:
                    lst.append(dk)
    report: dict[str, dict] = {}
    for name, (s, info) in sorted(job.src.where.items()):
        entry = {"file": s, "dtype": info.dtype, "shape": list(info.shape), "nbytes": info.nbytes}
        if name in job.canon:
            entry[checksum] = src_hash.get(job.canon[name])
            entry["status"] = "used"
            entry["destinations"] = used_by.get(job.canon[name], [])
        else:
            entry["status"] = "skipped: " + job.bound.skipped[name]
        report[name] = entry
    unaccounted = [n for n, e in report.items() if e["status"] == "used" and not e["destinations"]]
    if unaccounted:
        raise ConversionError(f"internal: source tensors with no destination: {unaccounted}")
    return report


def write_metadata(job: ConversionJob, tmp: str, src_dir: str, dst_report: dict, with_bundle: bool) -> list[str]:
    """Step 6, write: the safetensors index, config.json (ours with the bundle, or the released one) and the
    tokenizer / generation side files. Returns the names of the files written besides the shards."""
    config_io.write_json(os.path.join(tmp, INDEX_NAME), {
        "metadata": {"total_size": sum(e["nbytes"] for e in dst_report.values())},
        "weight_map": {k: dst_report[k]["file"] for k in sorted(dst_report)},
    })
    if job.dst_format == "ours":
        from .model_glue import write_model_config

        extra = write_model_config(tmp, job.ours_cfg, with_bundle)
    else:
        released = config_io.ours_config_to_released(job.ours_cfg, job.template)
        released.pop("auto_map", None)  # names code this folder does not ship; its consumers read model_type
        config_io.write_json(os.path.join(tmp, "config.json"), released)
        extra = ["config.json"]
    return extra + copy_side_files(src_dir, tmp)


def build_report(job: ConversionJob, layout: dict, mapper: TensorMapper, src_report: dict, dst_report: dict,
                 files: list[str], dequant_dtype: str, elapsed: float) -> dict:
    """Step 7, report: what was converted, the checks that passed, digests and provenance of every tensor."""
    src, plan = job.src, job.plan
    return {
        "tool": "kimi-hybrid-convert",
        "source": {"folder": src.folder, "format": job.fmt, "variant": job.variant, "config": src.config,
                   "tensors": len(src.where), "bytes": src.total_bytes, "shards": src.shards},
        "destination": {"format": job.dst_format, "tensors": len(dst_report),
                        "bytes": sum(e["nbytes"] for e in dst_report.values()), "shards": list(layout)},
        "checksum": mapper.checksum,
        "checks": {
            "every_source_accounted": True,
            "used_sources": sum(1 for e in src_report.values() if e["status"] == "used"),
            "skipped_sources": len(job.bound.skipped),
            "every_destination_byte_written_once": True,
            "output_headers_match_plan": True,
        },
        "nonfinite_values": dict(sorted(mapper.nonfinite.items())),
        "dequant_dtype": dequant_dtype if any(d.dtype_rule == "dequant" for d in plan.dests.values()) else None,
        "files_written": sorted(files),
        "peak_buffer_bytes": mapper.peak_buffer,
        "bytes_read": mapper.bytes_read,
        "elapsed_s": round(elapsed, 3),
        "sources": src_report,
        "destinations": dst_report,
    }


def convert_checkpoint(
    src_dir: str,
    out_dir: str,
    *,
    src_format: str = "auto",
    dst_format: str | None = None,
    overwrite: bool = False,
    max_shard_size="5GB",
    checksum: str = "sha256",
    dequant_dtype: str = "BF16",
    chunk_bytes: int = DEFAULT_CHUNK,
    progress: bool = True,
    with_bundle: bool = True,
    verify: bool = True,
) -> dict:
    """Convert the checkpoint folder `src_dir` into `out_dir`; returns the verification report (also written as
    `out_dir/conversion_report.json`). Raises ConversionError / CheckpointError and leaves no `out_dir` on failure.
    """
    t0 = time.perf_counter()
    src_dir = os.path.abspath(src_dir)
    check_folders(src_dir, out_dir)
    if chunk_bytes <= 0:
        raise ConversionError(f"the streaming chunk must be positive (got {chunk_bytes} bytes; --chunk-mb >= 1)")
    max_shard_bytes = parse_size(max_shard_size)
    job = plan_conversion(src_dir, src_format, dst_format, dequant_dtype)
    layout = plan_output_layout(job, max_shard_bytes)
    dst_file = {k: f for f, ks in layout.items() for k in ks}
    with atomic_output(out_dir, overwrite) as tmp, ThreadPoolExecutor(max_workers=1) as pool:
        writers: dict[str, PreallocatedShard] = {}
        try:
            for f, ks in layout.items():
                writers[f] = PreallocatedShard(
                    os.path.join(tmp, f),
                    [PlannedTensor(k, job.bound.dst_dtype[k], job.plan.dests[k].shape) for k in ks],
                    {"format": "pt"},
                )
            mapper = TensorMapper(job, writers, dst_file, pool, chunk_bytes, checksum)
            mapper.run(progress)
        finally:
            for w in writers.values():
                w.close()
        dst_report = verify_outputs(job, tmp, layout, writers, mapper, verify)
        src_report = source_report(job, mapper.src_hash, checksum)
        files = write_metadata(job, tmp, src_dir, dst_report, with_bundle)
        elapsed = time.perf_counter() - t0
        report = build_report(job, layout, mapper, src_report, dst_report, files, dequant_dtype, elapsed)
        with open(os.path.join(tmp, REPORT_NAME), "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
            fh.write("\n")
    log_outcome(out_dir, report, mapper, elapsed)
    return report


def log_outcome(out_dir: str, report: dict, mapper: TensorMapper, elapsed: float) -> None:
    """The closing lines: non-finite source values (copied as they are) and what was written how fast."""
    if mapper.nonfinite:
        named = ", ".join(f"{k} ({v})" for k, v in sorted(mapper.nonfinite.items())[:8])
        log(f"warning: {len(mapper.nonfinite)} source tensor(s) hold NaN / inf values (copied as they are; counts in "
            f"{REPORT_NAME} under nonfinite_values): {named}")
    dst = report["destination"]
    log(f"wrote {os.path.abspath(out_dir)}: {dst['tensors']} tensors, {dst['bytes'] / 1e9:.3f} GB in "
        f"{len(dst['shards'])} shard(s), {elapsed:.1f} s ({mapper.bytes_read / 1e9 / max(elapsed, 1e-9):.2f} GB/s)")
