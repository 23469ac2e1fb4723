"""Morphling's checkpoint: one data file of 4 KiB-aligned tensors and a JSON index.

The emulator maps ``tensors.bin`` once and hands out tensors that are views of that mapping,
so every virtual device on a host reads weights by reference instead of holding a copy.
This module knows nothing about Hugging Face; ``hf_models`` feeds it ``(name, tensor)`` pairs.

Layout of a checkpoint directory::

    tensors.bin   raw little-endian tensor bytes; each tensor starts at a multiple of 4096
    index.json    {"format": "morphling-checkpoint", "version": 1, "data": "tensors.bin",
                   "tensors": [{"name", "dtype", "shape", "strides", "offset", "nbytes",
                                "checksum", ["alias_of"]}, ...],
                   ["config": {...HF config dict...}], ["source": "provenance"]}

``dtype`` is the torch name without the ``torch.`` prefix ("float32", "bfloat16", "int64").
``strides`` are in elements and ``offset``/``nbytes`` in bytes. ``checksum`` is the
``zlib.crc32`` of the tensor's ``nbytes`` bytes as 8 lowercase hex digits (a string, so
readers in any language get it without integer-width surprises).

Tied tensors: when the input passes the very same memory under two names (a live model's
``lm_head.weight`` tied to ``embed_tokens.weight``), the bytes are stored once and the second
name gets an entry with the same offset, nbytes and checksum plus ``"alias_of": first_name``.
The views of both names then share memory, so an in-place update through one is seen through
the other, exactly like the tie in the model. Hugging Face safetensors files already drop the
tied copy, so checkpoints converted from them simply lack that name; the stored config's
``tie_word_embeddings`` tells a loader to re-tie.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import mmap
import operator
import os
import secrets
import shutil
import tempfile
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

import torch
from tqdm import tqdm

from morphling.outputs import Kind, NotAnOutput, delete, prove

from .errors import CheckpointError, OutputError

log = logging.getLogger("morphling.checkpoint")

FORMAT = "morphling-checkpoint"
VERSION = 1
ALIGNMENT = 4096
INDEX_NAME = "index.json"
DATA_NAME = "tensors.bin"

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's record in the index."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str
    alias_of: str | None = None

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        }
        if self.alias_of is not None:
            entry["alias_of"] = self.alias_of
        return entry


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _crc(data: Any) -> str:
    return f"{zlib.crc32(data):08x}"


def _span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements an as_strided view of this shape and strides reaches (0 if it is empty)."""
    if 0 in shape:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))


# ---------------------------------------------------------------------------------------------
# Writing


def write_checkpoint(
    output: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | None = None,
    config: dict[str, Any] | None = None,
    source: str = "",
    force: bool = False,
    progress: bool = False,
    check: Callable[[], None] | None = None,
) -> list[TensorEntry]:
    """Stream ``tensors`` into a new checkpoint at ``output``; return the index entries.

    Tensors are consumed one at a time, so memory stays at one tensor (plus its cast copy).
    Everything is written into a hidden sibling directory and swapped into place at the end,
    so a crash never leaves a directory that looks like a valid checkpoint, and a save that
    fails leaves the checkpoint it was to replace as it was. Floating tensors
    are cast to ``dtype`` when it is given; integer and bool buffers keep theirs.
    ``check`` is called between tensors and before the swap: what it raises (``morphling
    save`` on a signal) abandons the save, its staging directory removed.

    An existing ``output`` must be absent or empty, unless ``force``; even then only a previous
    checkpoint is replaced (``outputs.prove``), never an arbitrary directory: checked before
    writing, and again on the directory the swap took out of ``output``.
    """
    shown = Path(output)  # as the user gave it, for messages
    # Absolute and normalised: the staging directory goes beside the output, and "." or
    # ".." have no name to put it beside.
    output = Path(os.path.abspath(output))
    _check_output(output, shown, force)
    # mkdir (not mkdtemp, which forces 0700) so the checkpoint gets the usual umask modes and
    # an emulator running as another user can read it.
    staging = output.parent / f".{output.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:  # FileExistsError: a file where a parent directory should be
        reason = os.strerror(errno.ENOTDIR) if isinstance(exc, FileExistsError) else exc.strerror
        raise OutputError(
            f"{shown}: cannot create a directory in {shown.parent}: {reason}"
        ) from None
    try:
        entries = _write_data(staging / DATA_NAME, tensors, dtype, progress, check)
        header: dict[str, Any] = {"format": FORMAT, "version": VERSION, "data": DATA_NAME}
        header["source"] = source
        if config is not None:
            header["config"] = config
        with open(staging / INDEX_NAME, "w", encoding="utf-8") as f:
            f.write(_index_text(header, entries))
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _install(staging, output, shown, force)
    log.info("wrote %d tensors to %s", len(entries), shown)
    return entries


