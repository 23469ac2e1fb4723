"""The checkpoint format and ``morphling save``, over real files and real transformers models."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from morphling.proxy.checkpoint.format import (
    ALIGNMENT,
    Checkpoint,
    CheckpointError,
    write_checkpoint,
)
from morphling.proxy.checkpoint.hf_models import (
    build_model,
    bundled_configs,
    iter_tensors,
    load_config,
    model_files,
)
from processes import MORPHLING, child_env

from morphling.cli import cmd_main
from morphling.commands import save as save_cli

TIED = "lm_head.weight"  # transformers drops the tied copy when it writes safetensors


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(load_config("opt-tiny"), seed=3)


@pytest.fixture(scope="module")
def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict()


def save(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="morphling")
    save_cli.add_parser(parser.add_subparsers())
    return save_cli.run(parser.parse_args(["save", "--no-progress", *map(str, argv)]))


def assert_matches(ckpt_dir: Path, state: dict[str, torch.Tensor], names: set[str]) -> None:
    with Checkpoint.open(ckpt_dir) as ckpt:
        assert set(ckpt.names()) == names
        for name in names:
            assert ckpt.entry(name).offset % ALIGNMENT == 0
            assert torch.equal(ckpt.tensor(name), state[name]), name


def write_bin(directory: Path, state: dict[str, torch.Tensor], sharded: bool) -> None:
    """The pytorch_model.bin layouts of transformers 4 (transformers 5 writes safetensors only)."""
    directory.mkdir()
    if not sharded:
        torch.save(state, directory / "pytorch_model.bin")
        return
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="pytorch_model{suffix}.bin", max_shard_size="200KB"
    )
    assert split.is_sharded
    for filename, names in split.filename_to_tensors.items():
        torch.save({name: state[name] for name in names}, directory / filename)
    index = {"metadata": {}, "weight_map": split.tensor_to_filename}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))


# --- round trips ---------------------------------------------------------------------------------


def test_single_safetensors_round_trip_is_bitwise(tmp_path, model, state):
    model.save_pretrained(tmp_path / "hf")
    assert model_files(tmp_path / "hf") == [tmp_path / "hf" / "model.safetensors"]
    assert save("--model", tmp_path / "hf", "--output", tmp_path / "ckpt") == 0
    assert_matches(tmp_path / "ckpt", state, set(state) - {TIED})
    with Checkpoint.open(tmp_path / "ckpt") as ckpt:
        # The stored config rebuilds the model, and loading re-ties the dropped lm_head.
        rebuilt = build_model(ckpt.config, seed=99)
        missing, unexpected = rebuilt.load_state_dict(ckpt.state_dict(), strict=False)
        assert (set(missing), unexpected) <= ({TIED}, [])
        assert torch.equal(rebuilt.state_dict()[TIED], state[TIED])
        assert ckpt.source.startswith("hf ")


def test_sharded_safetensors(tmp_path, model, state):
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    shards = model_files(tmp_path / "hf")
    assert len(shards) >= 2 and shards == sorted(shards)
    assert save("--model", tmp_path / "hf", "--output", tmp_path / "ckpt") == 0
    assert_matches(tmp_path / "ckpt", state, set(state) - {TIED})


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_pytorch_bin(tmp_path, state, sharded):
    write_bin(tmp_path / "hf", state, sharded)
    assert len(model_files(tmp_path / "hf")) >= (2 if sharded else 1)
    assert save("--model", tmp_path / "hf", "--output", tmp_path / "ckpt") == 0
    assert_matches(tmp_path / "ckpt", state, set(state))
    if not sharded:  # torch.save kept the tie, so lm_head is an alias of the embedding
        with Checkpoint.open(tmp_path / "ckpt") as ckpt:
            tied = ckpt.entry(TIED)
            assert tied.alias_of == "model.decoder.embed_tokens.weight"
            assert tied.offset == ckpt.entry(tied.alias_of).offset


def test_write_checkpoint_casts_floats_only_and_stores_ties_once(tmp_path):
    weight = torch.randn(8, 4)
    tensors = [
        ("weight", weight),
        ("tied", weight),  # same memory: an alias entry
        ("rows", weight[:4]),  # a different view of the same storage: its own bytes
        ("steps", torch.arange(5)),
        ("mask", torch.tensor([True, False])),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 3)),
        ("strided", weight.t()),
    ]
    entries = write_checkpoint(tmp_path / "c", tensors, dtype=torch.float16)
    assert [e.alias_of for e in entries] == [None, "weight", *[None] * 6]
    with Checkpoint.open(tmp_path / "c") as ckpt:
        assert ckpt.tensor("weight").dtype == torch.float16
        assert ckpt.tensor("steps").dtype == torch.int64
        assert ckpt.tensor("mask").dtype == torch.bool
        for name, tensor in tensors:
            expected = tensor.half() if tensor.is_floating_point() else tensor
            assert torch.equal(ckpt.tensor(name), expected), name
        assert ckpt.tensor("tied").data_ptr() == ckpt.tensor("weight").data_ptr()


def test_dtype_flag_casts_floats(tmp_path, model, state):
    model.save_pretrained(tmp_path / "hf")
    assert save("--model", tmp_path / "hf", "--output", tmp_path / "c", "--dtype", "float16") == 0
    with Checkpoint.open(tmp_path / "c") as ckpt:
        for name in ckpt.names():
            assert torch.equal(ckpt.tensor(name), state[name].half())


def test_unknown_dtype_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        save("--model", tmp_path, "--output", tmp_path / "c", "--dtype", "float64")
    assert exc.value.code == 2
    assert "invalid choice: 'float64'" in capsys.readouterr().err


@pytest.mark.parametrize("config", ["opt-tiny", "gpt2-tiny"])
def test_random_init_is_reproducible_per_seed(tmp_path, config):
    def checkpoint(name: str, seed: int) -> tuple[bytes, str]:
        out = tmp_path / name
        assert save("--model", config, "--random-init", "--seed", seed, "--output", out) == 0
        return (out / "tensors.bin").read_bytes(), (out / "index.json").read_text()

    first = checkpoint("a", 7)
    assert checkpoint("b", 7) == first
    assert checkpoint("c", 8)[0] != first[0]


def test_build_model_is_seeded_without_touching_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(load_config("gpt2-tiny"), seed=1).state_dict()
    assert torch.equal(torch.rand(1), expected)
    b = build_model(load_config("gpt2-tiny"), seed=1).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)


# --- mapping and views ---------------------------------------------------------------------------


def test_tensors_are_views_of_one_mapping(tmp_path, state):
    write_checkpoint(tmp_path / "c", state.items())
    with Checkpoint.open(tmp_path / "c") as ckpt:
        base, size = ckpt.buffer.data_ptr(), ckpt.buffer.numel()
        assert size == (tmp_path / "c" / "tensors.bin").stat().st_size
        for name in ckpt.names():
            view = ckpt.tensor(name)
            assert view.untyped_storage().data_ptr() == base
            assert view.data_ptr() == base + ckpt.entry(name).offset


def test_writable_mapping_writes_through_to_the_file(tmp_path):
    write_checkpoint(tmp_path / "c", [("w", torch.zeros(4, 4)), ("b", torch.zeros(4))])
    with Checkpoint.open(tmp_path / "c", writable=True) as ckpt:
        ckpt.tensor("w").add_(1.5)  # what an optimizer step does in place
        ckpt.flush()
    with Checkpoint.open(tmp_path / "c", verify=False) as ckpt:
        assert torch.equal(ckpt.tensor("w"), torch.full((4, 4), 1.5))
        with pytest.raises(CheckpointError, match="tensor 'w' is corrupt"):
            ckpt.verify()  # checksums describe the bytes as saved


def test_view_outlives_close(tmp_path):
    write_checkpoint(tmp_path / "c", [("w", torch.arange(6.0))])
    ckpt = Checkpoint.open(tmp_path / "c")
    view = ckpt.tensor("w")
    ckpt.close()
    assert torch.equal(view, torch.arange(6.0))  # still mapped: the view holds the mapping
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.tensor("w")


# --- corruption and bad input --------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path, state) -> Path:
    write_checkpoint(tmp_path / "c", state.items())
    return tmp_path / "c"


def test_flipped_byte_names_the_tensor(saved):
    with Checkpoint.open(saved) as ckpt:
        victim = ckpt.entry("model.decoder.layers.1.fc1.weight")
    data = bytearray((saved / "tensors.bin").read_bytes())
    data[victim.offset + 10] ^= 0x40
    (saved / "tensors.bin").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.decoder\.layers\.1\.fc1\.weight'"):
        Checkpoint.open(saved)
    Checkpoint.open(saved, verify=False).close()  # skipping the check is allowed


def test_truncated_data_file(saved):
    data = saved / "tensors.bin"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="past the end of the file"):
        Checkpoint.open(saved, verify=False)


def _edit(index: dict, change: str) -> None:
    entry = index["tensors"][0]
    match change:
        case "format":
            index["format"] = "archer"
        case "version":
            index["version"] = 2
        case "offset":
            entry["offset"] += 8
        case "dtype":
            entry["dtype"] = "float128"
        case "shape":
            entry["shape"] = [entry["shape"][0] * 2, *entry["shape"][1:]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("format", "unknown format 'archer'"),
        ("version", "unsupported version 2"),
        ("offset", "not aligned to 4096"),
        ("dtype", "unknown dtype 'float128'"),
        ("shape", "needs"),
    ],
)
def test_invalid_index(saved, change, message):
    index = json.loads((saved / "index.json").read_text())
    _edit(index, change)
    (saved / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message) as exc:
        Checkpoint.open(saved)
    assert "index.json" in str(exc.value)


def test_bad_json_and_missing_index(saved):
    (saved / "index.json").write_text('{"format": ')
    with pytest.raises(CheckpointError, match=r"index\.json: not valid JSON"):
        Checkpoint.open(saved)
    (saved / "index.json").unlink()
    with pytest.raises(CheckpointError, match=r"index\.json: missing"):
        Checkpoint.open(saved)


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_corrupt_source_is_a_clear_error(tmp_path, model, state, capsys, layout):
    if layout == "safetensors":
        model.save_pretrained(tmp_path / "hf")
        weights = tmp_path / "hf" / "model.safetensors"
    else:
        write_bin(tmp_path / "hf", state, sharded=False)
        weights = tmp_path / "hf" / "pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert save("--model", tmp_path / "hf", "--output", tmp_path / "c") == 1
    assert f"morphling save: {weights}: cannot read" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [tmp_path / "hf"]  # no output, no staging leftovers


def test_missing_model_and_missing_shard(tmp_path, model, capsys):
    assert save("--model", tmp_path / "nope", "--output", tmp_path / "c") == 1
    assert "no such model directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert save("--model", tmp_path / "empty", "--output", tmp_path / "c") == 1
    assert "no weights found (looked for model.safetensors" in capsys.readouterr().err
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    next((tmp_path / "hf").glob("model-00002-of-*.safetensors")).unlink()
    assert save("--model", tmp_path / "hf", "--output", tmp_path / "c") == 1
    assert "which is missing" in capsys.readouterr().err


def test_failure_midway_leaves_nothing(tmp_path):
    def tensors():
        yield "a", torch.ones(3)
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError, match="source died"):
        write_checkpoint(tmp_path / "c", tensors())
    assert list(tmp_path.iterdir()) == []


# --- overwrite policy and CLI ------------------------------------------------------------------


def test_refuses_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "c"
    assert save("--model", "opt-tiny", "--random-init", "--output", out) == 0
    assert "saved 37 tensors" in capsys.readouterr().out
    before = (out / "tensors.bin").read_bytes()
    args = ("--model", "opt-tiny", "--random_init", "--seed", 5, "--output", out)
    assert save(*args) == 2
    assert "already exists and is not empty (use --force" in capsys.readouterr().err
    assert (out / "tensors.bin").read_bytes() == before
    assert save(*args, "--force") == 0
    assert (out / "tensors.bin").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def morphling_save(*argv: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``morphling save`` as a user runs it, its log quiet so stderr holds only the errors."""
    return subprocess.run([*MORPHLING, "--log-level", "warning", "save", "--no-progress",
                           *map(str, argv)], capture_output=True, text=True, timeout=300,
                          env=child_env(), cwd=cwd)  # fmt: skip


