"""``morphling save`` (alias ``morphling-cmd save``): convert a model into a Morphling checkpoint.

A one-shot command, so a plain argparse parser rather than the layered configuration the
long-running roles use. SIGTERM or Ctrl-C ends it with 143 or 130, its partly written copy
removed. torch is imported only when the command runs: it is an optional
dependency, and ``morphling --help`` builds this parser.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from morphling.interrupt import Interrupted, Signals

# float32 by default: it is what the device kernels compute in.
DTYPES = ("float32", "float16", "bfloat16")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "save",
        help="convert a Hugging Face model into a Morphling checkpoint",
        description=(
            "Convert a local Hugging Face model directory (safetensors or pytorch_model.bin, "
            "single or sharded) into a checkpoint the emulator maps once. With --random-init, "
            "build the model from a config instead of reading weights."
        ),
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="NAME_OR_DIR",
        help="local model directory; with --random-init, a bundled config name (e.g. opt-125m, "
        "opt-tiny; an unknown name lists them all), a model directory or a config.json",
    )
    p.add_argument("--output", required=True, type=Path, metavar="CKPT", help="checkpoint dir")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="store floating tensors as this dtype (default: float32); integer buffers keep theirs",
    )
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint")
    p.add_argument(
        "--random-init",
        "--random_init",
        action="store_true",
        help="save a randomly initialised model built from the --model config",
    )
    p.add_argument("--seed", type=int, help="seed for --random-init (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with Signals() as signals:
        signals.raising = True  # until the checkpoint is being written: nothing to clean up
        try:
            return _save(args, signals)
        except Interrupted as exc:
            print(f"morphling save: {exc}", file=sys.stderr)
            return exc.exit_code
        except ImportError as exc:  # torch, transformers and safetensors are optional extras
            print(
                f"morphling save: needs {exc.name}, which is not installed "
                "(pip install 'morphling[torch]')",
                file=sys.stderr,
            )
            return 1


def _save(args: argparse.Namespace, signals: Signals) -> int:
    import torch

    from morphling.proxy.checkpoint.format import CheckpointError, OutputError, write_checkpoint
    from morphling.proxy.checkpoint.hf_models import (
        build_model,
        bundled_configs,
        iter_tensors,
        load_config,
        model_files,
    )

    if args.seed is not None and not args.random_init:
        print("morphling save: --seed only applies with --random-init", file=sys.stderr)
        return 2
    if not args.random_init and args.model in bundled_configs() and not Path(args.model).exists():
        print(
            f"morphling save: {args.model} is a bundled config, not a model directory; "
            "add --random-init to save a randomly initialised model",
            file=sys.stderr,
        )
        return 1
    config: dict[str, Any] | None
    tensors: Iterable[tuple[str, torch.Tensor]]
    try:
        if args.random_init:
            seed = args.seed or 0
            config = load_config(args.model)
            model = build_model(config, seed)
            tensors = model.state_dict().items()
            source = f"random-init {args.model} seed={seed}"
        else:
            files = model_files(args.model)
            config_path = Path(args.model) / "config.json"
            config = load_config(config_path) if config_path.is_file() else None
            tensors = iter_tensors(files)
            source = f"hf {Path(args.model).resolve()}"
        # From here a signal is acted on between tensors, so the staging directory is
        # removed, and never while the finished checkpoint is swapped in.
        signals.raising = False
        entries = write_checkpoint(
            args.output,
            tensors,
            dtype=getattr(torch, args.dtype),
            config=config,
            source=source,
            force=args.force,
            progress=not args.no_progress,
            check=signals.check,
        )
    except OutputError as exc:  # the --output the user gave cannot be used
        print(f"morphling save: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError) as exc:  # OSError: e.g. the disk filled up
        print(f"morphling save: {exc}", file=sys.stderr)
        return 1
    stored = {(e.offset, e.nbytes) for e in entries}
    nbytes = sum(size for _, size in stored)
    print(f"saved {len(entries)} tensors ({nbytes:,} bytes) to {args.output}")
    return signals.exit_code or 0
