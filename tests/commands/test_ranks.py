"""``morphling run --ranks N``: real ranks over gloo, each on its own virtual board.

Each script in ``tests/scripts/ranks_*.py`` prints one JSON line per rank with its losses;
a run under ``morphling run --ranks`` must print the same as ``torchrun`` does, and its
collectives must take their closed forms in virtual time on the ranks' links.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from morphling.devices.models.profiles import BUILTIN
from morphling.proxy.report.analysis import summarize
from morphling.proxy.report.load import load_run
from morphling.proxy.report.trace import chrome_trace
from morphling.proxy.vtime.eventlog import COMPRESSED_EVENTS_FILE
from processes import (
    MORPHLING_RUN,
    SCRIPTS,
    child_env,
    free_port,
    morphling_here,
    morphling_run,
    rank_objects,
    succeeded,
    torchrun,
)


def losses(stdout: str) -> dict[int, list[float]]:
    """Each rank's losses, from its JSON object."""
    return {obj["rank"]: obj["losses"] for obj in rank_objects(stdout)}


@functools.cache  # three tests compare against ranks_ddp.py's: torchrun runs it once
def torchrun_losses(script: str, *args: str) -> dict[int, list[float]]:
    return losses(succeeded(torchrun(script, *args)).stdout)


def ranks_run(tmp: Path, script: str, *args: str, devices: str = "rpi4:2", flags=()):
    """``morphling run --ranks 2`` of ``script``: the process, its --json and run dir."""
    run_dir, report = tmp / "run", tmp / "ranks.json"
    proc = morphling_run("--ranks", "2", "--embedded", "--devices", devices, "--min-flops", "0",
                         "--run-dir", run_dir, "--json", report, *flags, "--", "python",
                         SCRIPTS / script, *args, cwd=tmp)  # fmt: skip
    return proc, report, run_dir


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = gzip.decompress((run_dir / COMPRESSED_EVENTS_FILE).read_bytes()).splitlines()
    return [r for r in map(json.loads, lines) if r["ev"] == kind]


def collectives(run_dir: Path) -> list[dict]:
    return records(run_dir, "collective")


@pytest.mark.parametrize(
    "script", ["ranks_ddp.py", "ranks_fedavg.py", "ranks_pipeline.py", "ranks_fsdp.py"]
)
def test_ranks_train_as_torchrun_does(tmp_path: Path, script: str) -> None:
    proc, report, run_dir = ranks_run(tmp_path, script)
    succeeded(proc)
    got, expected = losses(proc.stdout), torchrun_losses(script)
    assert got.keys() == expected.keys() == {0, 1}
    for rank, values in expected.items():
        assert got[rank] == pytest.approx(values, rel=1e-5, abs=1e-6), rank
    run = json.loads(report.read_text())
    assert [r["device"] for r in run["ranks"]] == ["rpi4-0", "rpi4-1"]
    assert all(r["collectives"] > 0 and r["exit_code"] == 0 for r in run["ranks"])
    assert all(s["comm_s"] > 0 for r in run["ranks"] for s in r["steps"][1:]) or script == (
        "ranks_fedavg.py"  # its all-reduces come every other step
    )
    if script == "ranks_ddp.py":  # each gradient all-reduce: the ring's closed form, n = 2
        p = BUILTIN["rpi4"]  # on its own links (the built-in LAN); Wi-Fi's: test_collectives
        reduces = [c for c in collectives(run_dir) if c["op"] == "allreduce"]
        assert len(reduces) == 2 * 4  # each rank's bucket, each step
        for c in reduces:
            closed = c["nbytes"] / min(p.ul_bw, p.dl_bw) + 2 * (p.ul_lat_s + p.dl_lat_s)
            assert c["end"] - c["start"] == pytest.approx(closed, rel=1e-9)
        # The rank waits for its bucket's all-reduce where the backward pass copies the
        # bucket back, and computes on from its end: the copy, then the optimizer.
        coords = records(run_dir, "coord")
        for c in reduces:
            after = [s for s in coords if (s["job"], s["step"]) == (c["job"], c["step"])
                     and s["t0"] >= c["end"]]  # fmt: skip
            assert after and after[0]["t0"] == c["end"], (c, after)
            assert "optimizer" in (after[-1].get("split") or {}), after
    if script == "ranks_fsdp.py":  # parameters all-gathered, gradients reduce-scattered
        assert {c["op"] for c in collectives(run_dir)} >= {"allgather", "reduce_scatter"}
    if script == "ranks_pipeline.py":  # each its own operation: a pair's apart from the group's
        ops = sorted((c["op"], c["members"]) for c in collectives(run_dir))
        assert ops == sorted([("send", 2), ("recv", 2)] * 2 * 3 + [("allreduce", 2)] * 2), ops


