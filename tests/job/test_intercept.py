"""GEMM interception in library form: ``morphling.emulate`` against a real emulator.

One ``EmbeddedFleet`` (the real emulator and four virtual devices on a background
thread, talking over loopback sockets) serves the whole module; each test opens its
own job with ``emulate(server=...)``. Every result is compared with the same op run
natively (outside the ``emulate`` block, so nothing of the reference is intercepted),
and ``session.counts`` says which GEMMs reached the fleet and which ran locally, why.
Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from morphling.devices.models.profiles import BUILTIN
from morphling.kernels import blas_operand
from morphling.proxy.emulator.server import Emulator
from morphling.proxy.emulator.settings import EmulatorConfig
from morphling.proxy.job.client import EmulatorError
from morphling.proxy.job.conv import ConvCall
from morphling.proxy.job.coordinator import HostWork
from morphling.proxy.job.embedded import EmbeddedFleet
from morphling.proxy.job.intercept import Interceptor
from morphling.proxy.job.session import Session, emulate
from torch import nn

import morphling

Address = str  # "HOST:PORT"


@pytest.fixture(scope="module")
def server() -> Iterator[Address]:
    """One fleet for the module: starting one per test would dominate the runtime."""
    fleet = EmbeddedFleet("rpi4:2,orin-nano:2")
    host, port = fleet.start()
    yield f"{host}:{port}"
    fleet.stop()


def on_fleet(server: Address, fn: Callable[[], Any], *, min_flops: int = 0) -> tuple[Any, Session]:
    """``fn()`` inside a fresh job on ``server``; its result and the closed session."""
    with emulate(server=server, min_flops=min_flops) as session:
        out = fn()
    return out, session


def randn(*shape: int, dtype: torch.dtype = torch.float32, requires_grad: bool = False
          ) -> torch.Tensor:  # fmt: skip
    return torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# -- remote GEMMs: every aten GEMM form, every operand layout ---------------------------


def case(
    name: str, op: Callable[..., torch.Tensor], *shapes: tuple[int, ...], copied: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Any:  # fmt: skip
    """One GEMM form: ``op`` over random operands of ``shapes``; one GEMM, ``copied`` copies."""
    return pytest.param(op, shapes, dtype, copied, id=name)


# Shapes above the 256 tile edge make the emulator split a GEMM over several devices.
CASES = [
    case("mm", torch.mm, (300, 40), (40, 270)),
    case("addmm_alpha_beta", partial(torch.addmm, beta=0.5, alpha=2), (30, 20), (30, 40), (40, 20)),
    case("addmm_bias_row", torch.addmm, (20,), (30, 40), (40, 20)),
    case("bmm", torch.bmm, (3, 20, 30), (3, 30, 25)),
    case(
        "baddbmm",
        partial(torch.baddbmm, beta=-1.5, alpha=0.5),
        (3, 20, 25),
        (3, 20, 30),
        (3, 30, 25),
    ),
    case("matmul_2d", torch.matmul, (17, 33), (33, 9)),
    case("matmul_3d_2d", torch.matmul, (4, 17, 33), (33, 9)),
    case("matmul_4d", torch.matmul, (2, 3, 7, 5), (2, 3, 5, 6)),
    case("matmul_broadcast", torch.matmul, (2, 1, 7, 5), (1, 3, 5, 6)),
    case("matmul_vec_mat", torch.matmul, (33,), (33, 9)),
    case("linear_bias", F.linear, (12, 24), (16, 24), (16,)),
    case("linear_no_bias", F.linear, (12, 24), (16, 24)),
    case("linear_3d", F.linear, (2, 12, 24), (16, 24), (16,)),
    # Transposed views go as they are: BLAS reads a column-major operand directly.
    case("transposed", lambda a, b: a.t() @ b.t(), (40, 30), (20, 40)),
    case("bmm_transposed", lambda a, b: a.transpose(1, 2) @ b, (3, 30, 20), (3, 30, 25)),
    # A column slice of a wider matrix is a padded row-major matrix (ld > cols): no copy.
    case("padded_slice", lambda x, y: x[:, 3:20] @ y[2:19], (30, 40), (25, 11)),
    # Every third column has no unit stride: BLAS cannot read it, so it is copied first.
    case("strided_slice", lambda x, y: x[::2, 1:9] @ y[1:9, ::3], (10, 20), (10, 20), copied=1),
    # A row broadcast (row stride 0) is not a BLAS matrix: copied.
    case("expanded_rows", lambda a, b: a.expand(16, 8) @ b, (1, 8), (8, 12), copied=1),
    # A matrix broadcast over the batch (batch stride 0) is: BLAS takes stride 0, no copy.
    case("expanded_batch", lambda a, b: torch.bmm(a, b.expand(3, 8, 12)), (3, 16, 8), (8, 12)),
    case("float64", torch.matmul, (20, 30), (30, 10), dtype=torch.float64),
]


@pytest.mark.parametrize(("op", "shapes", "dtype", "copied"), CASES)
def test_gemm_matches_native(
    server: Address, op: Callable[..., torch.Tensor], shapes: tuple[tuple[int, ...], ...],
    dtype: torch.dtype, copied: int,
) -> None:  # fmt: skip
    """One GEMM on the fleet, equal to the native op; only unreadable layouts are copied."""
    args = [randn(*shape, dtype=dtype) for shape in shapes]
    expected = op(*args)
    got, session = on_fleet(server, lambda: op(*args))
    torch.testing.assert_close(got, expected)  # default fp32 (fp64) tolerances, dtype checked
    assert session.counts.remote == 1
    assert session.counts.copied == copied
    assert not session.counts.local


def test_results_stay_valid_after_later_gemms(server: Address) -> None:
    """Each result owns its memory: later GEMMs in the same job do not overwrite it."""
    pairs = [(randn(40, 30), randn(30, 50)) for _ in range(5)]
    expected = [a @ b for a, b in pairs]
    got, session = on_fleet(server, lambda: [a @ b for a, b in pairs])
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert session.counts.remote == 5


def test_addmm_beta_zero_ignores_nan_in_c(server: Address) -> None:
    """BLAS semantics, as in PyTorch: with beta=0, C is not read, so its NaNs do not leak."""
    c = torch.full((30, 20), float("nan"))
    a, b = randn(30, 40), randn(40, 20)
    expected = torch.addmm(c, a, b, beta=0, alpha=3)
    got, session = on_fleet(server, lambda: torch.addmm(c, a, b, beta=0, alpha=3))
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got, 3 * (a @ b))
    assert session.counts.remote == 1


def test_baddbmm_beta_zero_ignores_nan_in_c(server: Address) -> None:
    c = torch.full((2, 6, 5), float("nan"))
    a, b = randn(2, 6, 7), randn(2, 7, 5)
    got, session = on_fleet(server, lambda: torch.baddbmm(c, a, b, beta=0))
    assert not got.isnan().any()
    torch.testing.assert_close(got, torch.bmm(a, b))
    assert session.counts.remote == 1


def _addmm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.addmm(out.new_ones(()), a, b, beta=2, out=out)


def _baddbmm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.baddbmm(out.new_ones(()), a, b, alpha=3, out=out)


OUT_CASES = [
    case("mm", lambda a, b, out: torch.mm(a, b, out=out), (24, 16), (16, 20)),
    case("bmm", lambda a, b, out: torch.bmm(a, b, out=out), (3, 8, 16), (3, 16, 12)),
    case("addmm", _addmm_into, (24, 16), (16, 20)),
    case("baddbmm", _baddbmm_into, (3, 8, 16), (3, 16, 12)),
]


@pytest.mark.parametrize(("op", "shapes", "dtype", "copied"), OUT_CASES)
@pytest.mark.parametrize("given", ["sized", "empty"])
def test_a_gemm_into_out_goes_to_the_fleet(
    server: Address, op: Callable[..., torch.Tensor], shapes: tuple[tuple[int, ...], ...],
    dtype: torch.dtype, copied: int, given: str,
) -> None:  # fmt: skip
    """``out=`` (what torch.compile's code calls too): the fleet's product, written into
    ``out`` (resized from empty, as torch does), which is what comes back."""
    a, b = (randn(*shape) for shape in shapes)
    size = (*shapes[0][:-1], shapes[1][-1])

    def into() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(size if given == "sized" else (0,))
        return op(a, b, out), out

    (expected, _), ((got, out), session) = into(), on_fleet(server, into)
    assert got is out and got.shape == size
    torch.testing.assert_close(got, expected)
    assert session.counts.remote == 1 and not session.counts.local


def test_an_out_torch_would_refuse_or_that_is_an_operand_stays_torchs(server: Address) -> None:
    """``out`` of another dtype: torch's own error; ``out`` that is an operand: torch's
    kernel, and its result."""
    a, b = randn(8, 8), randn(8, 8)
    with pytest.raises(RuntimeError) as native:
        torch.mm(a, b, out=torch.empty(8, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError) as intercepted:
        on_fleet(server, lambda: torch.mm(a, b, out=torch.empty(8, 8, dtype=torch.float64)))
    assert str(intercepted.value) == str(native.value)
    c = randn(8, 8)
    expected = torch.addmm(c.clone(), a, b, out=c.clone())
    mine = c.clone()
    got, session = on_fleet(server, lambda: torch.addmm(mine, a, b, out=mine))
    torch.testing.assert_close(got, expected)
    assert session.counts.remote == 0


def test_a_compiled_model_trains_on_the_fleet(server: Address) -> None:
    """torch.compile's code calls the GEMMs' ``out=`` forms: they reach the fleet, and the
    losses are the native ones."""

    def train() -> list[float]:
        torch.manual_seed(0)
        model = _mlp()
        step = torch.compile(lambda x: model(x).square().mean())
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(2):
            loss = step(torch.randn(8, 16))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    expected = train()
    got, session = on_fleet(server, train)
    assert got == pytest.approx(expected, rel=1e-5)
    assert session.counts.remote >= 2 * 3  # each step's forward and backward GEMMs


def test_addmm_alpha_zero_does_not_read_the_product(server: Address) -> None:
    """As in PyTorch: with alpha=0, a·b is not computed, so NaN in it does not leak."""
    c, a, b = randn(30, 20), torch.full((30, 40), float("nan")), randn(40, 20)
    got, session = on_fleet(server, lambda: torch.addmm(c, a, b, beta=2, alpha=0))
    torch.testing.assert_close(got, torch.addmm(c, a, b, beta=2, alpha=0))
    torch.testing.assert_close(got, 2 * c)
    assert session.counts.remote == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda: torch.mm(randn(4, 5), randn(3, 5, 6)),
        lambda: torch.mm(randn(3, 4, 5), randn(5, 6)),
        lambda: torch.bmm(randn(4, 5), randn(5, 6)),
        lambda: torch.bmm(randn(3, 4, 5), randn(5, 6)),
        lambda: torch.bmm(randn(3, 4, 5), randn(2, 5, 6)),
        lambda: torch.mm(randn(4, 5), randn(6, 7)),
    ],
    ids=["mm-2d-3d", "mm-3d-2d", "bmm-2d-2d", "bmm-3d-2d", "bmm-batches", "mm-inner"],
)
def test_operands_the_op_does_not_take_raise_torchs_own_error(server: Address, call) -> None:
    with pytest.raises(RuntimeError) as native:
        call()
    with pytest.raises(RuntimeError) as intercepted:
        on_fleet(server, call)
    assert str(intercepted.value) == str(native.value)


def test_coordinator_scale_zero_leaves_the_fleet_time_alone(server: Address) -> None:
    """Scale 0 asks what the step would take were the script's own work free."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with emulate(server=server, min_flops=0, scale=0.0) as session:
        for _ in range(2):
            model(randn(8, 16)).square().sum().backward()
            time.sleep(0.05)  # host work the step would otherwise count
            opt.step()
    assert [s.coord_s for s in session.steps] == [0.0, 0.0]
    assert all(s.emulated_s == s.fleet_s > 0 for s in session.steps)


def test_nn_linear_module(server: Address) -> None:
    layer = nn.Linear(24, 16)
    x = randn(5, 24)
    with torch.no_grad():
        expected = layer(x)
        got, session = on_fleet(server, lambda: layer(x))
    torch.testing.assert_close(got, expected)
    assert session.counts.remote == 1


# -- autograd: backward GEMMs reach the fleet too ---------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


@pytest.mark.parametrize("batch_shape", [(8,), (3, 5)], ids=["2d", "3d"])
def test_mlp_forward_backward(server: Address, batch_shape: tuple[int, ...]) -> None:
    """Three Linear layers: 3 GEMMs forward, and per layer grad-input + grad-weight backward."""

    def run(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        x = x.clone().requires_grad_()  # so the first layer's grad-input GEMM happens too
        out = model(x)
        out.square().sum().backward()
        return [out.detach(), x.grad, *(p.grad for p in model.parameters())]

    model, x = _mlp(), randn(*batch_shape, 16)
    twin = _mlp()
    twin.load_state_dict(model.state_dict())
    expected = run(model, x)
    got, session = on_fleet(server, lambda: run(twin, x))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert session.counts.remote == 3 * 3
    assert not session.counts.local


def test_opt_tiny_forward_backward(server: Address) -> None:
    """The bundled tiny OPT as is (ReLU, SDPA attention, tied LM head), one training-mode
    forward and backward: native loss and gradients, every GEMM on the fleet. Per layer
    6 Linear and one attention call, then the head: 3·13 + 6·2 = 51 GEMMs."""
    from morphling.proxy.checkpoint.hf_models import build_model, load_config

    config = load_config("opt-tiny")
    model = build_model(config, seed=0)
    ids = torch.randint(0, config["vocab_size"], (2, 16))

    def run() -> list[torch.Tensor]:
        torch.manual_seed(1)  # the same dropout masks in both runs
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach(), *(p.grad.clone() for p in model.parameters())]

    expected = run()  # natively: fused attention
    got, session = on_fleet(server, run)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    layers = config["num_hidden_layers"]
    assert session.counts.remote == 3 * (6 * layers + 1) + 6 * layers
    assert not session.counts.local


# -- fused attention: decomposed so that its GEMMs reach the fleet ----------------------


def _causal_mask() -> dict[str, Any]:
    return {"is_causal": True}


def _bool_mask() -> dict[str, Any]:
    mask = torch.rand(8, 8) > 0.3
    mask.fill_diagonal_(True)  # no fully masked row (that would be NaN on both sides)
    return {"attn_mask": mask}


def _float_mask() -> dict[str, Any]:
    return {"attn_mask": torch.randn(8, 8)}


@pytest.mark.parametrize("mask", [_causal_mask, _bool_mask, _float_mask],
                         ids=["is_causal", "bool_mask", "float_mask"])  # fmt: skip
def test_sdpa_forward_backward(server: Address, mask: Callable[[], dict[str, Any]]) -> None:
    """Math attention: Q·Kᵀ and P·V forward (2 bmm), two GEMMs for each in backward (4)."""
    kwargs = mask()
    q, k, v = randn(2, 3, 8, 4), randn(2, 3, 8, 4), randn(2, 3, 8, 4)
    forward_gemms: list[int] = []

    def run(session: Session | None = None) -> list[torch.Tensor]:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qq, kk, vv, **kwargs)
        if session is not None:
            forward_gemms.append(session.counts.remote)
        out.square().sum().backward()
        return [out.detach(), qq.grad, kk.grad, vv.grad]

    expected = run()  # natively: PyTorch's fused CPU kernel
    with emulate(server=server, min_flops=0) as session:
        got = run(session)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert forward_gemms == [2]
    assert session.counts.remote == 2 + 4
    assert not session.counts.local


