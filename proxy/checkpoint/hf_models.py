"""The Hugging Face side of ``morphling save``: find weights in a local model directory,
stream them, and build randomly initialised models from bundled or local configs.

transformers is imported inside the functions that need it, so importing this module (and
the ``morphling`` CLI) stays fast and works without it.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterable, Iterator
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .format import CheckpointError

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger("morphling.checkpoint")

# Preference order when a directory holds more than one layout (as Hub repos often do).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def model_files(directory: str | Path) -> list[Path]:
    """The weight files of the local Hugging Face model in ``directory``, shards in order."""
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"{directory}: no such model directory (the Hub is not reachable)")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            return _shards(path) if name.endswith(".index.json") else [path]
    raise CheckpointError(f"{directory}: no weights found (looked for {', '.join(WEIGHT_FILES)})")


def _shards(index_path: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        shard_names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index_path}: not a valid shard index ({exc!r})") from exc
    shards = []
    for name in shard_names:
        if not isinstance(name, str) or Path(name).name != name:
            raise CheckpointError(f"{index_path}: shard {name!r} is not a file name")
        path = index_path.parent / name
        if not path.is_file():
            raise CheckpointError(f"{index_path}: names shard {name!r}, which is missing")
        shards.append(path)
    return shards


def iter_tensors(paths: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from each file in turn without loading a whole file first.

    safetensors files are read tensor by tensor; ``.bin`` files are memory-mapped, so a tensor's
    pages are read only when it is written out.
    """
    for path in paths:
        log.info("reading %s", path)
        if path.suffix == ".safetensors":
            yield from _safetensors(path)
        else:
            yield from _torch_bin(path)


def _safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles have keys(), not __iter__
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file: {exc}") from exc


def _torch_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as exc:
        raise CheckpointError(
            f"{path}: cannot read PyTorch weights (corrupt, truncated or not torch.save): {exc}"
        ) from exc
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"{path}: expected a flat state dict of name -> tensor")
    yield from state.items()


def bundled_configs() -> list[str]:
    """Names of the model configs shipped with Morphling (usable without any download)."""
    return sorted(
        entry.name.removesuffix(".json")
        for entry in (files("morphling.proxy.checkpoint") / "model_configs").iterdir()
        if entry.name.endswith(".json")
    )


def load_config(name_or_path: str | Path) -> dict[str, Any]:
    """A HF config dict from a bundled name, a model directory, or a config JSON file."""
    name = str(name_or_path)
    if name in bundled_configs():
        source: Any = files("morphling.proxy.checkpoint") / "model_configs" / f"{name}.json"
    else:
        path = Path(name_or_path)
        source = path / "config.json" if path.is_dir() else path
        if not source.is_file():
            raise CheckpointError(
                f"{name}: not a bundled config ({', '.join(bundled_configs())}), "
                "a model directory with config.json, or a config file"
            )
    try:
        config = json.loads(source.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{source}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CheckpointError(f"{source}: not a Hugging Face config (no 'model_type')")
    return config


def build_model(config: dict[str, Any], seed: int) -> nn.Module:
    """A randomly initialised causal LM; the same config and seed give identical weights.

    The seed is applied inside a forked RNG so building a model does not reset the caller's
    global random state.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    model_type = settings.pop("model_type")
    try:
        hf_config = AutoConfig.for_model(model_type, **settings)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot build a {model_type!r} causal LM: {exc}") from exc