def test_ranks_whose_devices_churn_restart_their_steps_and_train_as_torchrun_does(
    tmp_path: Path,
) -> None:
    """Issue 24's --on-leave: the devices leave and come back in virtual time; each rank
    does its step again once back, and only the timeline moves."""
    flags = ("--churn", "mtbf=0.05,mttr=0.02,seed=1", "--on-leave", "restart")
    proc, report, run_dir = ranks_run(tmp_path, "ranks_ddp.py", flags=flags)
    succeeded(proc)
    expected = torchrun_losses("ranks_ddp.py")
    for rank, values in expected.items():
        assert losses(proc.stdout)[rank] == pytest.approx(values, rel=1e-5, abs=1e-6), rank
    steps = [s for r in json.loads(report.read_text())["ranks"] for s in r["steps"]]
    interrupted = sum(s["interruptions"] for s in steps)
    assert interrupted > 0 and sum(s["lost_s"] for s in steps) > 0
    away = records(run_dir, "away")
    assert len(away) == interrupted and {a["device"] for a in away} <= {0, 1}


def timeline(run_dir: Path) -> list[dict]:
    """The run's events, each job named by its rank, without the timeline's tile numbers
    (which count every rank's tiles in the order they came), in a canonical order."""
    names = {j["id"]: j["name"] for j in json.loads((run_dir / "run.json").read_text())["jobs"]}
    events = []
    for line in gzip.decompress((run_dir / COMPRESSED_EVENTS_FILE).read_bytes()).splitlines():
        event = json.loads(line)
        if "job" in event:
            event["job"] = names[event["job"]].rsplit(" ", 1)[-1]
        event.pop("tile", None)
        event.pop("last_tile", None)
        events.append(event)
    return sorted(events, key=lambda e: json.dumps(e, sort_keys=True))


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_ranks_computing_their_own_products_give_the_devices_timeline(
    tmp_path: Path, model: str
) -> None:
    """``--products rank`` (``--ranks``' default): each rank computes its GEMMs and
    convolutions with torch's own kernels and its device only times them. The timeline is
    the one ``--products device`` gives, where the device computes them, event for event;
    the losses are torchrun's to the bit (its numerics are torchrun's own)."""
    runs = {}
    for products in ("rank", "device"):
        (tmp_path / products).mkdir()
        proc, _, run_dir = ranks_run(tmp_path / products, "ranks_ddp.py", "3", "-1", "-1", "-1",
                                     model, devices="rpi4:1,rpi5:1",
                                     flags=["--products", products])  # fmt: skip
        runs[products] = (losses(succeeded(proc).stdout), timeline(run_dir))
    assert runs["rank"][0] == torchrun_losses("ranks_ddp.py", "3", "-1", "-1", "-1", model)
    for rank, values in runs["rank"][0].items():
        assert runs["device"][0][rank] == pytest.approx(values, rel=1e-5, abs=1e-6)
    mine, devices = runs["rank"][1], runs["device"][1]
    kinds = {e.get("op", "gemm") for e in mine if e["ev"] == "gemm"}
    assert kinds == ({"gemm"} if model == "mlp" else {"gemm", "conv_forward", "conv_grad_input",
                                                       "conv_grad_weight"})  # fmt: skip
    assert len(mine) == len(devices)
    for got, expected in zip(mine, devices, strict=True):
        assert got == expected


