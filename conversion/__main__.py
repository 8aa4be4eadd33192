"""Command line: `kimi-hybrid-convert` (console script) or `python -m kimi_hybrid.conversion`.

  kimi-hybrid-convert convert SRC OUT [--from auto|released|native|k3] [--overwrite] [--max-shard-size 5GB]
  kimi-hybrid-convert export  SRC OUT            ours -> released Kimi-Linear layout (vLLM / SGLang / llama.cpp)
  kimi-hybrid-convert inventory (--config PATH | --preset NAME) [--from ...] [--json FILE] [--all]

`convert` is the default sub-command: `kimi-hybrid-convert SRC OUT` works too.
Exit status: 0 success, 2 refused (bad checkpoint / arguments; nothing written), 1 unexpected error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from . import config_io
from .binding import CheckpointError
from .config_io import ConfigError
from .convert import ConversionError, convert_checkpoint, log
from .inventory import format_inventory, inventory
from .layouts import PlanError
from .mxfp4 import MXFP4Error
from .safetensors_io import SafetensorsError

SUBCOMMANDS = ("convert", "export", "inventory")
_DTYPES = {"bf16": "BF16", "bfloat16": "BF16", "fp32": "F32", "float32": "F32"}


def _add_common(p):
    p.add_argument("src", help="source checkpoint folder (config.json + safetensors [+ index])")
    p.add_argument("out", help="output folder (written atomically; must not exist or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    p.add_argument("--checksum", default="sha256", choices=["sha256", "crc32", "none"],
                   help="per-tensor checksum in conversion_report.json (default sha256)")
    p.add_argument("--chunk-mb", type=int, default=64, help="streaming buffer size in MiB (default 64)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kimi-hybrid-convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="released / native / K3 checkpoint -> our layout")
    _add_common(c)
    c.add_argument("--from", dest="src_format", default="auto", choices=["auto", "released", "native", "k3"])
    c.add_argument("--dequant-dtype", default="bf16", choices=sorted(_DTYPES),
                   help="dtype of dequantized K3 MXFP4 experts (default bf16, exact)")
    c.add_argument("--no-bundle", action="store_true", help="do not copy the model code / auto_map into the output")
    e = sub.add_parser("export", help="our layout -> released Kimi-Linear layout")
    _add_common(e)
    i = sub.add_parser("inventory", help="dry run from a config alone: source / target keys, shapes, sizes")
    g = i.add_mutually_exclusive_group(required=True)
    g.add_argument("--config", help="a config.json")
    g.add_argument("--preset", help="a known config: " + ", ".join(config_io.RELEASED_PRESETS))
    i.add_argument("--from", dest="src_format", default="auto", choices=["auto", "released", "native", "k3", "ours"])
    i.add_argument("--variant", default="", help="native: fused|saved; k3: prefixed+mxfp4 (default) ...")
    i.add_argument("--json", help="write the full inventory as JSON to this file")
    i.add_argument("--all", action="store_true", help="print every key")
    return ap


def _check_source_format(src: str, requested: str) -> None:
    """Refuse ``--from FORMAT`` when the source's config.json says it is another format (ConfigError)."""
    if requested == "auto":
        return
    raw = config_io.load_json(os.path.join(src, "config.json"))
    found = config_io.detect_format(raw)
    if found != requested:
        raise ConfigError(f"--from {requested}: {src} holds a {found!r} checkpoint (config.json model_type "
                          f"{raw.get('model_type')!r}); leave out --from (the format is detected) or pass "
                          f"--from {found}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (the start-up handler of kimi_hybrid/__init__)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
        argv = ["convert", *argv]
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "inventory":
            config = config_io.load_json(args.config) if args.config else config_io.preset_config(args.preset)
            inv = inventory(config, args.src_format, variant=args.variant)
            print(format_inventory(inv, None if args.all else 40))
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump(inv, f, indent=1)
            return 0
        kw = dict(overwrite=args.overwrite, max_shard_size=args.max_shard_size, checksum=args.checksum,
                  chunk_bytes=args.chunk_mb << 20, progress=not args.no_progress)
        if args.cmd == "export":
            convert_checkpoint(args.src, args.out, src_format="ours", dst_format="released", **kw)
        else:
            _check_source_format(args.src, args.src_format)
            convert_checkpoint(args.src, args.out, src_format=args.src_format, dst_format="ours",
                               dequant_dtype=_DTYPES[args.dequant_dtype], with_bundle=not args.no_bundle, **kw)
        return 0
    except (ConversionError, CheckpointError, ConfigError, PlanError, SafetensorsError, MXFP4Error,
            FileNotFoundError) as e:
        log(f"refused: {e}")
        return 2
    except KeyboardInterrupt:
        log("interrupted: nothing was written (the temporary output folder was removed)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