# -- local GEMMs: counted with their reason, still correct ------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64],
                         ids=["float16", "bfloat16", "int64"])  # fmt: skip
def test_unsupported_dtype_runs_locally(server: Address, dtype: torch.dtype) -> None:
    a = torch.randint(-4, 5, (20, 30)).to(dtype)
    b = torch.randint(-4, 5, (30, 10)).to(dtype)
    c = torch.randint(-4, 5, (10,)).to(dtype)
    expected = (a @ b, torch.addmm(c, a, b))
    got, session = on_fleet(server, lambda: (a @ b, torch.addmm(c, a, b)))
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)  # the very same local kernel
    assert session.counts.remote == 0
    assert session.counts.local == {f"dtype {str(dtype).removeprefix('torch.')}": 2}


def test_below_min_flops_runs_locally(server: Address) -> None:
    a, b = randn(20, 30), randn(30, 10)  # 2·20·30·10 = 12000 FLOPs
    expected = a @ b
    got, session = on_fleet(server, lambda: a @ b, min_flops=12001)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert session.counts.remote == 0
    assert session.counts.local == {"small": 1}
    _, session = on_fleet(server, lambda: a @ b, min_flops=12000)  # the bound is inclusive
    assert session.counts.remote == 1


@pytest.mark.parametrize(("m", "k", "n"), [(0, 5, 6), (4, 0, 6), (4, 5, 0)])
def test_empty_gemm_runs_locally(server: Address, m: int, k: int, n: int) -> None:
    a, b = randn(m, k), randn(k, n)
    got, session = on_fleet(server, lambda: a @ b)
    torch.testing.assert_close(got, torch.zeros(m, n))
    assert session.counts.local == {"empty": 1}
    assert session.counts.remote == 0