def test_a_slow_board_is_the_straggler_the_others_wait_for(tmp_path: Path) -> None:
    """On a parameter server (``--collective star``): each all-reduce sends its bytes up
    every rank's uplink at once, then down every downlink; the report and the trace show
    each rank's collectives, with a flow from the rank that started each to the other."""
    proc, report, run_dir = ranks_run(tmp_path, "ranks_ddp.py", devices="rpi4:1,rpi5:1",
                                      flags=["--collective", "star"])  # fmt: skip
    succeeded(proc)
    run = json.loads(report.read_text())
    waited = {r["device"]: sum(s["comm_wait_s"] for s in r["steps"]) for r in run["ranks"]}
    assert waited["rpi4-0"] == 0 and waited["rpi5-1"] > 0, waited
    assert "stragglers: rank 0 waited least" in proc.stderr
    boards = [BUILTIN["rpi4"], BUILTIN["rpi5"]]
    parts = collectives(run_dir)
    for c in parts:
        up = max(p.ul_lat_s + c["nbytes"] / p.ul_bw for p in boards)
        down = max(p.dl_lat_s + c["nbytes"] / p.dl_bw for p in boards)
        assert c["end"] - c["start"] == pytest.approx(up + down, rel=1e-9)
    loaded = load_run(run_dir)
    rows = summarize(loaded)["collectives"]
    assert rows["algorithm"] == "star"
    table = proc.stderr[proc.stderr.index("collectives (star; steps ") :]
    assert re.search(r"\n +1 .*ranks_ddp\.py rank \d +allreduce +4 ", table), table
    reduces = [(r["job"], r["count"]) for r in rows["rows"] if r["op"] == "allreduce"]
    assert reduces == [(1, 4), (2, 4)]  # each step's bucket; DDP's set-up adds the others
    assert {r["op"] for r in rows["rows"]} == {"allreduce", "allgather", "broadcast"}
    events = chrome_trace(loaded)["traceEvents"]
    tracks = [e for e in events if e["ph"] == "M" and e["args"].get("name") == "collectives"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "collective"]
    flows = sorted((e["id"], e["ph"], e["pid"]) for e in events if e["ph"] in "sf")
    assert len(tracks) == 2 and len(spans) == len(parts)
    assert len(flows) == len(parts)  # a start and a finish per collective of the two ranks
    for start, finish in zip(flows[1::2], flows[::2], strict=True):
        assert start[:2] == (finish[0], "s") and finish[1] == "f" and start[2] != finish[2]


def test_a_rank_that_ends_early_fails_the_others_and_the_run_says_why(tmp_path: Path) -> None:
    """Rank 1 leaves (exit 0) at step 2; rank 0's next all-reduce fails in gloo: nothing
    hangs, and the failure names rank 0 with gloo's words and the rank that left."""
    proc, report, run_dir = ranks_run(tmp_path, "ranks_ddp.py", "4", "-1", "2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"morphling run: rank 0 \(device rpi4-0\) exited with code 1; its last "
                     r"words: .*Connection (closed|reset) by peer.* \(after rank 1 had "
                     r"exited with code 0", proc.stderr), proc.stderr[-3000:]  # fmt: skip
    run = json.loads(report.read_text())
    assert [(r["exit_code"], len(r["steps"])) for r in run["ranks"]] == [(1, 2), (0, 2)]
    assert (
        "rank 0 (device rpi4-0) exited with code 1"
        in json.loads((run_dir / "run.json").read_text())["incomplete"]
    )


def test_a_stuck_rank_is_dropped_dumps_its_stacks_and_stops_the_run(tmp_path: Path) -> None:
    """Rank 1 blocks holding the GIL at step 2 (no heartbeat, deaf to the emulator closing
    its connection); rank 0 waits for it in gloo. The emulator drops rank 1's job once it is
    silent past the heartbeat timeout; the run then stops both, names rank 1 as stuck, and
    its stderr shows where it was."""
    proc, report, run_dir = ranks_run(tmp_path, "ranks_ddp.py", "4", "-1", "-1", "2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"morphling run: rank 1 \(device rpi4-1\) was stuck: the emulator dropped "
                     r"its job \(timeout: nothing received for 15(\.0)? s\)", proc.stderr), (
        proc.stderr[-3000:])  # fmt: skip
    dumped = [line for line in proc.stderr.splitlines() if line.startswith("[rank1]: ")]
    assert any('ranks_ddp.py", line' in line for line in dumped), proc.stderr[-3000:]
    run = json.loads(report.read_text())
    assert [(r["exit_code"] != 0, r["stopped"]) for r in run["ranks"]] == [(True, True)] * 2
    incomplete = json.loads((run_dir / "run.json").read_text())["incomplete"]
    assert incomplete.startswith("rank 1 (device rpi4-1) was stuck")


def test_collectives_of_different_sizes_fail_with_gloos_error_marked_with_its_rank(
    tmp_path: Path,
) -> None:
    proc, report, run_dir = ranks_run(tmp_path, "ranks_mismatch.py")
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if "collective mismatch" in line]
    assert any(line.startswith("[rank0]: ") for line in said), proc.stderr[-3000:]
    assert re.search(
        r"morphling run: rank \d \(device rpi4-\d\) (was killed by SIGABRT|"
        r"exited with code 1); its last words: ",
        proc.stderr,
    ), proc.stderr[-3000:]
    run = json.loads(report.read_text())
    failed = [r for r in run["ranks"] if r["exit_code"] and not r["stopped"]]  # (both may
    assert failed and all(r["last_words"] for r in failed)  # fail before either is stopped)
    incomplete = json.loads((run_dir / "run.json").read_text())["incomplete"]
    assert incomplete.startswith(f"rank {failed[0]['rank']} (device ")