def _index_text(header: dict[str, Any], entries: list[TensorEntry]) -> str:
    """The index as JSON with one line per tensor, so a large index stays readable."""
    lines = ",\n".join(f"  {json.dumps(entry.to_json())}" for entry in entries)
    head = json.dumps(header, indent=1).removesuffix("\n}")
    return f'{head},\n "tensors": [\n{lines}\n ]\n}}\n'


def _checkpoint_files(index: dict[str, Any]) -> tuple[str, str]:
    data = index.get("data")
    if not isinstance(data, str) or not data or Path(data).name != data:
        raise NotAnOutput(f"{INDEX_NAME} names no data file")
    return INDEX_NAME, data


CHECKPOINT = Kind("a checkpoint", INDEX_NAME, FORMAT, _checkpoint_files)


def _check_output(output: Path, shown: Path, force: bool) -> None:
    if not output.exists() and not output.is_symlink():
        return
    if output.is_symlink():  # replacing it would replace the link, not what it points to
        raise OutputError(f"{shown}: is a symbolic link; give the directory it points to")
    if not output.is_dir():
        raise OutputError(f"{shown}: exists and is not a directory; choose another --output")
    if output.samefile(os.getcwd()):
        raise OutputError(
            f"{shown}: is the current directory; a save replaces the directory itself, which "
            "would leave this shell in a removed one: run it from the parent directory"
        )
    _replaced_files(output, shown, force)


def _replaced_files(directory: Path, shown: Path, force: bool) -> list[Path]:
    """What replacing ``directory`` (``shown`` to the user) deletes: nothing when it is
    empty, a checkpoint's files when ``force`` says so; OutputError for anything else."""
    if not any(directory.iterdir()):
        return []
    if not force:
        raise OutputError(f"{shown}: already exists and is not empty (use --force to replace)")
    try:
        return prove(directory, CHECKPOINT)
    except NotAnOutput as exc:
        raise OutputError(
            f"{shown}: not a Morphling checkpoint ({exc}); refusing to replace it even with --force"
        ) from None


