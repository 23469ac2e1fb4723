"""Jobs in sequence on an emulator's shared checkpoint: told whose weights they continue
from, and able to start from the checkpoint as saved (``--fresh-weights``).

Real processes: an emulator sharing a checkpoint (``--ckpt-path``), a fleet that maps
it, and ``morphling run --server --ckpt`` jobs one after another, each running a small
script that saves its model's parameters as bound to the shared weights (before any
step) and after three SGD steps.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
from morphling.proxy.checkpoint.format import Checkpoint, write_checkpoint
from processes import MORPHLING, Procs, child_env

SCRIPT = """\
import pathlib, sys, time
import torch
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
with torch.no_grad():
    model(torch.zeros(1, 64))  # the first call binds the parameters to the shared weights
initial = {n: p.detach().clone() for n, p in model.named_parameters()}
if len(sys.argv) > 2:  # hold the weights until the test says go
    print("holding the weights", file=sys.stderr, flush=True)
    while not pathlib.Path(sys.argv[2]).exists():
        time.sleep(0.05)
for _ in range(3):
    loss = model(torch.randn(32, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
final = {n: p.detach().clone() for n, p in model.named_parameters()}
torch.save({"initial": initial, "final": final}, sys.argv[1])
"""
CONTINUING = "weights: continuing from the working copy that job '{}' trained for 3 steps; " \
    "--fresh-weights restores the checkpoint as saved"  # fmt: skip


@pytest.fixture
def shared(procs: Procs, tmp_path: Path):
    """An emulator sharing a checkpoint of the script's model, and a fleet mapping it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    ckpt = tmp_path / "ckpt"
    write_checkpoint(ckpt, [(n, p.detach()) for n, p in model.named_parameters()], source="test")
    emulator, port = procs.emulator("--no-probe", "--ckpt-path", str(ckpt))
    procs.fleet(port, "rpi4:2")
    procs.wait_for(emulator, "ready; scheduling", 2)
    (tmp_path / "train.py").write_text(SCRIPT)
    return emulator, port, ckpt


def job(port: int, ckpt: Path, tmp_path: Path, out: str, *flags: str) -> subprocess.Popen:
    log = (tmp_path / f"{out}.log").open("w")
    return subprocess.Popen(
        [*MORPHLING, "run", "--server", f"127.0.0.1:{port}", "--ckpt", str(ckpt),
         "--min-flops", "0", *flags, "--", "python", str(tmp_path / "train.py"),
         str(tmp_path / f"{out}.pt"), *(() if out != "holder" else (str(tmp_path / "go"),))],
        stdout=log, stderr=log, env=child_env(), cwd=tmp_path,
    )  # fmt: skip


def finished(popen: subprocess.Popen, tmp_path: Path, out: str) -> tuple[int, str]:
    code = popen.wait(timeout=180)
    return code, (tmp_path / f"{out}.log").read_text()


def ran(port, ckpt, tmp_path, out, *flags) -> tuple[str, dict]:
    code, text = finished(job(port, ckpt, tmp_path, out, *flags), tmp_path, out)
    assert code == 0, text
    return text, torch.load(tmp_path / f"{out}.pt", weights_only=True)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_a_second_job_is_told_it_continues_and_fresh_weights_start_from_the_checkpoint(
    shared, tmp_path
):
    emulator, port, ckpt = shared
    with Checkpoint.open(ckpt) as saved:
        as_saved = {name: saved.tensor(name).clone() for name in saved.names()}
    script = str(tmp_path / "train.py")

    text, first = ran(port, ckpt, tmp_path, "first")
    assert "weights: continuing" not in text
    assert_same(first["initial"], as_saved)
    assert not torch.equal(first["final"]["0.weight"], as_saved["0.weight"]), "it trained"

    text, second = ran(port, ckpt, tmp_path, "second")
    assert CONTINUING.format(script) in text
    assert_same(second["initial"], first["final"])
    assert "continues from the shared weights as trained by" in emulator.text()

    text, fresh = ran(port, ckpt, tmp_path, "fresh", "--fresh-weights")
    assert "weights: continuing" not in text
    assert_same(fresh["initial"], as_saved)
    assert "starts from the checkpoint's weights, restored" in emulator.text()

    text, after = ran(port, ckpt, tmp_path, "after")
    assert CONTINUING.format(script) in text, "only the restoring job's steps count now"
    assert_same(after["initial"], fresh["final"])


def test_fresh_weights_are_refused_while_another_job_maps_them(shared, tmp_path):
    emulator, port, ckpt = shared
    holder = job(port, ckpt, tmp_path, "holder")
    log = tmp_path / "holder.log"
    for _ in range(2400):
        if "holding the weights" in log.read_text() or holder.poll() is not None:
            break
        time.sleep(0.05)
    assert "holding the weights" in log.read_text(), log.read_text()

    code, text = finished(job(port, ckpt, tmp_path, "fresh", "--fresh-weights"), tmp_path, "fresh")
    assert code == 1, text
    assert "weights_busy: OPEN.fresh_weights: the shared weights are in use (job 1 (" in text
    assert "restoring them now would change them under it" in text

    (tmp_path / "go").touch()
    code, text = finished(holder, tmp_path, "holder")
    assert code == 0, text
    with Checkpoint.open(ckpt) as saved:
        held = torch.load(tmp_path / "holder.pt", weights_only=True)
        assert_same(held["initial"], {n: saved.tensor(n) for n in saved.names()})
    assert emulator.alive


def test_fresh_weights_need_a_checkpoint(tmp_path):
    code = subprocess.run(
        [*MORPHLING, "run", "--server", "127.0.0.1:1", "--fresh-weights", "--", "python",
         str(tmp_path / "x.py")],
        capture_output=True, text=True, env=child_env(), timeout=60, check=False,
    )  # fmt: skip
    assert code.returncode == 2 and "--fresh-weights needs --ckpt" in code.stderr