def test_more_ranks_than_devices_is_refused_naming_both(tmp_path: Path) -> None:
    proc = morphling_run("--ranks", "3", "--embedded", "--devices", "rpi4:2", "--", "python",
                         SCRIPTS / "ranks_ddp.py", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert "--ranks 3 needs 3 devices" in proc.stderr and "has 2" in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--coordinator", "rpi5"], "--ranks does not take --coordinator"),
        (["--coordinator-time", "measured"], "--ranks does not take --coordinator-time measured"),
        (["--device", "rpi4-0"], "--ranks does not take --device"),
        (["--server", "127.0.0.1:1"], "--ranks needs --embedded"),
        (["--rank-devices", "rpi4-0"], "--rank-devices names 1 devices: it needs one per rank"),
        (["--rank-devices", "rpi4-0,rpi5-0"], "'rpi4-0,rpi5-0': rpi5-0 not in the fleet"),
        (["--rank-devices", "rpi4-0,rpi4-0"], "a device named twice"),
    ],
)
def test_what_ranks_do_not_take_is_refused(capsys, flags: list[str], message: str) -> None:
    """Refused before anything starts (in this process; the test above runs a child)."""
    embedded = [] if "--server" in flags else ["--embedded"]
    code, _, stderr = morphling_here(capsys, "run", "--ranks", "2", *embedded, *flags, "--",
                                     "python", SCRIPTS / "ranks_ddp.py")  # fmt: skip
    assert code == 2 and message in stderr, stderr


def test_products_computed_by_a_rank_need_ranks(capsys) -> None:
    """One script's products are spread over the fleet, which computes them."""
    code, _, stderr = morphling_here(capsys, "run", "--embedded", "--products", "rank", "--",
                                     "python", SCRIPTS / "ranks_ddp.py")  # fmt: skip
    assert code == 2 and "--products rank needs ranks (--ranks, or --rank)" in stderr, stderr


def test_a_rank_that_fails_stops_the_others_and_is_named(tmp_path: Path) -> None:
    """Rank 1 raises at step 2; the ranks run on the devices --rank-devices gives."""
    proc, report, _ = ranks_run(tmp_path, "ranks_ddp.py", "4", "2",
                                flags=["--rank-devices", "rpi4-1,rpi4-0"])  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "rank 1 (device rpi4-0) exited with code 1; its last words: " in proc.stderr
    assert "[rank1]: RuntimeError: rank 1 fails on purpose" in proc.stderr
    run = json.loads(report.read_text())
    assert run["ranks"][1]["exit_code"] == 1 and run["ranks"][0]["device"] == "rpi4-1"
    assert "RuntimeError: rank 1 fails on purpose" in run["ranks"][1]["last_words"]


def test_a_script_without_a_process_group_runs_as_independent_copies(tmp_path: Path) -> None:
    """Each copy also logs to a file it never closes, which a function keeps alive: a
    rank's process ends without finalizing, and still flushes it."""
    script = tmp_path / "alone.py"
    script.write_text(
        "import os, torch\nfrom torch import nn\nmodel = nn.Linear(64, 64)\n"
        "log = open(f\"log-{os.environ['RANK']}.txt\", 'w')\n"
        "def step():\n    model(torch.randn(8, 64)).sum().backward()\n    opt.step()\n"
        "    print('stepped', file=log)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor _ in range(2):\n    step()\n"
    )
    proc = morphling_run("--ranks", "2", "--embedded", "--devices", "rpi4:2", "--min-flops",
                         "0", "--no-report", "--", "python", script, cwd=tmp_path)  # fmt: skip
    succeeded(proc)
    assert "no rank made a collective: 2 independent copies" in proc.stderr
    for rank in (0, 1):
        assert (tmp_path / f"log-{rank}.txt").read_text() == "stepped\n" * 2


