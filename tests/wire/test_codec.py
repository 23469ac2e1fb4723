"""The wire codec: round trips of every message, limits, bad headers, fuzzing, ``idle``."""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from morphling.proxy.wire.codec import (
    MAGIC,
    PREFIX,
    VERSION,
    Decoder,
    encode,
    encode_bytes,
    segment_array,
)
from morphling.proxy.wire.errors import ProtocolError
from morphling.proxy.wire.messages import (
    MESSAGES,
    Bye,
    Gemm,
    Heartbeat,
    Message,
    MsgType,
    ProbeEcho,
    ProbeVerdict,
    Tile,
    Welcome,
    wire_type,
)

CLASSES = sorted(MESSAGES.values(), key=lambda cls: cls.TYPE)
SCRATCH = 256 * 1024  # the decoder's scratch buffer, what a read into it can take at most

FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- strategies -------------------------------------------------------------------------

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack carries
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    st.floats(allow_nan=False),
    _text,
    st.binary(max_size=12),
)
# Only lists and str-keyed maps: what msgpack gives back unchanged.
_plain = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
FIELD_VALUES = {
    "int": _ints,
    "float": st.floats(allow_nan=False),
    "str": _text,
    "bytes": st.binary(max_size=48),
    "bool": st.booleans(),
    "dict": st.dictionaries(_text, _plain, max_size=4),
    "list": st.lists(_plain, max_size=4),
}

SPLITS = st.dictionaries(st.text(min_size=1, max_size=12), st.integers(0, 2**40), max_size=4)