def _install(staging: Path, output: Path, shown: Path, force: bool) -> None:
    """Put the finished staging directory at ``output``, or remove it and raise.

    A directory at ``output`` is swapped with the new checkpoint, so ``output`` names a
    whole one, old or new, at every instant. The directory taken out is checked again, as
    it is now, before anything of it is deleted: something added to it while the model was
    written puts it back, and the save is refused. Then only the files proven a
    checkpoint's are deleted.
    """
    existed = output.exists()
    try:
        if existed:
            _swap(staging, output)  # the old directory is now under the staging name
        else:
            os.replace(staging, output)
    except OSError:
        shutil.rmtree(staging)
        raise
    if existed:
        try:
            replaced = _replaced_files(staging, shown, force)
        except (OutputError, OSError):  # OSError: no longer a directory one can list
            _swap(staging, output)  # back: the new checkpoint is under the staging name again
            shutil.rmtree(staging)
            raise
    dir_fd = os.open(output.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if existed:
        delete(replaced)
        try:
            staging.rmdir()
        except OSError as exc:  # something was put into it after it was checked: kept
            log.warning("kept %s, the replaced checkpoint's directory: %s", staging, exc)


def _swap(a: Path, b: Path) -> None:
    """Exchange two directories: in one step where the kernel can, else in three renames
    (``b`` is briefly missing, never partial)."""
    if _exchange(a, b):
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{b.name}.", suffix=".old", dir=b.parent))
    try:
        os.replace(b, aside)  # over the empty directory mkdtemp made
    except OSError:
        aside.rmdir()
        raise
    try:
        os.replace(a, b)
    except OSError:
        os.replace(aside, b)
        raise
    os.replace(aside, a)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``, which
    Python's os lacks); False where the C library or the file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _write_data(
    path: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None,
    progress: bool,
    check: Callable[[], None] | None,
) -> list[TensorEntry]:
    entries: list[TensorEntry] = []
    names: set[str] = set()
    # Identity of memory already written -> (weak ref to the tensor that had it, its entry).
    # A live weak ref proves the address has not been freed and reused by another tensor.
    seen: dict[tuple, tuple[weakref.ref, TensorEntry]] = {}
    total = operator.length_hint(tensors) or None
    with (
        open(path, "wb") as f,
        tqdm(total=total, unit=" tensors", desc="saving", disable=not progress) as bar,
    ):
        for name, tensor in tensors:
            if check is not None:
                check()
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{name!r}: expected a (str, torch.Tensor) pair")
            if name in names:
                raise CheckpointError(f"{name}: duplicate tensor name")
            key = (
                tensor.device.type,
                tensor.data_ptr(),
                tensor.dtype,
                tuple(tensor.shape),
                tensor.stride(),
            )
            earlier = seen.get(key)  # (a reference to the tensor saved first, its entry)
            if tensor.numel() and earlier is not None and earlier[0]() is not None:
                entry = replace(earlier[1], name=name, alias_of=earlier[1].name)
            else:
                entry = _write_tensor(f, name, tensor, dtype)
                seen[key] = (weakref.ref(tensor), entry)
            names.add(name)
            entries.append(entry)
            bar.update()
            bar.set_postfix_str(f"{f.tell() / 2**20:.0f} MiB", refresh=False)
        f.truncate(f.tell())
        f.flush()
        os.fsync(f.fileno())
    return entries


def _write_tensor(
    f: Any, name: str, tensor: torch.Tensor, dtype: torch.dtype | None
) -> TensorEntry:
    if tensor.device.type == "meta":
        raise CheckpointError(f"{name}: tensor has no data (meta device)")
    if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
        raise CheckpointError(f"{name}: dtype {tensor.dtype} is not supported")
    data = tensor.detach().cpu()
    if dtype is not None and data.is_floating_point():
        data = data.to(dtype)
    data = data.contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy()
    offset = _align(f.tell())
    f.write(b"\0" * (offset - f.tell()))
    f.write(raw)
    return TensorEntry(
        name=name,
        dtype=str(data.dtype).removeprefix("torch."),
        shape=tuple(data.shape),
        strides=data.stride(),
        offset=offset,
        nbytes=raw.nbytes,
        checksum=_crc(raw),
    )


# ---------------------------------------------------------------------------------------------
# Reading