def test_a_signal_stops_every_rank_and_the_run_says_so(tmp_path: Path) -> None:
    """SIGINT to ``morphling run`` alone: each rank is stopped as on Ctrl-C and reports its
    steps if it can, the run directory is marked incomplete, the exit code is 130."""
    script = tmp_path / "forever.py"
    script.write_text(
        "import torch, torch.distributed as dist\nfrom torch import nn\n"
        "dist.init_process_group('gloo')\nddp = nn.parallel.DistributedDataParallel("
        "nn.Linear(64, 64))\nopt = torch.optim.SGD(ddp.parameters(), lr=0.01)\nstep = 0\n"
        "while True:\n    ddp(torch.randn(8, 64)).sum().backward()\n    opt.step()\n"
        "    step += 1\n    print('step', step, flush=True)\n"
    )
    run_dir, report, out = tmp_path / "run", tmp_path / "ranks.json", tmp_path / "out.txt"
    with out.open("w") as stdout:
        proc = subprocess.Popen(
            [*MORPHLING_RUN, "--ranks", "2", "--embedded", "--devices", "rpi4:2", "--min-flops",
             "0", "--run-dir", str(run_dir), "--json", str(report), "--", "python", str(script)],
            stdout=stdout, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=tmp_path,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while out.read_text().count("step 3") < 2:  # both ranks are training
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, out.read_text()[-3000:]
    text = out.read_text()
    assert "morphling run: interrupted by SIGINT; stopping the ranks" in text
    run = json.loads(report.read_text())
    assert all(r["stopped"] for r in run["ranks"]), run["ranks"]
    # a rank blocked inside gloo when stopped cannot report, and is killed after 10 s
    assert any(len(r["steps"]) >= 3 for r in run["ranks"]), run["ranks"]
    assert load_run(run_dir).incomplete == "interrupted by SIGINT"


def test_ranks_on_two_hosts_join_one_emulator(tmp_path: Path, procs, namespace) -> None:
    """Rank 0 on this host, rank 1 in a network namespace (another host, as far as the
    network goes), each a ``morphling run --server`` with torchrun's environment and no
    --rank or --device: each runs on device RANK of a standalone emulator's fleet, gloo
    crosses the hosts, and the losses are torchrun's."""
    run_dir = tmp_path / "run"
    # (reached from the namespace without a token: the ranks are the subject here)
    emulator, port = procs.emulator("--listen-ip", "0.0.0.0", "--insecure", "--no-probe",
                                    "--run-dir", str(run_dir))  # fmt: skip
    procs.fleet(port, "rpi4:2")
    procs.wait_for(emulator, "joined as device", 2)
    master = free_port()
    ranks = []
    for rank, (wrap, interface) in enumerate(
        [((), namespace.host_interface), (("ip", "netns", "exec", namespace.name),
                                           namespace.interface)]
    ):  # fmt: skip
        env = {**child_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "MASTER_ADDR": namespace.host_ip, "MASTER_PORT": str(master),
               "GLOO_SOCKET_IFNAME": interface, "OMP_NUM_THREADS": "1"}  # fmt: skip
        command = [*wrap, *MORPHLING_RUN, "--server", f"{namespace.host_ip}:{port}",
                   "--coordinator", "rpi4", "--min-flops", "0", "--json",
                   str(tmp_path / f"rank-{rank}.json"), "--", "python",
                   str(SCRIPTS / "ranks_ddp.py")]  # fmt: skip
        ranks.append(subprocess.Popen(command, env=env, cwd=tmp_path, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    outputs = [rank.communicate(timeout=180) for rank in ranks]
    for rank, (_, stderr) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, stderr[-3000:]
    got = {r: v for stdout, _ in outputs for r, v in losses(stdout).items()}
    expected = torchrun_losses("ranks_ddp.py")
    for rank, values in expected.items():
        assert got[rank] == pytest.approx(values, rel=1e-5, abs=1e-6), rank
    emulator.signal(signal.SIGTERM)
    assert emulator.wait(timeout=10) == 0
    p = BUILTIN["rpi4"]
    reduces = [c for c in collectives(run_dir) if c["op"] == "allreduce"]
    assert len(reduces) == 2 * 4  # each rank's bucket, each step, priced on rpi4's links
    for c in reduces:
        closed = c["nbytes"] / min(p.ul_bw, p.dl_bw) + 2 * (p.ul_lat_s + p.dl_lat_s)
        assert c["end"] - c["start"] == pytest.approx(closed, rel=1e-9)
    jobs = json.loads((run_dir / "run.json").read_text())["jobs"]
    assert sorted(j["name"] for j in jobs) == [f"{SCRIPTS / 'ranks_ddp.py'} rank {r}"
                                               for r in (0, 1)]  # fmt: skip
