"""Tiles verified over the real path: a device that corrupts one element of every tile,
once past its FLOPS challenge, is caught each time, quarantined and refused; the job's
results are the honest ones."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from morphling.kernels import CpuBackend, WorkerPool, blas_info
from morphling.kernels._native import ffi
from morphling.proxy.emulator import verify
from morphling.proxy.emulator.settings import EmulatorConfig, parse_mode
from morphling.proxy.emulator.verify import MAX_DOUBLINGS, Verifier
from morphling.proxy.report.analysis import summarize
from morphling.proxy.report.load import load_run
from morphling.proxy.report.text import format_summary
from processes import load_script
from serving import (
    TIMEOUT,
    assert_gemm_close,
    gemm_request,
    needs_torch,
    result_array,
    torch,
    wait_for_condition,
)
from threadpoolctl import threadpool_info

from morphling.config import ConfigError


class CorruptingBackend(CpuBackend):
    """A real CPU backend that, once ``armed`` is set (after the device passed its
    challenge), changes one element of every product by a tenth of its size, plus one:
    the marginal power supply or failing memory chip of a Pi."""

    def __init__(self, armed: threading.Event) -> None:
        super().__init__(1)
        self.armed = armed
        self.corrupted = 0

    def run(self, plan: Any) -> None:
        super().run(plan)
        if self.armed.is_set() and plan.m and plan.n:
            c = ffi.cast("float *" if plan.dtype == 0 else "double *", plan.c)
            at = (plan.m // 2) * plan.ldc + plan.n // 2
            c[at] += 0.1 * abs(c[at]) + 1.0
            self.corrupted += 1

    def call(self, fn: Any) -> Any:
        result = super().call(fn)  # a convolution tile's product, sent back as bytes
        if self.armed.is_set() and result.size:
            flat = result.reshape(-1)
            flat[flat.size // 2] += 0.1 * abs(flat[flat.size // 2]) + 1.0
            self.corrupted += 1
        return result


async def honest_gemm(
    client: Any, rng: np.random.Generator, shape: tuple[int, int, int], what: str = ""
) -> None:
    """A GEMM of random operands [m, k] · [k, n] through the fleet equals numpy's."""
    m, k, n = shape
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    request = gemm_request(a, b)
    result = await client.submit(request, timeout=TIMEOUT)
    assert_gemm_close(result_array(result, request, batched=False), a, b, what)


@pytest.mark.parametrize("text,fraction", [("all", 1.0), ("off", 0.0), ("sample:0.25", 0.25)])
def test_verify_modes(text, fraction):
    assert parse_mode(text) == fraction


@pytest.mark.parametrize("text", ["sample:0", "sample:1.5", "sample:x", "some", "sample"])
def test_a_bad_verify_mode_is_refused_naming_the_forms(text):
    with pytest.raises(ConfigError, match=r"--verify .*expected all, sample:P"):
        EmulatorConfig(verify=text)


def numpy_blas_threads() -> int:
    return next(lib["num_threads"] for lib in threadpool_info()
                if lib["filepath"] == numpy_blas["filepath"])  # fmt: skip


def is_kernels_blas(path: str) -> bool:
    return Path(path).resolve().name == Path(blas_info().path).resolve().name


numpy_blas = next(lib for lib in threadpool_info() if lib["user_api"] == "blas")


@pytest.mark.skipif(is_kernels_blas(numpy_blas["filepath"]), reason="numpy computes with the "
                    "kernels' own BLAS here: the device workers set its threads")  # fmt: skip
def test_a_verifier_holds_numpy_blas_to_one_thread_and_not_the_kernels_blas():
    kernels = [lib for lib in threadpool_info() if is_kernels_blas(lib["filepath"])]
    assert kernels, "the kernels' BLAS is loaded (blas_info) and seen"
    before = numpy_blas_threads()
    verifier = Verifier("all", 0.0)
    try:
        assert numpy_blas_threads() == 1
        assert [lib for lib in threadpool_info() if is_kernels_blas(lib["filepath"])] == kernels
    finally:
        verifier.close()
    assert numpy_blas_threads() == before
    Verifier("off", 0.0).close()  # (nothing to screen: nothing held)
    assert numpy_blas_threads() == before


@pytest.fixture(params=["loop", "worker"])
def reference_on(request, monkeypatch):
    """Where screens' references are made: on the event loop, or (every request as large
    as ``THREAD_BYTES``) in the verifier's worker thread."""
    if request.param == "worker":
        monkeypatch.setattr(verify, "THREAD_BYTES", 0)
    return request.param


