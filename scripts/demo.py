#!/usr/bin/env python3
"""The main job: a small OPT trained on 16 heterogeneous virtual devices.

An embedded emulator and a fleet (Raspberry Pis and Jetsons, each with its
own profile) run in this process over loopback sockets; every GEMM of the
forward and backward pass is cut into tiles that the fleet computes for
real. Prints one row per optimizer step — the loss, the emulated step time
(from the virtual timeline: the fleet's links and compute queues, plus this
host's coordinator time), GEMMs and bytes moved — and writes ``summary.json``
and ``steps.png`` to the output directory, with the run directory (event
log, Perfetto trace, per-device timeline and utilisation plots) in
``OUTPUT/run``. Runs offline: the model is built from a bundled config.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from morphling.proxy.checkpoint.hf_models import build_model, load_config
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.report.analysis import summarize
from morphling.proxy.report.files import write_report_files
from morphling.proxy.report.load import load_run
from morphling.proxy.report.text import format_summary

import morphling

DEFAULT_FLEET = "rpi4:6,rpi5:4,jetson-nano:2,orin-nano:4"
# opt-tiny, widened so that the GEMMs are worth tiling: hidden 256, 2 layers.
MODEL = {"hidden_size": 256, "word_embed_proj_dim": 256, "ffn_dim": 1024}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default=DEFAULT_FLEET, help=f"fleet SPEC (default {DEFAULT_FLEET})")
    p.add_argument("--steps", type=int, default=5, help="AdamW steps (default 5)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--block", type=int, default=128, help="tile edge (default 128)")
    p.add_argument("--output", type=Path, default=Path("demo-output"), help="where to write")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def plot(steps: list[dict], losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps]
    fleet = [s["fleet_s"] for s in steps]
    coordinator = [s["coord_s"] for s in steps]
    fig, (ax, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    ax.bar(x, fleet, label="fleet GEMMs (virtual timeline)")
    ax.bar(x, coordinator, bottom=fleet, label="coordinator (measured)")
    ax.set(xlabel="step", ylabel="emulated seconds", title="Emulated step time")
    ax.legend()
    ax_loss.plot(x, losses, marker="o")
    ax_loss.set(xlabel="step", ylabel="loss", title="Training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    config = load_config("opt-tiny")
    config.update(MODEL)
    model = build_model(config, seed=args.seed)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, config["vocab_size"], (args.batch, args.seq))  # one batch, learnt

    print(f"OPT ({params / 1e6:.1f} M parameters), batch {args.batch}×{args.seq} tokens, "
          f"on {args.devices}")  # fmt: skip
    start = time.perf_counter()
    losses: list[float] = []
    run_dir = args.output / "run"
    emulator = EmulatorConfig(run_dir=str(run_dir))
    with morphling.emulate(devices=args.devices, block=args.block, config=emulator) as session:
        print(f"fleet ready in {time.perf_counter() - start:.1f} s\n")
        head = (f"{'step':>4} {'loss':>8} {'emulated s':>11} {'GEMMs':>6} {'tiles':>6} "
                f"{'MiB down':>9} {'MiB up':>7}")  # fmt: skip
        print(head, "-" * len(head), sep="\n")
        for _ in range(args.steps):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()  # closes the step: session.steps[-1]
            opt.zero_grad()
            losses.append(loss.item())
            r = session.steps[-1]
            mib_down, mib_up = r.bytes_down / 2**20, r.bytes_up / 2**20
            print(f"{r.step:>4} {losses[-1]:>8.4f} {r.emulated_s:>11.4f} {r.gemms:>6} "
                  f"{r.tiles:>6} {mib_down:>9.1f} {mib_up:>7.1f}")  # fmt: skip
    summary = session.summary()
    summary.update(devices=args.devices, losses=losses, parameters=params)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary["steps"], losses, args.output / "steps.png")
    run = load_run(run_dir)
    report = summarize(run)
    written = write_report_files(run, report)
    print("\n" + format_summary(report))
    print(f"\n{session.counts.remote} GEMMs on the fleet; wrote {args.output}/summary.json, "
          f"{args.output}/steps.png and {run_dir}/ ({', '.join(p.name for p in written)}) "
          f"in {time.perf_counter() - start:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