class _Squares(torch.utils.data.Dataset):
    """Samples made with a GEMM (``x @ xᵀ``), as augmentations built on bmm are."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((64, 64), float(i + 1))
        return x @ x.T


def test_dataloader_workers_compute_their_gemms_themselves(server: Address) -> None:
    """A forked worker inherits the interceptor and the job's connection, which is the
    parent's: its GEMMs run locally (they failed the job: bad_gemm, or disconnected)."""
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=2, num_workers=1,
                                         multiprocessing_context="fork")  # fmt: skip
    batches, session = on_fleet(server, lambda: [b @ b for b in loader])
    for i, batch in enumerate(batches):
        squares = torch.stack([_Squares()[2 * i + j] for j in range(2)])
        torch.testing.assert_close(batch, squares @ squares)
    assert session.counts.remote == len(batches), "only the parent's GEMMs went out"


def test_parameter_operand_goes_remote(server: Address) -> None:
    weight, bias, x = nn.Parameter(randn(24, 16)), nn.Parameter(randn(16)), randn(8, 24)
    with torch.no_grad():
        expected = torch.addmm(bias, x, weight)
        got, session = on_fleet(server, lambda: (torch.addmm(bias, x, weight), x @ weight))
    torch.testing.assert_close(got[0], expected)
    assert session.counts.local == {}
    assert session.counts.remote == 2