def a_checkpoint_plus_notes(directory: Path) -> None:
    assert save("--model", "opt-tiny", "--random-init", "--output", directory) == 0
    (directory / "notes.txt").write_text("precious")


def a_web_app(directory: Path) -> None:
    """The issue's case: a directory that merely has a file named index.json."""
    directory.mkdir()
    (directory / "index.json").write_text('{"name": "app"}')
    (directory / "important.txt").write_text("precious")


def a_thesis(directory: Path) -> None:
    directory.mkdir()
    (directory / "thesis.tex").write_text("precious")


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (a_web_app, "index.json does not say format 'morphling-checkpoint'"),
        (a_checkpoint_plus_notes, "it holds notes.txt, which a checkpoint does not"),
        (a_thesis, "no index.json"),
    ],
)
def test_force_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path, capsys, make, why):
    out = tmp_path / "out"
    make(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    code = save("--model", "opt-tiny", "--random-init", "--output", out, "--force")
    refused = (f"morphling save: {out}: not a Morphling checkpoint ({why}); refusing to "
               "replace it even with --force\n")  # fmt: skip
    assert (code, capsys.readouterr().err) == (2, refused)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging leftovers


def test_a_save_that_fails_midway_leaves_the_old_checkpoint_intact(tmp_path, model):
    out = tmp_path / "ckpt"
    assert morphling_save("--model", "opt-tiny", "--random-init", "--output", out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    shards[-1].write_bytes(shards[-1].read_bytes()[:1000])  # the last shard is corrupt
    proc = morphling_save("--model", tmp_path / "hf", "--output", out, "--force")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"morphling save: {shards[-1]}: cannot read safetensors file")
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with Checkpoint.open(out) as ckpt:  # verifies every checksum
        assert ckpt.source == "random-init opt-tiny seed=0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]


# opt-125m as float16: about 250 MB, written for long enough to act while it is written.
LARGE = ("--model", "opt-125m", "--random-init", "--dtype", "float16")


def saving_large(out: Path) -> subprocess.Popen[str]:
    """``morphling save --force`` of a large model to ``out``, started; returned once its
    staging directory beside ``out`` exists, so the model is being written."""
    proc = subprocess.Popen([*MORPHLING, "--log-level", "warning", "save", "--no-progress",
                             *LARGE, "--output", str(out), "--force"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env())  # fmt: skip
    deadline = time.monotonic() + 300
    while not list(out.parent.glob(f".{out.name}.*.tmp")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no staging directory"
        time.sleep(0.005)
    return proc


def test_a_file_added_while_the_model_is_written_is_never_deleted(tmp_path):
    """The review's case: --force proved the output a checkpoint before writing; a file
    added to it meanwhile was deleted at the swap unchecked (exit 0, notes.txt gone)."""
    out = tmp_path / "big"
    assert save("--model", "opt-tiny", "--random-init", "--output", out) == 0
    proc = saving_large(out)
    (out / "notes.txt").write_text("precious")
    _, stderr = proc.communicate(timeout=300)
    assert (proc.returncode, stderr) == (2, (
        f"morphling save: {out}: not a Morphling checkpoint (it holds notes.txt, which a "
        "checkpoint does not); refusing to replace it even with --force\n"))  # fmt: skip
    assert (out / "notes.txt").read_text() == "precious"
    with Checkpoint.open(out) as ckpt:  # the old checkpoint, whole
        assert ckpt.source == "random-init opt-tiny seed=0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]  # the new one removed


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_the_model_is_written_removes_the_staging_directory(tmp_path, sig, code):
    """SIGTERM killed the save on the spot, leaving the staging directory (hundreds of MB);
    Ctrl-C cleaned up but ended in a traceback. Both: one line, 128 + the signal."""
    out = tmp_path / "big"
    assert save("--model", "opt-tiny", "--random-init", "--output", out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = saving_large(out)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    name = signal.Signals(sig).name
    assert (proc.returncode, stderr) == (code, f"morphling save: interrupted by {name}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("output", [".", "../ck"])
def test_the_current_directory_is_refused_before_writing(tmp_path, capsys, monkeypatch, output):
    """Run inside the checkpoint: the whole model was written, then the swap failed with a
    raw '[Errno 16] Device or resource busy', exit 1. Now one line before writing, exit 2.
    (In this process: the checks are the command's own; its exit code, ``save``'s.)"""
    out = tmp_path / "ck"
    assert save("--model", "opt-tiny", "--random-init", "--output", out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.chdir(out)
    capsys.readouterr()
    code = save("--model", "opt-tiny", "--random-init", "--seed", 1, "--output", output, "--force")
    assert (code, capsys.readouterr().err) == (2, (
        f"morphling save: {output}: is the current directory; a save replaces the directory "
        "itself, which would leave this shell in a removed one: run it from the parent "
        "directory\n"))  # fmt: skip
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    monkeypatch.chdir(tmp_path)
    assert (
        save("--model", "opt-tiny", "--random-init", "--seed", 1, "--output", "ck", "--force") == 0
    )
    with Checkpoint.open(out) as ckpt:
        assert ckpt.source == "random-init opt-tiny seed=1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize(
    ("output", "problem"),
    [
        ("/proc/nope", "cannot create a directory in /proc: No such file or directory"),
        ("afile/sub", "cannot create a directory in afile: Not a directory"),
        ("afile", "exists and is not a directory; choose another --output"),
        ("link", "is a symbolic link; give the directory it points to"),
    ],
)
def test_an_unusable_output_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, output, problem):
    (tmp_path / "afile").write_text("kept")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to("dir")
    monkeypatch.chdir(tmp_path)
    code = save("--model", "opt-tiny", "--random-init", "--output", output)
    assert (code, capsys.readouterr().err) == (2, f"morphling save: {output}: {problem}\n")
    assert (tmp_path / "afile").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dir", "link"]


def test_cli_usage_errors(tmp_path, capsys):
    assert save("--model", "opt-tiny", "--output", tmp_path / "c") == 1
    assert "add --random-init" in capsys.readouterr().err
    assert save("--model", "opt-tiny", "--seed", 3, "--output", tmp_path / "c") == 2
    assert "--seed only applies with --random-init" in capsys.readouterr().err
    assert save("--model", "no-such-config", "--random-init", "--output", tmp_path / "c") == 1
    err = capsys.readouterr().err
    assert all(name in err for name in bundled_configs())


def test_morphling_cmd_accepts_save_only(tmp_path, capsys):
    out = tmp_path / "c"
    argv = ["save", "--no-progress", "--model", "gpt2-tiny", "--random-init", "--output", str(out)]
    assert cmd_main(argv) == 0
    with Checkpoint.open(out) as ckpt:
        assert ckpt.config == load_config("gpt2-tiny")
    with pytest.raises(SystemExit) as exc:
        cmd_main(["emulator"])
    assert exc.value.code == 2
    assert "invalid choice: 'emulator'" in capsys.readouterr().err


def test_iter_tensors_streams_each_file(tmp_path, model, state):
    model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    names = [name for name, _ in iter_tensors(model_files(tmp_path / "hf"))]
    assert sorted(names) == sorted(set(state) - {TIED})


def test_imports_stay_light():
    """``morphling --help`` builds the save parser: it must not need torch (an optional extra)."""
    code = (
        "import sys, morphling.commands.save; assert 'torch' not in sys.modules; "
        "import morphling.proxy.checkpoint.hf_models; assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
