#!/usr/bin/env python3
"""Training benchmarks: emulation overhead, memory per device, weight references.

Writes ``bench-results/train.json`` with three groups on a transformer, OPT
(opt-125m's architecture cut to 2 layers: hidden 768, vocab 50272), batch 4 × 128
tokens, AdamW:

- ``step_overhead``: wall seconds of a training step run natively, under
  ``morphling run --embedded --devices 8``, and with the emulator and an
  8-device fleet in other processes (``--server``); each the median of the
  steps after the first (warm-up), runs alternating; ratios to native.
- ``fleet_rss_mib``: peak RSS (VmHWM) of a ``morphling fleet`` process after
  a job ran two steps on it with shared weights (``--ckpt``), with 10 and with
  1,000 virtual devices; the difference.
- ``weight_refs`` and ``shared_memory``: bytes the emulator sent to devices on the
  wire per step (``wire_down`` of the ``--json`` report) under ``--embedded --devices
  8``: with every operand as bytes (``--arena-bytes 0 --no-share-memory``), with weights
  by reference (the same and ``--ckpt``), and with shared memory (the default, no
  checkpoint: in the embedded emulator's process the job hands its operands over as
  arrays); each ratio is to the first. (The report's ``bytes_down`` is
  what crossed the *emulated* links: there a weight changed by the optimizer step must
  reach the device again, so it is the same whatever the wire carried.)

and one on a CNN, whose convolutions (forward, input and weight gradients) are what
goes to the fleet:

- ``cnn_overhead``: wall seconds of a training step of torchvision's ResNet-18 layout
  (7×7 stem, max pool, four stages of two BasicBlocks with BatchNorm, 64-128-256-512
  channels, average pool, a 1000-way fc), batch 16 of 3×224×224 (ImageNet's size, and a
  step on the order of a second natively on a 2-core host), SGD with momentum, run
  natively and under ``morphling run --embedded --devices 8``, as ``step_overhead``'s;
  the ratio.

and one on operand residency (devices keep the blocks a request sent them, and greedy
places a request's tiles as blocks of rows × columns), each figure from the ``--json``
report's ``bytes_down``, the bytes the emulated links carried:

- ``reuse.gemm_2048_bytes_ratio``: one 2048³ float32 GEMM on four Pi 4s on the LAN
  (``--embedded --devices rpi4:4 --link lan``), over the least a 2×2 partition needs
  (each device half of A and half of B: 64 MiB in all); beside it, the bytes with
  ``--no-residency``;
- ``reuse.demo_step_bytes_ratio``: the demo's training step (``train_demo_model.py``, on
  the demo's fleet) with residency over ``--no-residency``, the last of three steps;
- ``reuse.demo_wifi_step_ratio``: the demo's emulated step on ``rpi4:16`` over Wi-Fi,
  with residency over without.

``--only transformer``, ``--only cnn`` or ``--only reuse`` runs those groups alone (the
output then holds only theirs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from bench_net import (
    ChildFailed,
    Children,
    morphling_cmd,
    ready_devices,
    sigterm_unwinds,
    start_emulator,
    wait_for,
)

if TYPE_CHECKING:
    from tqdm import tqdm

STEP_SCRIPT = """\
import json, sys, time, torch
from morphling.proxy.checkpoint.hf_models import build_model, load_config
torch.manual_seed(0)
cfg = load_config("opt-125m")
cfg["num_hidden_layers"] = 2
model = build_model(cfg, seed=0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, cfg["vocab_size"], (4, 128))
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