# -- steps and reports ------------------------------------------------------------------


def test_optimizer_steps_mark_steps(server: Address) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with emulate(server=server, min_flops=0) as session:
        for _ in range(2):
            opt.zero_grad()
            model(randn(8, 16)).square().sum().backward()
            opt.step()
    assert [s.step for s in session.steps] == [1, 2]
    for step in session.steps:  # the input needs no gradient: no grad-input GEMM for layer 1
        assert step.gemms == 3 + 3 + 2
        assert step.local_gemms == 0
        assert step.tiles > 0 and step.bytes_up > 0
        # operands cross, or are held already (the same bytes sent by an earlier test)
        assert step.bytes_down + step.bytes_saved > 0
        assert step.emulated_s > 0 and step.fleet_s > 0 and step.host_s > 0
    assert session.totals["gemms"] == session.counts.remote == 16

    table = session.table()
    assert re.search(r"^\s+1\s", table, re.M) and re.search(r"^\s+2\s", table, re.M)
    assert "16 on the fleet" in table

    summary = json.loads(json.dumps(session.summary()))  # plain JSON, nothing custom
    assert [s["step"] for s in summary["steps"]] == [1, 2]
    assert summary["gemms_remote"] == 16 and summary["gemms_local"] == {}

    opt.step()  # the step hook and the interceptor are gone after the block
    _ = randn(40, 40) @ randn(40, 40)
    assert len(session.steps) == 2 and session.counts.remote == 16