async def test_a_corrupting_device_is_caught_every_time_and_quarantined(
    fleet, tmp_path, reference_on
):
    f = await fleet(block_size=16, window=2, policy="round-robin", quarantine_s=0.0,
                    run_dir=str(tmp_path))  # fmt: skip
    armed = threading.Event()
    backend = CorruptingBackend(armed)
    bad_workers = WorkerPool([backend])
    try:
        await f.add_device(name="honest")
        liar = await f.add_device(name="liar", workers=bad_workers)
        armed.set()  # past its challenge
        client = await f.client()
        rng = np.random.default_rng(5)
        for round_ in range(3):  # it comes back (quarantine_s 0) and lies again each time
            await honest_gemm(client, rng, (64, 96, 64), f"round {round_}")
            if round_ < 2:
                f.agents.remove(liar)
                liar = await f.add_device(name="liar", workers=bad_workers)
    finally:
        bad_workers.close()
    verifier = f.emu.verifier
    wrong = verifier.counts["wrong"]
    assert backend.corrupted >= 3
    assert wrong >= len(verifier.quarantines) >= 3  # each lie caught, its device dropped once
    assert {q.name for q in verifier.quarantines} == {"liar@127.0.0.1"}  # its name, its host
    assert bool(verifier._worker._threads) == (reference_on == "worker")  # (where it ran)
    assert all("elements wrong" in q.evidence for q in verifier.quarantines)
    await f.emu.stop()  # its run directory complete: run.json and the event log
    summary = json.loads((tmp_path / "run.json").read_text())["verification"]
    assert summary["mode"] == "all" and summary["wrong"] == wrong
    assert summary["quarantines"][0]["name"] == "liar@127.0.0.1"
    report = format_summary(summarize(load_run(tmp_path))).splitlines()  # the report says so
    said = [line for line in report if line.startswith("  quarantined: device")]
    assert len(said) == len(verifier.quarantines), report
    assert all("(liar@127.0.0.1)" in line and "elements wrong" in line for line in said)


@pytest.mark.parametrize("kind", ["forward", "grad_input", "grad_weight"])
async def test_a_device_corrupting_convolution_tiles_is_caught(fleet, kind, reference_on):
    f = await fleet(block_size=8, window=2, policy="round-robin", quarantine_s=0.0)
    armed = threading.Event()
    backend = CorruptingBackend(armed)
    bad_workers = WorkerPool([backend])
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 8, 10, 9), dtype=np.float32)
    w = rng.standard_normal((6, 8, 3, 3), dtype=np.float32)
    dy = rng.standard_normal((2, 6, 10, 9), dtype=np.float32)
    a, b = {"forward": (x, w), "grad_input": (dy, w), "grad_weight": (x, dy)}[kind]
    shapes = dict(input_shape=x.shape, weight_shape=w.shape, stride=(1, 1),
                  padding=(1, 1, 1, 1), dilation=(1, 1), groups=1)  # fmt: skip
    try:
        await f.add_device(name="honest")
        await f.add_device(name="liar", workers=bad_workers)
        client = await f.client()
        honest = await client.conv(kind, a, b, timeout=TIMEOUT, **shapes)
        armed.set()
        got = await client.conv(kind, a, b, timeout=TIMEOUT, **shapes)
    finally:
        bad_workers.close()
    np.testing.assert_array_equal(got, honest)  # no corrupted tile reached the job
    verifier = f.emu.verifier
    assert backend.corrupted >= 1 and verifier.counts["wrong"] >= 1
    assert verifier.quarantines[0].name == "liar@127.0.0.1"


async def test_a_quarantined_device_is_refused_when_it_comes_back(fleet):
    f = await fleet(block_size=16, quarantine_s=60.0)
    armed = threading.Event()
    bad_workers = WorkerPool([CorruptingBackend(armed)])
    try:
        await f.add_device(name="honest")
        await f.add_device(name="liar", workers=bad_workers)
        armed.set()
        client = await f.client()
        await honest_gemm(client, np.random.default_rng(6), (64, 64, 64))
        await wait_for_condition(lambda: f.emu.verifier.quarantines, 5, "a quarantine")
        again = f.agent(name="liar", workers=bad_workers)
        code = await asyncio.wait_for(f.run(again), 10)
    finally:
        bad_workers.close()
    assert code != 0
    assert again.last_error is not None and again.last_error[0] == "quarantined"
    assert "quarantined for" in again.last_error[1]
    assert [d.name for d in f.emu.registry.devices.values()] == ["honest"]


def test_a_device_caught_again_is_refused_twice_as_long_up_to_the_cap():
    """Each time a name is caught its refusal doubles, to at most 2**MAX_DOUBLINGS times
    ``quarantine_s``; other names are not refused."""
    verifier = Verifier("all", 10.0)
    try:
        for tile in range(MAX_DOUBLINGS + 3):
            verifier.quarantine(3, "liar@10.0.0.7", 1, tile, "1 of 16 elements wrong")
        refused = [q.refused_s for q in verifier.quarantines]
        assert refused[:4] == [10.0, 20.0, 40.0, 80.0]
        assert refused[-3:] == [10.0 * 2**MAX_DOUBLINGS] * 3
        why = verifier.refused("liar@10.0.0.7")
        assert f"found wrong {MAX_DOUBLINGS + 3} times" in why, why
        assert verifier.refused("liar@10.0.0.8") == ""
        [now] = verifier.refusing()
        assert now["device"] == "liar@10.0.0.7" and now["caught"] == MAX_DOUBLINGS + 3
    finally:
        verifier.close()


