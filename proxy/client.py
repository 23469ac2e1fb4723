"""The job API: submit ``C = op(A)·op(B)`` to an emulator and get C back.

``AsyncClient`` is the asyncio form; ``Client`` runs one on a background
event loop for ordinary blocking code (a training script). Operands are
numpy arrays or CPU torch tensors of any BLAS-readable layout — transposed,
padded, batched, a 2-D operand broadcast over a batch — and go on the wire as
the memory they span, with their layout, never made contiguous first.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from typing import Any

import numpy as np

from ..kernels import blas_operand
from .auth import hello
from .connection import FrameConnection
from .messages import Close, Gemm, Message, MsgType, Open, Result, Step
from .states import Conversation

DTYPES = ("float32", "float64")


class EmulatorError(RuntimeError):
    """The emulator refused a request or the connection; ``code`` says why."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class JobConnection(FrameConnection):
    """The job's side of its one connection."""

    def __init__(self, token: str, name: str, block: int) -> None:
        super().__init__(Conversation("peer", "job"))
        loop = asyncio.get_running_loop()
        self.token, self.name, self.block = token, name, block
        self.welcomed: asyncio.Future[int] = loop.create_future()
        self.results: dict[int, asyncio.Future[Result]] = {}
        self.replies: deque[asyncio.Future[Message]] = deque()  # STEP and CLOSE, in order
        self.error: EmulatorError | None = None

    def message_received(self, msg: Message) -> None:
        t = msg.TYPE
        if t == MsgType.RESULT:
            future = self.results.pop(msg.gemm, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif t in (MsgType.STEP, MsgType.CLOSE):
            if self.replies:
                self.replies.popleft().set_result(msg)
        elif t == MsgType.GREETING:
            self.send(hello(msg, self.token, "job", name=self.name))
        elif t == MsgType.WELCOME:
            self.send(Open(name=self.name, block=self.block))
            self.start_heartbeats(msg.heartbeat_s, 3 * msg.heartbeat_s)
            self.welcomed.set_result(msg.peer_id)
        elif t == MsgType.ERROR:
            self.error = EmulatorError(msg.code, msg.reason)
            self.close()
        elif t == MsgType.BYE:
            self.error = EmulatorError("bye", msg.reason)
            self.close()

    def disconnected(self, exc: Exception | None) -> None:
        error = self.error or EmulatorError("disconnected", f"connection lost ({exc})")
        for future in [self.welcomed, *self.results.values(), *self.replies]:
            if not future.done():
                future.set_exception(error)
        self.results.clear()
        self.replies.clear()


class AsyncClient:
    """A job connected to an emulator. Use ``await AsyncClient.connect(...)``."""

    def __init__(self, conn: JobConnection, job_id: int) -> None:
        self._conn = conn
        self.job_id = job_id
        self._ids = itertools.count(1)

    @classmethod
    async def connect(
        cls, host: str, port: int, *, token: str = "", name: str = "", block: int = 0,
        timeout: float = 30.0,
    ) -> AsyncClient:  # fmt: skip
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: JobConnection(token, name, block), host, port), timeout
        )
        job_id = await asyncio.wait_for(conn.welcomed, timeout)
        return cls(conn, job_id)

    async def matmul(
        self, a: Any, b: Any, out: Any = None, *, timeout: float | None = None
    ) -> np.ndarray:
        """``a @ b`` for 2-D or batched ([batch, m, k]) views, computed by the fleet.

        Returns ``out`` (filled) when given, else a new array of shape
        ``[m, n]`` or ``[batch, m, n]``.
        """
        request, shape = self._request(a, b)
        result = await self.submit(request, timeout=timeout)
        c = np.frombuffer(result.segments[0], dtype=request.dtype).reshape(shape)
        if out is None:
            return c
        np.copyto(out if isinstance(out, np.ndarray) else out.numpy(), c)
        return out

    async def submit(self, request: Gemm, *, timeout: float | None = None) -> Result:
        """Send an explicit GEMM request (the wire contract) and wait for its RESULT."""
        conn = self._conn
        if conn.error is not None:
            raise conn.error
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        conn.results[request.gemm] = future
        conn.send(request)
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            conn.results.pop(request.gemm, None)

    def _request(self, a: Any, b: Any) -> tuple[Gemm, tuple[int, ...]]:
        oa, ob = blas_operand(a, "a"), blas_operand(b, "b")
        dtype = oa.span.dtype.name
        if dtype not in DTYPES or ob.span.dtype.name != dtype:
            raise ValueError(f"dtypes {dtype} and {ob.span.dtype.name}: need one of {DTYPES}")
        if oa.cols != ob.rows:
            raise ValueError(f"inner dimensions differ: a is {oa.rows}×{oa.cols}, "
                             f"b is {ob.rows}×{ob.cols}")  # fmt: skip
        if oa.batch >= 0 and ob.batch >= 0 and oa.batch != ob.batch:
            raise ValueError(f"batch sizes differ: {oa.batch} and {ob.batch}")
        batch = max(oa.batch, ob.batch)
        request = Gemm(
            gemm=next(self._ids), dtype=dtype, ta=bool(oa.trans), tb=bool(ob.trans),
            m=oa.rows, n=ob.cols, k=oa.cols, lda=oa.ld, ldb=ob.ld, batch=max(batch, 1),
            stride_a=oa.stride if oa.batch >= 0 else 0,
            stride_b=ob.stride if ob.batch >= 0 else 0,
            segments=(oa.span, ob.span),
        )  # fmt: skip
        shape = (oa.rows, ob.cols) if batch < 0 else (batch, oa.rows, ob.cols)
        return request, shape

    async def _ask(self, msg: Message) -> Message:
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._conn.replies.append(future)
        self._conn.send(msg)
        return await future

    async def step(self, step: int) -> Step:
        """Mark the end of a training step; the emulator's totals so far."""
        return await self._ask(Step(step=step))

    async def close(self) -> Close | None:
        """End the job; its totals (None when the connection was already gone)."""
        if not self._conn.open:
            return None
        try:
            return await self._ask(Close())
        except EmulatorError:
            return None
        finally:
            self._conn.close()


class Client:
    """Blocking form of ``AsyncClient``, on its own event-loop thread."""

    def __init__(self, host: str, port: int, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="morphling-client")  # fmt: skip
        self._thread.start()
        try:
            self._client: AsyncClient = self._run(AsyncClient.connect(host, port, **kwargs))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def matmul(self, a: Any, b: Any, out: Any = None, *, timeout: float | None = None) -> Any:
        return self._run(self._client.matmul(a, b, out, timeout=timeout))

    def step(self, step: int) -> Step:
        return self._run(self._client.step(step))

    def close(self) -> Close | None:
        if not self._loop.is_running():
            return None
        try:
            return self._run(self._client.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