def test_embedded_devices_form() -> None:
    """``morphling.emulate(devices=SPEC)`` starts (and stops) its own emulator and fleet."""
    assert morphling.emulate is emulate  # the lazy top-level name
    a, b = randn(64, 48), randn(48, 80)
    with morphling.emulate(devices="rpi5:2", min_flops=0) as session:
        got = a @ b
    torch.testing.assert_close(got, a @ b)
    assert session.counts.remote == 1


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"server": "127.0.0.1:1", "devices": "2"}],
                         ids=["neither", "both"])  # fmt: skip
def test_emulate_needs_exactly_one_target(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="exactly one"), emulate(**kwargs):
        pass


@contextlib.contextmanager
def bare_emulator(config: EmulatorConfig) -> Iterator[Address]:
    """An emulator without devices on its own loop thread: enough for a job's handshake."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        emulator = Emulator(config)
        state["address"] = await emulator.start()
        state["loop"], state["stop"] = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        await state["stop"].wait()
        await emulator.stop()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the emulator did not start"
    try:
        host, port = state["address"]
        yield f"{host}:{port}"
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(10)


def test_wrong_token_is_an_auth_error() -> None:
    config = EmulatorConfig(token="s3cret", listen_ip="127.0.0.1", listen_port=0)
    with bare_emulator(config) as address:
        with pytest.raises(EmulatorError) as info, emulate(server=address, token="wrong"):
            pass
        assert info.value.code == "auth"
        with pytest.raises(EmulatorError) as info, emulate(server=address):  # no token at all
            pass
        assert info.value.code == "auth"


def test_embedded_fleet_with_token() -> None:
    with EmbeddedFleet("2", EmulatorConfig(token="s3cret")) as (host, port):
        with pytest.raises(EmulatorError) as info, emulate(server=f"{host}:{port}", token="x"):
            pass
        assert info.value.code == "auth"
        a, b = randn(8, 8), randn(8, 8)
        with emulate(server=f"{host}:{port}", token="s3cret", min_flops=0) as session:
            got = a @ b
        torch.testing.assert_close(got, a @ b)
        assert session.counts.remote == 1


class _Heard:
    """A ``Timer`` that keeps what it is told: each product as it would have been sent
    (``LayoutError`` for an operand BLAS cannot read, as the session's does)."""

    def __init__(self) -> None:
        self.products: list[tuple[Any, ...]] = []

    def time_gemm(self, a: torch.Tensor, b: torch.Tensor) -> None:
        blas_operand(a, "a"), blas_operand(b, "b")
        self.products.append(("gemm", tuple(a.shape), tuple(b.shape), b.stride()))

    def time_conv(self, kind: str, call: ConvCall, dtype: torch.dtype) -> None:
        self.products.append((kind, call.input, call.weight, dtype))


def test_with_a_timer_products_are_computed_here_and_timed_as_they_would_be_sent() -> None:
    """A rank computing its own products (``Interceptor(timer=...)``): torch's own kernels
    compute them, to the bit as natively, nothing is sent, and the timer hears of each as
    it would have been sent: an operand BLAS cannot read as its copy (counted), a
    convolution's backward as its input-gradient and weight-gradient products."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x, w = randn(2, 3, 8, 8, requires_grad=True), randn(5, 1).expand(5, 6)

    def step() -> list[torch.Tensor]:
        loss = (model(x) @ w).sum()
        grads = torch.autograd.grad(loss, [x, *model.parameters()])
        return [loss, *grads]

    expected = step()

    def send(*_: object) -> None:
        raise AssertionError("a product computed here is sent nowhere")

    heard = _Heard()
    interceptor = Interceptor(send, send, host_work=HostWork(BUILTIN["rpi4"]), timer=heard)
    with interceptor:
        got = step()
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    image, kernel = (2, 3, 8, 8), (4, 3, 3, 3)
    assert heard.products == [
        ("forward", image, kernel, torch.float32),
        ("gemm", (2, 144), (144, 5), (1, 144)),  # the Linear: x·Wᵀ, Wᵀ as stored
        ("gemm", (2, 5), (5, 6), (6, 1)),  # w's broadcast columns, copied
        ("gemm", (2, 6), (6, 5), (5, 1)),  # the sum's gradient and wᵀ: broadcasts, copied
        ("gemm", (2, 5), (5, 144), (144, 1)),
        ("gemm", (5, 2), (2, 144), (144, 1)),
        ("grad_input", image, kernel, torch.float32),
        ("grad_weight", image, kernel, torch.float32),
    ]
    assert (interceptor.counts.remote, interceptor.counts.copied) == (5, 3)
    assert interceptor.conv_counts.remote == 3
    with pytest.raises(ValueError, match="a timer needs host_work"):
        Interceptor(send, send, timer=heard)  # a rank's host time is modelled


def test_auto_block_cuts_a_slow_links_fleets_gemms_finer_with_the_native_results() -> None:
    """``auto_block`` on eight Pi 4s over Wi-Fi: a 256 × 256 output in 64-wide tiles
    (sixteen, across eight links at once) rather than one 256² tile; results native (a
    short K: products of different BLAS libraries agree within the default tolerance)."""
    a, b = randn(256, 32), randn(32, 256)
    tiles = {}
    for auto in (False, True):
        fleet = EmbeddedFleet("rpi4:8", config=EmulatorConfig(auto_block=auto), link="wifi")
        host, port = fleet.start()
        try:
            got, session = on_fleet(f"{host}:{port}", lambda: a @ b)
        finally:
            fleet.stop()
        torch.testing.assert_close(got, a @ b)
        assert session.counts.remote == 1
        tiles[auto] = session.totals["tiles"]
    assert tiles == {False: 1, True: 16}


def test_an_lstm_trains_on_the_fleet_its_products_gemms() -> None:
    """PyTorch's oneDNN RNN (one opaque call per layer) is off for the recurrent layers
    while a job runs, as on the boards: each time step's gate products reach the fleet,
    the losses are the native ones, and torch's own entry points are back after."""
    fleet = EmbeddedFleet("rpi4:2")
    host, port = fleet.start()

    def train() -> list[float]:
        torch.manual_seed(0)
        rnn, head = nn.LSTM(16, 32, 2, batch_first=True), nn.Linear(32, 5)
        opt = torch.optim.SGD([*rnn.parameters(), *head.parameters()], lr=0.5)
        x, y = torch.randn(4, 6, 16), torch.randint(0, 5, (4 * 6,))
        losses = []
        for _ in range(2):
            loss = F.cross_entropy(head(rnn(x)[0]).reshape(-1, 5), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    try:
        expected = train()
        got, session = on_fleet(f"{host}:{port}", train)
    finally:
        fleet.stop()
    assert got == pytest.approx(expected, rel=1e-5)
    assert session.counts.remote >= 2 * 2 * 6  # each step: per layer, a product per time step
    assert torch.backends.mkldnn.enabled and "lstm" not in vars(torch._VF)