async def test_a_sample_is_judged_when_its_request_is_in(fleet):
    """Under ``sample:P`` no screen is made ahead: the tiles sampled are judged together
    once all are in, and the liar among them is caught."""
    f = await fleet(block_size=16, window=2, policy="round-robin", verify="sample:0.999",
                    quarantine_s=60.0)  # fmt: skip
    armed = threading.Event()
    backend = CorruptingBackend(armed)
    bad_workers = WorkerPool([backend])
    try:
        await f.add_device(name="honest")
        await f.add_device(name="liar", workers=bad_workers)
        armed.set()
        client = await f.client()
        a = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32)
        await client.submit(gemm_request(a, a), timeout=TIMEOUT)
        await wait_for_condition(lambda: f.emu.verifier.quarantines, 5, "a quarantine")
    finally:
        bad_workers.close()
    verifier = f.emu.verifier
    assert backend.corrupted >= 1 and verifier.counts["wrong"] >= 1
    assert verifier.quarantines[0].name == "liar@127.0.0.1"
    assert not verifier._worker._threads  # (nothing made ahead)


async def test_verify_off_lets_a_wrong_tile_through_as_it_says(fleet):
    """Off is off: the same liar, unchecked, corrupts the product (so the checks above are
    what catches it)."""
    f = await fleet(block_size=64, verify="off")
    armed = threading.Event()
    bad_workers = WorkerPool([CorruptingBackend(armed)])
    try:
        await f.add_device(name="liar", workers=bad_workers)
        armed.set()
        client = await f.client()
        a = np.ones((64, 64), np.float32)
        request = gemm_request(a, a)
        result = await client.submit(request, timeout=TIMEOUT)
    finally:
        bad_workers.close()
    c = result_array(result, request, batched=False)
    assert c[32, 32] == pytest.approx(64 * 1.1 + 1)
    assert f.emu.verifier.counts["checked"] == 0


@needs_torch
async def test_training_beside_a_corrupting_device_has_the_native_losses(fleet, monkeypatch):
    """Issue 25's fault case: a device that corrupts one element of every tile (GEMM and
    convolution) after it joined, and comes back each time it is dropped. Every tile it
    returns is caught; the model trains exactly as natively."""
    from morphling.proxy.job.session import emulate  # torch: the interceptor

    # 32 steps (``_training``): time for the liar to come back (its backoff, its probes)
    monkeypatch.setattr(sys, "argv", ["train_conv1d.py", "", "32"])
    script, training = load_script("train_conv1d.py"), load_script("_training.py")
    native_model, native_loss = script.build()
    native = training.fit(native_model, native_loss)

    f = await fleet(block_size=8, window=2, policy="round-robin", quarantine_s=0.0)
    armed = threading.Event()
    backend = CorruptingBackend(armed)
    bad_workers = WorkerPool([backend])
    try:
        await f.add_device(name="honest")
        liar = f.agent(name="liar", workers=bad_workers)
        f.run(liar, reconnect=True)  # dropped for each wrong tile, it comes straight back
        await f.wait_ready(liar)
        armed.set()

        def train() -> list[float]:
            model, step_loss = script.build()
            with emulate(server=f"{f.host}:{f.port}", min_flops=0):
                losses = training.fit(model, step_loss)
            trained.append(model)
            return losses

        trained: list[torch.nn.Module] = []
        losses = await asyncio.to_thread(train)
        liar.stop()
    finally:
        bad_workers.close()
    verifier = f.emu.verifier
    assert verifier.counts["wrong"] >= len(verifier.quarantines) >= 2  # it came back, lied again
    assert backend.corrupted >= verifier.counts["wrong"]  # (some it computed never returned)
    got, want = (torch.tensor(x, dtype=torch.float64) for x in (losses, native))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
    for name, tensor in native_model.state_dict().items():
        torch.testing.assert_close(trained[0].state_dict()[name], tensor, rtol=1e-4, atol=1e-4)


async def test_a_device_of_the_liars_name_that_joined_meanwhile_is_dropped_too(fleet):
    """A GEMM is judged once all its tiles are in, so the liar may have reconnected (or
    joined twice) by then: every device of its name on its host goes when it is caught."""
    f = await fleet(block_size=16, window=2, policy="round-robin", quarantine_s=60.0)
    armed = threading.Event()
    bad_workers = WorkerPool([CorruptingBackend(armed)])
    try:
        await f.add_device(name="honest")
        await f.add_device(name="liar", workers=bad_workers)
        twin = await f.add_device(name="liar")  # honest kernels, the same name and host
        armed.set()
        await honest_gemm(await f.client(), np.random.default_rng(9), (64, 64, 64))
        await wait_for_condition(lambda: len(f.emu.registry.devices) == 1, 5, "both dropped")
    finally:
        bad_workers.close()
    assert len(f.emu.verifier.quarantines) == 1  # one incident, one quarantine
    assert twin.last_error is not None and twin.last_error[0] == "quarantined"
    assert [d.name for d in f.emu.registry.devices.values()] == ["honest"]