class Checkpoint:
    """An open checkpoint: ``tensors.bin`` mapped once, tensors handed out as views of it.

    ``writable=False`` maps the file read-only (``PROT_READ``): no commit charge, so a file
    larger than RAM maps fine, and pages are shared with every other reader through the page
    cache. Writing into such a view kills the process (SIGSEGV), as with any read-only
    mapping; open with ``writable=True`` to update in place. That maps the file shared and
    read-write, so an optimizer updating the views updates the file (``flush()`` pushes it to
    disk; the checksums still describe the original bytes, so reopen it with ``verify=False``).
    """

    def __init__(
        self,
        path: Path,
        data_path: Path,
        entries: list[TensorEntry],
        data: mmap.mmap | None,
        *,
        config: dict[str, Any] | None,
        source: str,
        digest: str,
    ) -> None:
        self.path = path
        self.data_path = data_path
        self.config = config
        self.source = source
        self.digest = digest  # sha256 of index.json: which checkpoint this is
        self._entries = {entry.name: entry for entry in entries}
        self._mmap = data
        # The whole mapping as one uint8 tensor: every view slices it, so the buffer is
        # exported to torch once and all views share one storage.
        self._buffer: torch.Tensor | None = torch.empty(0, dtype=torch.uint8)
        if data is not None:
            with warnings.catch_warnings():
                # torch warns that a read-only buffer gives tensors it cannot protect; the
                # class docstring documents that, and read-only is the point of the mapping.
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                self._buffer = torch.frombuffer(data, dtype=torch.uint8)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        verify: bool = True,
        *,
        writable: bool = False,
        data: str | os.PathLike[str] | None = None,
    ) -> Self:
        """Parse and validate the index, map the data file, and (by default) check checksums.

        ``data`` maps another file laid out like the data file instead (the emulator's
        shared working copy of the weights, see ``weights``).
        """
        path = Path(path)
        index_path = path / INDEX_NAME
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such checkpoint directory")
        if not index_path.is_file():
            raise CheckpointError(f"{index_path}: missing (is {path} a Morphling checkpoint?)")
        try:
            text = index_path.read_bytes()
            index = json.loads(text.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index_path}: not valid JSON: {exc}") from exc
        data_path, entries = _parse_index(index_path, index)
        if data is not None:
            data_path = Path(data)
            if not data_path.is_file():
                raise CheckpointError(f"{data_path}: data file missing")
        size = data_path.stat().st_size
        for entry in entries:
            if entry.offset + entry.nbytes > size:
                raise CheckpointError(
                    f"{data_path}: tensor {entry.name!r} (bytes {entry.offset}..."
                    f"{entry.offset + entry.nbytes}) runs past the end of the file ({size} bytes)"
                )
        mapping = None
        if size:
            with open(data_path, "r+b" if writable else "rb") as f:
                access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
                mapping = mmap.mmap(f.fileno(), 0, access=access)
        config = index.get("config")
        if config is not None and not isinstance(config, dict):
            raise CheckpointError(f"{index_path}: 'config' must be an object")
        ckpt = cls(
            path,
            data_path,
            entries,
            mapping,
            config=config,
            source=str(index.get("source", "")),
            digest=hashlib.sha256(text).hexdigest(),
        )
        if verify:
            try:
                ckpt.verify()
            except CheckpointError:
                ckpt.close()
                raise
        return ckpt

    @property
    def buffer(self) -> torch.Tensor:
        """The whole data file as one uint8 tensor (every tensor view lies inside it)."""
        if self._buffer is None:
            raise CheckpointError(f"{self.path}: checkpoint is closed")
        return self._buffer

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """A zero-copy view of ``name`` in the mapping."""
        entry = self.entry(name)
        raw = self.buffer[entry.offset : entry.offset + entry.nbytes]
        return raw.view(DTYPES[entry.dtype]).as_strided(entry.shape, entry.strides)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self.tensor(name) for name in self._entries}

    def verify(self) -> None:
        """Recompute every checksum; raise naming the first tensor whose bytes changed."""
        if self._buffer is None:
            raise CheckpointError(f"{self.path}: checkpoint is closed")
        if self._mmap is None:  # an empty data file: only empty tensors, nothing to check
            return
        checked: set[tuple[int, int]] = set()
        with memoryview(self._mmap) as view:
            for entry in self._entries.values():
                if (entry.offset, entry.nbytes) in checked:
                    continue
                actual = _crc(view[entry.offset : entry.offset + entry.nbytes])
                if actual != entry.checksum:
                    raise CheckpointError(
                        f"{self.data_path}: tensor {entry.name!r} is corrupt "
                        f"(crc32 {actual}, index says {entry.checksum})"
                    )
                checked.add((entry.offset, entry.nbytes))

    def flush(self) -> None:
        """Write in-place updates of a writable mapping back to the file."""
        if self._mmap is not None:
            self._mmap.flush()

    def close(self) -> None:
        """Drop this object's hold on the mapping.

        The file is unmapped when the last view of it is freed, not here: torch does not pin
        the mmap's buffer, so an explicit ``mmap.close()`` would leave live views dangling.
        """
        self._buffer = None
        self._mmap = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_index(index_path: Path, index: Any) -> tuple[Path, list[TensorEntry]]:
    """Validate the index document; return the data file's path and the entries."""

    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"{index_path}: {problem}")

    if not isinstance(index, dict):
        raise fail("expected a JSON object")
    if index.get("format") != FORMAT:
        raise fail(f"unknown format {index.get('format')!r} (expected {FORMAT!r})")
    if index.get("version") != VERSION:
        raise fail(f"unsupported version {index.get('version')!r} (this reader knows {VERSION})")
    data = index.get("data")
    if not isinstance(data, str) or not data or Path(data).name != data:
        raise fail(f"'data' must be a file name in the checkpoint directory, not {data!r}")
    data_path = index_path.parent / data
    if not data_path.is_file():
        raise CheckpointError(f"{data_path}: data file missing")
    records = index.get("tensors")
    if not isinstance(records, list):
        raise fail("'tensors' must be a list")
    entries: list[TensorEntry] = []
    names: set[str] = set()
    for i, record in enumerate(records):
        entry = _parse_entry(record, fail, i)
        if entry.name in names:
            raise fail(f"duplicate tensor name {entry.name!r}")
        names.add(entry.name)
        entries.append(entry)
    return data_path, entries