_arrays = hnp.arrays(
    dtype=st.sampled_from([np.float32, np.float64, np.uint8]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
)
_segments = st.one_of(
    _arrays, _arrays, st.binary(max_size=40), st.binary(max_size=40).map(bytearray)
)


def header_fields(cls: type[Message]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name != "segments"]


def has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


@st.composite
def messages(draw, cls: type[Message] | None = None) -> Message:
    """A random valid message of ``cls`` (or of any class), segments included."""
    if cls is None:
        cls = draw(st.sampled_from(CLASSES))
    values = {}
    for f in header_fields(cls):
        if has_default(f) and draw(st.booleans()):
            continue  # keep the default
        values[f.name] = draw(FIELD_VALUES[wire_type(f)])
    if values.get("host_split"):  # op class → ns, summing to host_ns (``check_host_split``)
        values["host_split"] = split = draw(SPLITS)
        values["host_ns"] = sum(split.values())
    if values.get("host_alt"):  # profile → a host_split (``check_host_alt``)
        values["host_alt"] = draw(st.dictionaries(st.text(min_size=1, max_size=12), SPLITS,
                                                  max_size=3))  # fmt: skip
    segments = tuple(draw(_segments) for _ in range(cls.SEGMENTS))
    return cls(**values, segments=segments)


def test_the_strategy_knows_every_field_type():
    for cls in CLASSES:
        for f in header_fields(cls):
            assert wire_type(f) in FIELD_VALUES, f"{cls.__name__}.{f.name}: {f.type}"


# -- helpers ------------------------------------------------------------------------------


def frame(msg_type: int, header, payload: bytes = b"", payload_len: int | None = None) -> bytes:
    """A hand-made frame; ``header`` is packed unless it is already bytes."""
    packed = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    if payload_len is None:
        payload_len = len(payload)
    return PREFIX.pack(MAGIC, VERSION, msg_type, len(packed), payload_len) + packed + payload


def prefix(
    magic=MAGIC, version=VERSION, msg_type=int(MsgType.BYE), header_len=1, payload_len=0
) -> bytes:
    return PREFIX.pack(magic, version, msg_type, header_len, payload_len)


def seg_bytes(seg) -> bytes:
    return seg.tobytes() if isinstance(seg, np.ndarray) else bytes(seg)


def assert_same(got: Message | None, want: Message) -> None:
    assert got is not None
    assert type(got) is type(want)
    assert got.header() == want.header()
    assert got == want  # dataclass equality: the header fields (segments compare=False)
    assert len(got.segments) == len(want.segments) == want.SEGMENTS
    for i, (g, w) in enumerate(zip(got.segments, want.segments, strict=True)):
        assert isinstance(g, memoryview)
        assert bytes(g) == seg_bytes(w)
        if isinstance(w, np.ndarray):
            arr = segment_array(got, i, w.dtype.name)
            assert arr.dtype == w.dtype
            assert arr.size == w.size
            assert arr.tobytes() == w.tobytes()


def drain(dec: Decoder) -> list[Message]:
    out = []
    while (msg := dec.next_message()) is not None:
        out.append(msg)
    return out


def feed_chunks(dec: Decoder, stream: bytes, cuts: list[int], kind: str = "bytes") -> None:
    """``receive_data`` with the stream split at ``cuts``, as bytes, bytearray or memoryview."""
    points = [*sorted({c for c in cuts if 0 < c < len(stream)}), len(stream)]
    start = 0
    for end in points:
        chunk = stream[start:end]
        if kind == "bytearray":
            chunk = bytearray(chunk)
        elif kind == "memoryview":
            chunk = memoryview(bytearray(chunk))
        dec.receive_data(chunk)
        start = end


def feed_socket(dec: Decoder, stream: bytes, read_size) -> None:
    """A simulated socket: each read fills at most ``read_size()`` bytes of ``get_buffer()``."""
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer(-1)
        assert len(buf) > 0
        n = min(len(buf), read_size(), len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        pos += n
        dec.buffer_updated(n)


def read_sizes(data: st.DataObject):
    sizes = st.one_of(st.integers(1, 32), st.integers(1, 4096), st.just(SCRATCH))
    return lambda: data.draw(sizes)


# -- 1. round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
@FEW
@given(data=st.data())
def test_round_trip_in_random_chunks(cls, data):
    msg = data.draw(messages(cls))
    stream = encode_bytes(msg)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    kind = data.draw(st.sampled_from(["bytes", "bytearray", "memoryview"]))
    dec = Decoder()
    feed_chunks(dec, stream, cuts, kind)
    assert_same(dec.next_message(), msg)
    assert dec.next_message() is None
    assert dec.idle


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
@FEW
@given(data=st.data())
def test_round_trip_through_get_buffer(cls, data):
    msg = data.draw(messages(cls))
    dec = Decoder()
    feed_socket(dec, encode_bytes(msg), read_sizes(data))
    assert_same(dec.next_message(), msg)
    assert dec.next_message() is None
    assert dec.idle


@SOME
@given(data=st.data())
def test_frames_back_to_back(data):
    sent = data.draw(st.lists(messages(), min_size=1, max_size=6))
    stream = b"".join(encode_bytes(m) for m in sent)
    dec = Decoder()
    if data.draw(st.booleans()):
        cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
        feed_chunks(dec, stream, cuts)
    else:
        feed_socket(dec, stream, read_sizes(data))
    got = drain(dec)  # taken only at the end: kept segments must not alias the scratch buffer
    assert len(got) == len(sent)
    for g, w in zip(got, sent, strict=True):
        assert_same(g, w)
    assert dec.idle


def test_two_decoders_on_one_thread_share_scratch_safely():
    a = [ProbeEcho(probe=i, segments=(np.full(100, i, np.float32),)) for i in range(3)]
    b = [Bye(reason="x" * 50), Heartbeat()]
    sa, sb = b"".join(map(encode_bytes, a)), b"".join(map(encode_bytes, b))
    da, db = Decoder(), Decoder()
    pos = {da: 0, db: 0}
    while pos[da] < len(sa) or pos[db] < len(sb):  # interleaved reads through the shared scratch
        for dec, stream in ((da, sa), (db, sb)):
            if pos[dec] < len(stream):
                buf = dec.get_buffer()
                n = min(len(buf), 7, len(stream) - pos[dec])
                buf[:n] = stream[pos[dec] : pos[dec] + n]
                pos[dec] += n
                dec.buffer_updated(n)
    for got, want in ((drain(da), a), (drain(db), b)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)


def test_encode_references_tensor_memory():
    a = np.arange(1000, dtype=np.float64)
    b = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    msg = Tile(tile=1, dtype="float64", ta=False, tb=True, m=1, n=2, k=3, lda=3, ldb=3)
    msg = dataclasses.replace(msg, segments=(a, b))
    bufs = encode(msg)
    assert len(bufs) == 3
    assert np.shares_memory(np.frombuffer(bufs[1], np.uint8), a)
    assert np.shares_memory(np.frombuffer(bufs[2], np.uint8), b)
    assert b"".join(bufs) == encode_bytes(msg)
    magic, version, msg_type, header_len, payload_len = PREFIX.unpack(bufs[0][: PREFIX.size])
    assert (magic, version, msg_type) == (MAGIC, VERSION, MsgType.TILE)
    assert header_len == len(bufs[0]) - PREFIX.size
    assert payload_len == a.nbytes + b.nbytes
    header = msgpack.unpackb(bufs[0][PREFIX.size :])
    assert header["seg"] == [["float64", [1000], 8000], ["uint8", [2, 3, 4], 24]]


def test_missing_optional_fields_take_their_defaults():
    dec = Decoder()
    dec.receive_data(frame(MsgType.GEMM, {
        "gemm": 7, "dtype": "float32", "ta": False, "tb": False,
        "m": 1, "n": 1, "k": 1, "lda": 1, "ldb": 1,
        "seg": [["float32", [1], 4], ["float32", [1], 4]],
    }, b"\0" * 8))  # fmt: skip
    msg = dec.next_message()
    assert isinstance(msg, Gemm)
    assert (msg.batch, msg.stride_a, msg.stride_b) == (1, 0, 0)


def test_an_int_is_accepted_for_a_float_field_and_becomes_a_float():
    dec = Decoder()
    dec.receive_data(frame(MsgType.WELCOME, {"peer_id": 3, "heartbeat_s": 5}))
    msg = dec.next_message()
    assert msg == Welcome(peer_id=3, heartbeat_s=5.0)
    assert type(msg.heartbeat_s) is float


GEMM_HEADER = {"gemm": 7, "dtype": "float32", "ta": False, "tb": False, "m": 1, "n": 1,
               "k": 1, "lda": 1, "ldb": 1, "batch": 1, "stride_a": 0, "stride_b": 0,
               "ref_a": [], "ref_b": [], "after": 0, "host_ns": 0}  # fmt: skip


@pytest.mark.parametrize("change, problem", [
    ({}, None),
    ({"m": True}, ["GEMM.m", "expected int", "bool"]),
    ({"ta": 1}, ["GEMM.ta", "expected bool", "int"]),
    ({"lda": 1.0, "k": "1"}, ["GEMM.k", "expected int", "str"]),  # the first in field order
    ({"n": None}, ["GEMM.n", "expected int", "NoneType"]),
])  # fmt: skip
def test_a_header_in_any_field_order_decodes_the_same(change, problem):
    """A header as ``encode`` writes it (every field in order, each of its own type) takes
    a shortcut; the same fields in another order take the field-by-field check. Both give
    the same message, or name the same problem."""
    header = {**GEMM_HEADER, **change}
    seg = {"seg": [["float32", [1], 4], ["float32", [1], 4]]}
    outcomes = []
    for fields in (header, dict(reversed(header.items()))):
        dec = Decoder()
        try:
            dec.receive_data(frame(MsgType.GEMM, {**fields, **seg}, b"\0" * 8))
        except ProtocolError as exc:
            check_error(exc, "bad_header", problem)
            outcomes.append(exc.reason)
        else:
            assert problem is None
            outcomes.append(dec.next_message())
    assert outcomes[0] == outcomes[1]
    if problem is None:
        assert outcomes[0] == Gemm(**GEMM_HEADER)


def test_large_payload_lands_in_the_allocated_buffer():
    allocated: list[memoryview] = []

    def allocate(nbytes: int) -> memoryview:
        view = memoryview(bytearray(nbytes))
        allocated.append(view)
        return view

    a = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)  # 4 MiB
    b = np.arange(3000, dtype=np.float64)
    msg = Gemm(gemm=1, dtype="float32", ta=False, tb=False, m=1024, n=1, k=1024, lda=1024,
               ldb=1, segments=(a, b))  # fmt: skip
    bufs = encode(msg)
    stream = b"".join(bufs)
    head = len(bufs[0])
    payload_len = a.nbytes + b.nbytes
    dec = Decoder(allocate=allocate)

    pos, direct = 0, 0
    while pos < len(stream):
        buf = dec.get_buffer(-1)
        # The first read stops after the header, as a socket would with only that much
        # available; every later read must go straight into the payload's own memory.
        n = min(len(buf), head if pos == 0 else 1 << 20, len(stream) - pos)
        if pos >= head:
            assert allocated
            assert np.shares_memory(
                np.frombuffer(buf, np.uint8), np.frombuffer(allocated[0], np.uint8)
            )
            direct += n
        buf[:n] = stream[pos : pos + n]
        pos += n
        dec.buffer_updated(n)

    assert direct == payload_len
    assert len(allocated) == 1 and len(allocated[0]) == payload_len
    got = dec.next_message()
    assert_same(got, msg)
    pool = np.frombuffer(allocated[0], np.uint8)
    for seg in got.segments:
        assert np.shares_memory(np.frombuffer(seg, np.uint8), pool)
    assert np.array_equal(segment_array(got, 0, "float32").reshape(a.shape), a)


# -- 2. limits and the prefix ----------------------------------------------------------------


def no_allocate(nbytes: int) -> memoryview:
    pytest.fail(f"allocate({nbytes}) called for a frame that breaks the limits")


def prefix_error(data: bytes, **kw) -> ProtocolError:
    """Feed ``data`` byte by byte; it must fail exactly on its last (16th) byte."""
    assert len(data) == PREFIX.size
    dec = Decoder(allocate=no_allocate, **kw)
    for b in data[:-1]:
        dec.receive_data(bytes([b]))
    with pytest.raises(ProtocolError) as info:
        dec.receive_data(data[-1:])
    with pytest.raises(ProtocolError) as again:
        dec.receive_data(frame(MsgType.HEARTBEAT, {}))
    assert again.value is info.value
    return info.value


def test_header_len_zero_is_refused():
    err = prefix_error(prefix(header_len=0))
    assert err.code == "too_large"
    assert "header length 0" in err.reason


@given(excess=st.integers(1, 2**32 - 1 - 4096))
@SOME
def test_header_len_over_the_limit_is_refused_before_allocating(excess):
    err = prefix_error(prefix(header_len=4096 + excess), max_header=4096)
    assert err.code == "too_large"
    assert f"header length {4096 + excess}" in err.reason


@given(excess=st.integers(1, 2**64 - 1 - 1000))
@SOME
def test_payload_len_over_the_limit_is_refused_before_allocating(excess):
    err = prefix_error(prefix(payload_len=1000 + excess), max_payload=1000)
    assert err.code == "too_large"
    assert f"payload length {1000 + excess}" in err.reason
    assert "1000" in err.reason


def test_limits_are_inclusive():
    dec = Decoder(max_header=64, max_payload=1000, allocate=no_allocate)
    dec.receive_data(prefix(msg_type=MsgType.PROBE_ECHO, header_len=64, payload_len=1000))
    assert not dec.idle  # accepted; nothing allocated until the header is in


def test_default_payload_limit_is_enforced():
    err = prefix_error(prefix(payload_len=(1 << 30) + 1))
    assert err.code == "too_large"


@given(magic=st.integers(0, 0xFFFF).filter(lambda m: m != MAGIC))
@SOME
def test_bad_magic(magic):
    err = prefix_error(prefix(magic=magic))
    assert err.code == "bad_magic"
    assert f"0x{magic:04x}" in err.reason


@given(version=st.integers(0, 255).filter(lambda v: v != VERSION))
@SOME
def test_bad_version(version):
    err = prefix_error(prefix(version=version))
    assert err.code == "bad_version"
    assert f"version {version}" in err.reason


@given(msg_type=st.integers(0, 255).filter(lambda t: t not in MESSAGES))
@SOME
def test_unknown_type(msg_type):
    err = prefix_error(prefix(msg_type=msg_type))
    assert err.code == "unknown_type"
    assert f"type {msg_type}" in err.reason


def test_magic_is_checked_first():
    err = prefix_error(prefix(magic=0, version=99, msg_type=0, header_len=0, payload_len=2**64 - 1))
    assert err.code == "bad_magic"


# -- 3. bad headers ----------------------------------------------------------------------------

ECHO = int(MsgType.PROBE_ECHO)
SEG4 = [["uint8", [4], 4]]
BAD_HEADERS = {
    # name: (type, header or raw bytes, payload, payload_len or None, code, words in the reason)
    "not msgpack": (ECHO, b"\xc1", b"", None, "bad_frame", ["not valid msgpack"]),
    "truncated msgpack": (ECHO, b"\x82\xa5pro", b"", None, "bad_frame", ["not valid msgpack"]),
    "trailing bytes": (ECHO, msgpack.packb({"probe": 1}) + b"\x00", b"", None, "bad_frame",
                       ["not valid msgpack"]),
    "bad utf-8": (ECHO, b"\x81\xa2\xff\xfe\x01", b"", None, "bad_frame", ["not valid msgpack"]),
    "int map key": (ECHO, b"\x81\x01\x01", b"", None, "bad_frame", ["not valid msgpack"]),
    "a list": (ECHO, [1, 2], b"", None, "bad_frame", ["list", "not a map"]),
    "a str": (ECHO, "probe", b"", None, "bad_frame", ["str", "not a map"]),
    "seg not a list": (ECHO, {"probe": 1, "seg": "uint8"}, b"", None, "bad_frame", ["'seg'"]),
    "seg a map": (ECHO, {"probe": 1, "seg": {}}, b"", None, "bad_frame", ["'seg'"]),
    "seg item not a list": (ECHO, {"probe": 1, "seg": ["uint8"]}, b"", None, "bad_frame",
                            ["seg[0]"]),
    "seg arity 2": (ECHO, {"probe": 1, "seg": [["uint8", [4]]]}, b"abcd", None, "bad_frame",
                    ["seg[0]", "[dtype, shape, nbytes]"]),
    "seg arity 4": (ECHO, {"probe": 1, "seg": [["uint8", [4], 4, 0]]}, b"abcd", None,
                    "bad_frame", ["seg[0]"]),
    "unknown dtype": (ECHO, {"probe": 1, "seg": [["int32", [1], 4]]}, b"abcd", None,
                      "bad_frame", ["seg[0]", "'int32'"]),
    "int dtype": (ECHO, {"probe": 1, "seg": [[7, [4], 4]]}, b"abcd", None, "bad_frame",
                  ["seg[0]", "dtype 7"]),
    "negative shape": (ECHO, {"probe": 1, "seg": [["uint8", [-1], 0]]}, b"", None, "bad_frame",
                       ["seg[0]", "shape [-1]"]),
    "float shape": (ECHO, {"probe": 1, "seg": [["uint8", [4.0], 4]]}, b"abcd", None,
                    "bad_frame", ["seg[0]", "shape [4.0]"]),
    "bool shape": (ECHO, {"probe": 1, "seg": [["uint8", [True], 1]]}, b"a", None, "bad_frame",
                   ["seg[0]", "shape [True]"]),
    "shape not a list": (ECHO, {"probe": 1, "seg": [["uint8", 4, 4]]}, b"abcd", None,
                         "bad_frame", ["seg[0]", "shape 4"]),
    "nbytes mismatch": (ECHO, {"probe": 1, "seg": [["float32", [2], 4]]}, b"abcd", None,
                        "bad_frame", ["seg[0]", "nbytes 4", "float32"]),
    "negative nbytes": (ECHO, {"probe": 1, "seg": [["uint8", [0], -1]]}, b"", None, "bad_frame",
                        ["seg[0]", "nbytes -1"]),
    "float nbytes": (ECHO, {"probe": 1, "seg": [["uint8", [4], 4.0]]}, b"abcd", None,
                     "bad_frame", ["seg[0]", "nbytes 4.0"]),
    "second seg bad": (ECHO, {"probe": 1, "seg": [*SEG4, ["uint8", [1], 2]]}, b"abcdef", None,
                       "bad_frame", ["seg[1]"]),
    "total below payload_len": (ECHO, {"probe": 1, "seg": SEG4}, b"abcdefgh", None, "bad_frame",
                                ["4 bytes", "payload_len is 8"]),
    "total above payload_len": (ECHO, {"probe": 1, "seg": SEG4}, b"ab", None, "bad_frame",
                                ["4 bytes", "payload_len is 2"]),
    "payload without seg": (ECHO, {"probe": 1}, b"abcd", None, "bad_frame",
                            ["0 bytes", "payload_len is 4"]),
    "unknown field": (ECHO, {"probe": 1, "zzz": 1, "seg": SEG4}, b"abcd", None, "bad_header",
                      ["PROBE_ECHO", "unknown", "zzz"]),
    "bytes key": (ECHO, {"probe": 1, b"probe": 1, "seg": SEG4}, b"abcd", None, "bad_header",
                  ["unknown", "b'probe'"]),
    "segments as a field": (int(MsgType.BYE), {"segments": []}, b"", None, "bad_header",
                            ["unknown", "segments"]),
    "missing field": (ECHO, {"seg": SEG4}, b"abcd", None, "bad_header",
                      ["PROBE_ECHO", "missing", "'probe'"]),
    "missing field, no payload": (int(MsgType.WELCOME), {"peer_id": 1}, b"", None, "bad_header",
                                  ["WELCOME", "missing", "'heartbeat_s'"]),
    "str for int": (ECHO, {"probe": "1", "seg": SEG4}, b"abcd", None, "bad_header",
                    ["PROBE_ECHO.probe", "expected int", "str"]),
    "bool for int": (ECHO, {"probe": True, "seg": SEG4}, b"abcd", None, "bad_header",
                     ["PROBE_ECHO.probe", "expected int", "bool"]),
    "float for int": (ECHO, {"probe": 1.0, "seg": SEG4}, b"abcd", None, "bad_header",
                      ["PROBE_ECHO.probe", "expected int", "float"]),
    "bool for float": (int(MsgType.WELCOME), {"peer_id": 1, "heartbeat_s": False}, b"", None,
                       "bad_header", ["WELCOME.heartbeat_s", "expected float", "bool"]),
    "str for float": (int(MsgType.WELCOME), {"peer_id": 1, "heartbeat_s": "5"}, b"", None,
                      "bad_header", ["WELCOME.heartbeat_s", "expected float", "str"]),
    "int for bool": (int(MsgType.PROBE_VERDICT),
                     {"probe": 1, "ok": 1, "reason": "", "flops": 1.0}, b"", None,
                     "bad_header", ["PROBE_VERDICT.ok", "expected bool", "int"]),
    "str for bytes": (int(MsgType.GREETING), {"version": 1, "nonce": "ab", "auth": True}, b"",
                      None, "bad_header", ["GREETING.nonce", "expected bytes", "str"]),
    "bytes for str": (int(MsgType.BYE), {"reason": b"ab"}, b"", None, "bad_header",
                      ["BYE.reason", "expected str", "bytes"]),
    "list for dict": (int(MsgType.HELLO), {"role": "job", "profile": []}, b"", None,
                      "bad_header", ["HELLO.profile", "expected dict", "list"]),
    "dict for list": (int(MsgType.RESULT),
                      {"gemm": 1, "tiles": 1, "devices": {}, "seg": SEG4}, b"abcd", None,
                      "bad_header", ["RESULT.devices", "expected list", "dict"]),
    "nil for str": (int(MsgType.ERROR), {"code": None, "reason": ""}, b"", None, "bad_header",
                    ["ERROR.code", "expected str", "NoneType"]),
    "no segments for 1": (ECHO, {"probe": 1}, b"", None, "bad_header",
                          ["PROBE_ECHO", "0 payload segments", "expected 1"]),
    "empty seg for 1": (ECHO, {"probe": 1, "seg": []}, b"", None, "bad_header",
                        ["0 payload segments", "expected 1"]),
    "2 segments for 1": (ECHO, {"probe": 1, "seg": [SEG4[0], SEG4[0]]}, b"abcdefgh", None,
                         "bad_header", ["2 payload segments", "expected 1"]),
    "1 segment for 0": (int(MsgType.BYE), {"seg": [["uint8", [0], 0]]}, b"", None,
                        "bad_header", ["BYE", "1 payload segments", "expected 0"]),
    "1 segment for 2": (int(MsgType.TILE), {
        "tile": 1, "dtype": "uint8", "ta": False, "tb": False,
        "m": 1, "n": 1, "k": 1, "lda": 1, "ldb": 1, "seg": SEG4,
    }, b"abcd", None, "bad_header", ["TILE", "1 payload segments", "expected 2"]),
}  # fmt: skip


def bad_frame_bytes(case: str) -> tuple[bytes, str, list[str]]:
    msg_type, header, payload, payload_len, code, words = BAD_HEADERS[case]
    return frame(msg_type, header, payload, payload_len), code, words


def check_error(err: ProtocolError, code: str, words: list[str]) -> None:
    assert err.code == code, err.reason
    for word in words:
        assert word in err.reason


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_bad_header_via_receive_data(case):
    data, code, words = bad_frame_bytes(case)
    dec = Decoder()
    with pytest.raises(ProtocolError) as info:
        dec.receive_data(data + encode_bytes(Heartbeat()))
    check_error(info.value, code, words)
    assert dec.next_message() is None
    # The decoder stays failed: more bytes, even a good frame, raise the same error.
    for _ in range(2):
        with pytest.raises(ProtocolError) as again:
            dec.receive_data(encode_bytes(Heartbeat()))
        assert again.value is info.value
    with pytest.raises(ProtocolError):
        dec.get_buffer()
    assert dec.next_message() is None


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_bad_header_via_get_buffer(case):
    data, code, words = bad_frame_bytes(case)
    dec = Decoder()
    with pytest.raises(ProtocolError) as info:
        feed_socket(dec, data, lambda: 3)
    check_error(info.value, code, words)
    assert dec.next_message() is None


def test_errors_before_the_payload_allocate_nothing():
    data, _, _ = bad_frame_bytes("total below payload_len")
    with pytest.raises(ProtocolError):
        Decoder(allocate=no_allocate).receive_data(data)


def test_decoder_stays_failed_after_an_error_found_in_scratch():
    data, _, _ = bad_frame_bytes("unknown field")
    dec = Decoder()
    with pytest.raises(ProtocolError) as info:
        feed_socket(dec, data, lambda: SCRATCH)  # header and payload arrive in one read
    with pytest.raises(ProtocolError) as again:
        dec.get_buffer()
    assert again.value is info.value


def test_decoder_stays_failed_after_an_error_found_in_the_direct_payload_path():
    data, _, _ = bad_frame_bytes("unknown field")  # PROBE_ECHO with "zzz": 1 and 4 payload bytes
    dec = Decoder()
    dec.receive_data(data[:-4])  # prefix and header; the payload is allocated
    buf = dec.get_buffer()  # the payload's own memory
    buf[:4] = data[-4:]
    with pytest.raises(ProtocolError) as info:
        dec.buffer_updated(4)
    assert info.value.code == "bad_header"
    with pytest.raises(ProtocolError):
        dec.get_buffer()
    with pytest.raises(ProtocolError):
        dec.receive_data(encode_bytes(Heartbeat()))


def test_unknown_str_and_bytes_keys_together():
    dec = Decoder()
    with pytest.raises(ProtocolError) as info:
        dec.receive_data(frame(MsgType.BYE, {"zzz": 1, b"yyy": 2}))
    assert "unknown" in info.value.reason


@pytest.mark.parametrize("dtype", [["uint8"], {"a": 1}], ids=["list", "map"])
def test_unhashable_seg_dtype(dtype):
    dec = Decoder()
    with pytest.raises(ProtocolError) as info:
        dec.receive_data(frame(MsgType.PROBE_ECHO, {"probe": 1, "seg": [[dtype, [1], 1]]}, b"x"))
    assert "seg[0]" in info.value.reason


# -- 4. fuzz ----------------------------------------------------------------------------------

FUZZ_MAX_PAYLOAD = 256
FUZZ_MAX_HEADER = 128


def fuzz(data: st.DataObject, stream: bytes) -> Decoder:
    """Feed ``stream`` to a small-limits decoder; only ProtocolError may come out."""
    allocations: list[int] = []

    def allocate(nbytes: int) -> memoryview:
        assert 0 < nbytes <= FUZZ_MAX_PAYLOAD
        allocations.append(nbytes)
        return memoryview(bytearray(nbytes))

    dec = Decoder(max_payload=FUZZ_MAX_PAYLOAD, max_header=FUZZ_MAX_HEADER, allocate=allocate)
    socket = data.draw(st.booleans(), label="socket")
    try:
        if socket:
            feed_socket(dec, stream, read_sizes(data))
        else:
            feed_chunks(dec, stream, data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    except ProtocolError as exc:
        assert isinstance(exc.reason, str) and exc.reason
        assert isinstance(exc.code, str) and exc.code
        with pytest.raises(ProtocolError):  # the decoder stays failed
            dec.receive_data(b"\0")
    for msg in drain(dec):
        assert isinstance(msg, Message)
        assert len(msg.segments) == msg.SEGMENTS
    assert sum(allocations) <= FUZZ_MAX_PAYLOAD * (len(stream) // PREFIX.size + 1)
    return dec


def _within_fuzz_limits(msg: Message) -> bool:
    _, _, _, header_len, payload_len = PREFIX.unpack(encode(msg)[0][: PREFIX.size])
    return header_len <= FUZZ_MAX_HEADER and payload_len <= FUZZ_MAX_PAYLOAD


_small_messages = messages().filter(_within_fuzz_limits)


@MANY
@given(data=st.data())
def test_fuzz_random_bytes(data):
    start = data.draw(st.sampled_from([b"", struct.pack("<HB", MAGIC, VERSION)]), label="start")
    fuzz(data, start + data.draw(st.binary(max_size=200), label="bytes"))


@MANY
@given(data=st.data())
def test_fuzz_mutated_frames(data):
    sent = data.draw(st.lists(_small_messages, min_size=1, max_size=3), label="messages")
    stream = bytearray(b"".join(encode_bytes(m) for m in sent))
    for _ in range(data.draw(st.integers(0, 4), label="flips")):
        i = data.draw(st.integers(0, len(stream) - 1))
        if data.draw(st.booleans()):
            stream[i] ^= 1 << data.draw(st.integers(0, 7))
        else:
            stream[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(stream)), label="truncate at")
    fuzz(data, bytes(stream[:cut]))


@MANY
@given(data=st.data())
def test_truncated_frames_wait_for_more(data):
    msg = data.draw(_small_messages)
    stream = encode_bytes(msg)
    cut = data.draw(st.integers(1, len(stream) - 1))
    dec = fuzz(data, stream[:cut])
    assert dec.next_message() is None
    assert not dec.idle
    dec.receive_data(stream[cut:])
    assert_same(dec.next_message(), msg)
    assert dec.idle


def _header_keys(cls: type[Message]) -> st.SearchStrategy:
    names = [f.name for f in header_fields(cls)] + ["seg"]
    return st.one_of(st.sampled_from(names), _text, st.binary(max_size=4))


_seg_descriptors = st.lists(
    st.one_of(
        st.tuples(
            st.one_of(st.sampled_from(["float32", "float64", "uint8", "int32"]), _plain),
            st.lists(st.integers(-1, 5), max_size=3),
            st.integers(-1, 80),
        ).map(list),
        _plain,
    ),
    max_size=3,
)


@MANY
@given(data=st.data())
def test_fuzz_structured_headers(data):
    """Well-formed msgpack maps with random keys, values and seg descriptors."""
    cls = data.draw(st.sampled_from(CLASSES))
    values = st.one_of(_plain, *FIELD_VALUES.values())
    header = data.draw(st.dictionaries(_header_keys(cls), values, max_size=6))
    if data.draw(st.booleans()):
        header["seg"] = data.draw(_seg_descriptors)
    packed = msgpack.packb(header, use_bin_type=True)
    descs = header.get("seg", [])
    nbytes = (
        [d[2] for d in descs if isinstance(d, list) and len(d) == 3]
        if isinstance(descs, list)
        else []
    )
    total = sum(n for n in nbytes if type(n) is int and n > 0)
    payload_len = data.draw(st.one_of(st.just(min(total, 300)), st.integers(0, 300)))
    payload = data.draw(st.binary(min_size=payload_len, max_size=payload_len))
    stream = PREFIX.pack(MAGIC, VERSION, cls.TYPE, len(packed), payload_len) + packed + payload
    fuzz(data, stream)


# -- 5. encode refuses ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "segment",
    [
        np.arange(10, dtype=np.float32)[::2],
        np.arange(12, dtype=np.float64).reshape(3, 4).T,
        np.arange(24, dtype=np.uint8).reshape(2, 3, 4)[:, 1:, :],
        memoryview(b"abcdef")[::2],
    ],
    ids=["strided", "transposed", "sliced", "strided memoryview"],
)
def test_encode_refuses_non_contiguous(segment):
    with pytest.raises(ValueError, match="contiguous"):
        encode(ProbeEcho(probe=1, segments=(segment,)))


@pytest.mark.parametrize(
    "dtype", [np.int32, np.int64, np.float16, np.bool_, np.complex64, np.int8, np.uint16]
)
def test_encode_refuses_unsupported_dtypes(dtype):
    with pytest.raises(ValueError, match="dtype"):
        encode(ProbeEcho(probe=1, segments=(np.zeros(4, dtype=dtype),)))


def test_encode_refuses_non_native_byte_order():
    a = np.arange(3, dtype=">f4")
    try:
        stream = encode_bytes(ProbeEcho(probe=1, segments=(a,)))
    except ValueError:
        return
    dec = Decoder()
    dec.receive_data(stream)
    assert np.array_equal(segment_array(dec.next_message(), 0, "float32"), a)


@pytest.mark.parametrize(
    "msg",
    [
        ProbeEcho(probe=1),
        ProbeEcho(probe=1, segments=(b"a", b"b")),
        Bye(segments=(b"",)),
        Heartbeat(segments=(np.zeros(1, np.float32),)),
        Tile(tile=1, dtype="f", ta=False, tb=False, m=1, n=1, k=1, lda=1, ldb=1,
             segments=(np.zeros(1, np.float32),)),
    ],
    ids=["echo 0", "echo 2", "bye 1", "heartbeat 1", "tile 1"],
)  # fmt: skip
def test_encode_refuses_the_wrong_number_of_segments(msg):
    with pytest.raises(ValueError, match="segments"):
        encode(msg)


# -- 6. idle ----------------------------------------------------------------------------------


@SOME
@given(data=st.data())
def test_idle_only_between_frames(data):
    sent = data.draw(st.lists(_small_messages, min_size=1, max_size=4))
    frames = [encode_bytes(m) for m in sent]
    stream = b"".join(frames)
    boundaries = {0}
    for f in frames:
        boundaries.add(max(boundaries) + len(f))
    dec = Decoder()
    assert dec.idle
    for pos in range(len(stream)):
        dec.receive_data(stream[pos : pos + 1])
        assert dec.idle == (pos + 1 in boundaries), pos + 1
    assert len(drain(dec)) == len(sent)


def test_idle_through_the_direct_payload_path():
    a = np.arange(1000, dtype=np.float32)
    stream = encode_bytes(ProbeEcho(probe=1, segments=(a,)))
    dec = Decoder()
    assert dec.idle
    reads = [1, PREFIX.size - 1, 5, len(stream) - PREFIX.size - 5 - 100, 99, 1]
    pos = 0
    for n in reads:
        buf = dec.get_buffer()
        buf[:n] = stream[pos : pos + n]
        pos += n
        dec.buffer_updated(n)
        assert dec.idle == (pos == len(stream))
    assert pos == len(stream)
    assert dec.next_message().probe == 1
    assert dec.idle


def test_idle_with_a_message_waiting():
    dec = Decoder()
    dec.receive_data(encode_bytes(ProbeVerdict(probe=1, ok=True, reason="", flops=1.0)))
    assert dec.idle  # a complete frame is not a partial one, taken or not
    assert dec.next_message() is not None
    assert dec.idle