CNN_STEP_SCRIPT = """\
import json, sys, time, torch
from torch import nn

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))

def resnet18():
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))

torch.manual_seed(0)
model = resnet18()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(16, 3, 224, 224)
y = torch.randint(0, 1000, (16,))
times = []
for _ in range(int(sys.argv[1])):
    start = time.perf_counter()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""
GROUPS = ("transformer", "cnn", "reuse")
GEMM_2048_SCRIPT = """\
import torch
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
w = torch.zeros(1, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)  # its step marks the training step
c = a @ b
w.grad = torch.zeros(1)
opt.step()
"""
DEMO_FLEET = "rpi4:6,rpi5:4,jetson-nano:2,orin-nano:4"  # scripts/demo.py's


def checked(cmd: list[str], timeout: float = 900) -> str:
    """``cmd``'s stdout; ``ChildFailed`` with its stderr's end if it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ChildFailed(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def step_times(cmd: list[str], timeout: float = 900) -> list[float]:
    """The step times the script printed (its last stdout line)."""
    return json.loads(checked(cmd, timeout).strip().splitlines()[-1])


def run_cmd(script: Path, steps: int, *options: str) -> list[str]:
    return morphling_cmd("run", *options, "--", "python", str(script), str(steps),
                         log_level="warning")  # fmt: skip


def bench_overhead(children: Children, script: Path, steps: int, reps: int) -> dict:
    _, port = start_emulator(children, "emulator")
    children.start("fleet", morphling_cmd("fleet", "--server", f"127.0.0.1:{port}",
                                          "--devices", "8", log_level="warning"))  # fmt: skip
    wait_for("8 devices", lambda: ready_devices(children, "emulator") >= 8, children, 120)
    native, embedded, socket = [], [], []
    for _ in range(reps):  # alternating, so load from elsewhere hits all alike
        native += step_times([sys.executable, str(script), str(steps)])[1:]
        embedded += step_times(run_cmd(script, steps, "--embedded", "--devices", "8"))[1:]
        socket += step_times(run_cmd(script, steps, "--server", f"127.0.0.1:{port}"))[1:]
    children.stop_named("fleet", "emulator")
    n, e, s = (statistics.median(x) for x in (native, embedded, socket))
    return {
        "native_s": round(n, 3), "embedded_s": round(e, 3), "socket_s": round(s, 3),
        "embedded_ratio": round(e / n, 3), "socket_ratio": round(s / n, 3),
        "target_embedded_ratio_max": 1.5, "target_socket_ratio_max": 3.0,
        "met": e / n <= 1.5 and s / n <= 3.0,
    }  # fmt: skip


def bench_cnn(script: Path, steps: int, reps: int) -> dict:
    """``step_overhead``'s measurement without the fleet in other processes: the CNN's
    products are convolutions, whose socket path the transformer's group already covers."""
    native, embedded = [], []
    for _ in range(reps):  # alternating, as bench_overhead's
        native += step_times([sys.executable, str(script), str(steps)])[1:]
        embedded += step_times(run_cmd(script, steps, "--embedded", "--devices", "8"))[1:]
    n, e = statistics.median(native), statistics.median(embedded)
    return {
        "native_s": round(n, 3), "embedded_s": round(e, 3), "ratio": round(e / n, 3),
        "target_ratio_max": 1.5, "met": e / n <= 1.5,
    }  # fmt: skip


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


def bench_fleet_rss(children: Children, script: Path, ckpt: Path) -> dict:
    peaks = {}
    for count in (10, 1000):
        name = f"emulator-{count}"
        _, port = start_emulator(children, name, "--ckpt-path", str(ckpt))
        fleet = children.start(f"fleet-{count}", morphling_cmd(
            "fleet", "--server", f"127.0.0.1:{port}", "--devices", str(count),
            log_level="warning"))  # fmt: skip
        wait_for(f"{count} devices", lambda n=name, c=count: ready_devices(children, n) >= c,
                 children, 600)  # fmt: skip
        step_times(run_cmd(script, 2, "--server", f"127.0.0.1:{port}", "--ckpt", str(ckpt)))
        peaks[count] = peak_rss_mib(fleet.pid)
        children.stop_named(f"fleet-{count}", name)
    delta = peaks[1000] - peaks[10]
    return {
        "rss_10_mib": round(peaks[10], 1), "rss_1000_mib": round(peaks[1000], 1),
        "delta_10_to_1000": round(delta, 1), "target_delta_max": 100, "met": delta <= 100,
    }  # fmt: skip


def bench_wire_bytes(script: Path, ckpt: Path, workdir: Path) -> dict:
    """Bytes sent to devices per step, all as bytes vs by weight reference vs with shared
    memory; the first two with the arena and hand-over off, so each isolates one path."""
    down = {}
    for label, extra in (
        ("bytes", ["--arena-bytes", "0", "--no-share-memory"]),
        ("weight_refs", ["--arena-bytes", "0", "--no-share-memory", "--ckpt", str(ckpt)]),
        ("shared", []),
    ):
        report = workdir / f"wire-{label}.json"
        step_times(run_cmd(script, 2, "--embedded", "--devices", "8", "--json", str(report),
                           *extra))  # fmt: skip
        down[label] = json.loads(report.read_text())["steps"][-1]["wire_down"]
    return {
        "weight_refs": {
            "bytes_down_per_step_without": down["bytes"],
            "bytes_down_per_step_with": down["weight_refs"],
            "bytes_ratio": round(down["weight_refs"] / down["bytes"], 3),
        },
        "shared_memory": {
            "bytes_down_per_step_without": down["bytes"],
            "bytes_down_per_step_with": down["shared"],
            "bytes_ratio": round(down["shared"] / down["bytes"], 3),
        },
    }


def last_step(workdir: Path, label: str, script: list[str], *options: str) -> dict:
    """The last step of ``script`` run under ``morphling run --embedded`` with
    ``options``, as its ``--json`` report gives it."""
    report = workdir / f"{label}.json"
    cmd = morphling_cmd("run", "--embedded", "--no-report", "--json", str(report), *options,
                        "--", "python", *script, log_level="warning")  # fmt: skip
    checked(cmd)
    return json.loads(report.read_text())["steps"][-1]


def bench_reuse(workdir: Path) -> dict:
    """``reuse``: bytes on the emulated links with operand residency, against the least
    a 2-D partition needs and against ``--no-residency`` (the module docstring says how)."""
    gemm = workdir / "gemm_2048.py"
    gemm.write_text(GEMM_2048_SCRIPT)
    fleet = ["--devices", "rpi4:4", "--link", "lan"]
    one = last_step(workdir, "gemm", [str(gemm)], *fleet)
    every_tile = last_step(workdir, "gemm-without", [str(gemm)], *fleet, "--no-residency")
    bound = 4 * (2048 * 1024 * 4 + 1024 * 2048 * 4)  # each device: half of A, half of B
    demo = [str(Path(__file__).with_name("train_demo_model.py")), "--steps", "3"]
    fleets = {"demo": ["--devices", DEMO_FLEET], "wifi": ["--devices", "rpi4:16", "--link", "wifi"]}
    steps = {
        (fleet, residency): last_step(workdir, f"{fleet}{residency}", demo, *options, residency)
        for fleet, options in fleets.items()
        for residency in ("--residency", "--no-residency")
    }
    demo_with, demo_without = steps["demo", "--residency"], steps["demo", "--no-residency"]
    wifi_with, wifi_without = steps["wifi", "--residency"], steps["wifi", "--no-residency"]
    ratios = {
        "gemm_2048_bytes_ratio": one["bytes_down"] / bound,
        "demo_step_bytes_ratio": demo_with["bytes_down"] / demo_without["bytes_down"],
        "demo_wifi_step_ratio": wifi_with["emulated_s"] / wifi_without["emulated_s"],
    }
    targets = {"gemm_2048_bytes_ratio": 1.1, "demo_step_bytes_ratio": 0.45,
               "demo_wifi_step_ratio": 0.5}  # fmt: skip
    return {
        "gemm_2048_bytes_down": one["bytes_down"],
        "gemm_2048_lower_bound": bound,
        "gemm_2048_bound_reported": one["bytes_bound"],  # the run's own bound: equal to it
        "gemm_2048_bytes_down_without": every_tile["bytes_down"],
        "gemm_2048_step_s_with": round(one["emulated_s"], 4),
        "gemm_2048_step_s_without": round(every_tile["emulated_s"], 4),
        "demo_step_bytes_down_with": demo_with["bytes_down"],
        "demo_step_bytes_down_without": demo_without["bytes_down"],
        "demo_step_bytes_bound_with": demo_with["bytes_bound"],  # its partitions' least
        "demo_step_bytes_up": demo_with["bytes_up"],  # (residency sends every output back)
        "demo_wifi_step_s_with": round(wifi_with["emulated_s"], 4),
        "demo_wifi_step_s_without": round(wifi_without["emulated_s"], 4),
        **{key: round(value, 4) for key, value in ratios.items()},
        **{f"{key}_met": ratios[key] <= target for key, target in targets.items()},
        **{f"target_{key}_max": target for key, target in targets.items()},
        "met": all(ratios[key] <= target for key, target in targets.items()),
    }


def run(args: argparse.Namespace) -> dict:
    from benchlib import run_meta
    from tqdm import tqdm

    groups = GROUPS if args.only is None else (args.only,)
    with (
        sigterm_unwinds(),
        tempfile.TemporaryDirectory(prefix="bench-train-") as tmp,
        tqdm(total=3 * ("transformer" in groups) + ("cnn" in groups) + ("reuse" in groups),
             desc="train benchmarks", unit="group") as bar,
    ):  # fmt: skip
        workdir = Path(tmp)
        children = Children(workdir)
        results = {}
        try:
            if "transformer" in groups:
                results.update(bench_transformer(children, workdir, args, bar))
            if "cnn" in groups:
                bar.set_description("cnn_overhead")
                script = workdir / "cnn_step.py"
                script.write_text(CNN_STEP_SCRIPT)
                results["cnn_overhead"] = bench_cnn(script, args.steps, args.reps)
                bar.update()
            if "reuse" in groups:
                bar.set_description("reuse")
                results["reuse"] = bench_reuse(workdir)
                bar.update()
        except ChildFailed as exc:
            raise SystemExit(f"bench_train: {exc}") from None
        finally:
            children.close()
    meta = {"steps": args.steps, "devices": 8}
    if "transformer" in groups:
        meta.update(model="opt-125m, 2 layers", batch="4 x 128 tokens")
    if "cnn" in groups:
        meta.update(cnn_model="resnet-18 layout", cnn_batch="16 x 3x224x224")
    results["meta"] = run_meta(args.reps, **meta)
    return results


def bench_transformer(
    children: Children, workdir: Path, args: argparse.Namespace, bar: tqdm
) -> dict:
    """The OPT groups: ``step_overhead``, ``weight_refs``, ``shared_memory``, ``fleet_rss_mib``."""
    script = workdir / "step.py"
    script.write_text(STEP_SCRIPT)
    config = workdir / "opt-2l.json"
    from morphling.proxy.checkpoint.hf_models import load_config

    config.write_text(json.dumps({**load_config("opt-125m"), "num_hidden_layers": 2}))
    ckpt = workdir / "ckpt"
    subprocess.run(morphling_cmd("save", "--model", str(config), "--random-init", "--seed",
                                 "0", "--output", str(ckpt), "--no-progress"),
                   check=True, capture_output=True)  # fmt: skip
    results = {}
    bar.set_description("step_overhead")
    results["step_overhead"] = bench_overhead(children, script, args.steps, args.reps)
    bar.update()
    bar.set_description("wire bytes")
    results.update(bench_wire_bytes(script, ckpt, workdir))
    bar.update()
    bar.set_description("fleet_rss_mib")
    results["fleet_rss_mib"] = bench_fleet_rss(children, script, ckpt)
    bar.update()
    return results


def main(argv: list[str] | None = None) -> int:
    from benchlib import step_main

    def only(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--only", choices=GROUPS, help="run only these groups (default: all)")

    return step_main(run, __doc__.splitlines()[0], output="bench-results/train.json", reps=2,
                     steps=4, argv=argv, extend=only)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