def _parse_entry(record: Any, fail: Callable[[str], CheckpointError], i: int) -> TensorEntry:
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        raise fail(f"tensor #{i}: expected an object with a string 'name'")
    name = record["name"]

    def ints(key: str) -> tuple[int, ...]:
        value = record.get(key)
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        ):
            raise fail(f"tensor {name!r}: {key!r} must be a list of non-negative integers")
        return tuple(value)

    def count(key: str) -> int:
        value = record.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise fail(f"tensor {name!r}: {key!r} must be a non-negative integer")
        return value

    dtype = record.get("dtype")
    if dtype not in DTYPES:
        raise fail(f"tensor {name!r}: unknown dtype {dtype!r}")
    shape, strides = ints("shape"), ints("strides")
    if len(shape) != len(strides):
        raise fail(f"tensor {name!r}: shape and strides differ in length")
    offset, nbytes = count("offset"), count("nbytes")
    if offset % ALIGNMENT:
        raise fail(f"tensor {name!r}: offset {offset} is not aligned to {ALIGNMENT} bytes")
    needed = _span(shape, strides) * DTYPES[dtype].itemsize
    if nbytes < needed:
        raise fail(f"tensor {name!r}: shape {list(shape)} needs {needed} bytes, nbytes is {nbytes}")
    if nbytes % DTYPES[dtype].itemsize:
        raise fail(f"tensor {name!r}: nbytes {nbytes} is not a whole number of {dtype}")
    checksum = record.get("checksum")
    if not isinstance(checksum, str) or len(checksum) != 8:
        raise fail(f"tensor {name!r}: 'checksum' must be 8 hex digits")
    alias_of = record.get("alias_of")
    if alias_of is not None and not isinstance(alias_of, str):
        raise fail(f"tensor {name!r}: 'alias_of' must be a tensor name")
    return TensorEntry(name, dtype, shape, strides, offset, nbytes, checksum, alias_of)
