"""Device profiles: validation, the analytic model, wire and TOML forms, fleet specs."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import msgpack
import psutil
import pytest
from morphling.devices.models.capacity import DEVICE_BYTES, check_fleet_size
from morphling.devices.models.conv import FORM, ConvModel, traffic_bytes
from morphling.devices.models.conv_shape import ConvShape
from morphling.devices.models.profiles import (
    BUILTIN,
    DEFAULT_PROFILE,
    GIB,
    DeviceProfile,
    expand_fleet,
    load_profile,
    parse_fleet_spec,
)
from morphling.devices.profiler.host_cache import HOST_THREADS_ENV, cached_host_profile
from morphling.devices.profiler.toml_writer import dump_toml
from test_profiler import SMALL

VALID = {
    "name": "test-board",
    "flops": 1e9,
    "memory_bytes": GIB,
    "dl_bw": 100e6,
    "ul_bw": 10e6,
    "dl_lat_s": 0.001,
    "ul_lat_s": 0.002,
    "kind": "cpu",
    "blas": "OpenBLAS",
    "source": "measured",
}

PROFILE_TOML = """\
[profile]
name = "lab-pi"
flops = 20000000000
memory_bytes = 2147483648
dl_bw = 12500000
ul_bw = 1250000
dl_lat_s = 0.005
ul_lat_s = 0.005
kind = "cpu"
blas = "OpenBLAS"
"""


CONV = ConvShape("forward", n=2, c=16, h=10, w=12, oc=32, kernel=(3, 3), padding=(1, 1, 1, 1))
BAD_RECORD = {**CONV.to_dict(), "seconds": 1e-3, "n": 0}  # a record of a call with no images


def make(**changes: object) -> DeviceProfile:
    return DeviceProfile(**{**VALID, **changes})


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "lab-pi.toml"
    path.write_text(PROFILE_TOML)
    return path


# --- construction and validation ---------------------------------------------------------


def test_valid_profile_keeps_its_fields():
    p = make()
    assert p.to_wire() == {**VALID, "cooling": "none", "compute": {}, "thermal": {}, "conv": {},
                           "ops": {}}  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.flops = 2.0  # type: ignore[misc]


def test_whole_numbers_become_floats():
    p = make(flops=3, dl_bw=5, ul_lat_s=0)
    assert (p.flops, p.dl_bw, p.ul_lat_s) == (3.0, 5.0, 0.0)
    assert all(type(getattr(p, key)) is float for key in ("flops", "dl_bw", "ul_lat_s"))


def test_zero_latency_is_an_ideal_link():
    p = make(dl_lat_s=0.0, ul_lat_s=0.0)
    assert p.download_s(0) == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("name", ""),
        ("name", 3),
        ("flops", 0.0),
        ("flops", -1e9),
        ("flops", math.inf),
        ("flops", math.nan),
        ("flops", "1e9"),
        ("flops", True),
        ("flops", 10**400),
        ("memory_bytes", 0),
        ("memory_bytes", -1),
        ("memory_bytes", 1.5e9),
        ("memory_bytes", True),
        ("dl_bw", 0),
        ("ul_bw", -5.0),
        ("dl_lat_s", -0.001),
        ("ul_lat_s", math.inf),
        ("ul_lat_s", None),
        ("kind", "tpu"),
        ("kind", ""),
        ("blas", ""),
        ("source", None),
    ],
)
def test_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=repr(field)):
        make(**{field: value})


def test_error_quotes_at_most_a_short_value():
    with pytest.raises(ValueError) as info:
        make(kind="x" * 10_000)
    assert len(str(info.value)) < 200


# --- analytic model ----------------------------------------------------------------------


def test_compute_s_counts_two_flops_per_multiply_add():
    p = make(flops=1e9)
    assert p.compute_s(1000, 1000, 1000) == pytest.approx(2.0)
    assert p.compute_s(10, 20, 30, batch=4) == pytest.approx(2 * 10 * 20 * 30 * 4 / 1e9)
    assert p.compute_s(0, 5, 5) == 0.0


def test_transfers_add_bandwidth_time_and_latency_per_direction():
    p = make()
    assert p.download_s(100_000_000) == pytest.approx(1.0 + 0.001)
    assert p.upload_s(10_000_000) == pytest.approx(1.0 + 0.002)
    assert p.download_s(0) == pytest.approx(0.001)
    assert p.upload_s(0) == pytest.approx(0.002)


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.compute_s(-1, 2, 2),
        lambda p: p.compute_s(2, 2, 2, batch=-1),
        lambda p: p.download_s(-1),
        lambda p: p.upload_s(-1),
    ],
)
def test_negative_sizes_are_rejected(call):
    with pytest.raises(ValueError, match=">= 0"):
        call(make())


# --- wire form ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_wire_round_trip_through_msgpack(name):
    p = BUILTIN[name]
    wire = msgpack.unpackb(msgpack.packb(p.to_wire()))
    assert DeviceProfile.from_wire(wire) == p


def test_from_wire_accepts_integer_numbers():
    wire = {**VALID, "flops": 10**9, "dl_bw": 100_000_000}
    assert DeviceProfile.from_wire(wire) == make()


def test_from_wire_rejects_a_non_map():
    with pytest.raises(ValueError, match="must be a map, got list"):
        DeviceProfile.from_wire([1, 2])


def test_from_wire_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown key.*'gpu_clock'"):
        DeviceProfile.from_wire({**VALID, "gpu_clock": 1})
    with pytest.raises(ValueError, match=r"unknown key.*7"):
        DeviceProfile.from_wire({**VALID, 7: "x"})


def test_from_wire_rejects_missing_keys():
    wire = dict(VALID)
    del wire["ul_bw"]
    with pytest.raises(ValueError, match=r"missing key.*'ul_bw'"):
        DeviceProfile.from_wire(wire)


@pytest.mark.parametrize(
    ("key", "value"),
    [("flops", "fast"), ("memory_bytes", 1.0), ("kind", 1), ("dl_lat_s", [0.1]), ("name", b"x")],
)
def test_from_wire_rejects_wrong_types(key, value):
    with pytest.raises(ValueError, match=repr(key)):
        DeviceProfile.from_wire({**VALID, key: value})


# --- built-ins ---------------------------------------------------------------------------


def test_builtins_include_the_documented_boards():
    assert {"rpi4", "rpi5", "jetson-nano", "orin-nano", "agx-orin"} <= set(BUILTIN)
    assert DEFAULT_PROFILE == "rpi4"


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_is_labelled_and_sane(name):
    p = BUILTIN[name]
    assert p.name == name
    assert p.source.startswith("derived from published figures: ")
    assert p.blas == ("cuBLAS" if p.kind == "gpu" else "OpenBLAS")
    # Between 1 GFLOP/s and 10 TFLOP/s: a 1024³ GEMM takes 0.2 ms to 2 s.
    assert 2e-4 < p.compute_s(1024, 1024, 1024) < 2.0
    assert 1 * GIB <= p.memory_bytes <= 64 * GIB
    # Gigabit LAN: a 4 MiB tile moves in ~36 ms each way, 0.15 ms of it latency.
    assert 0.03 < p.download_s(4 << 20) < 0.04
    assert p.upload_s(4 << 20) == pytest.approx(p.download_s(4 << 20))
    assert p.dl_lat_s == pytest.approx(0.15e-3)


def test_builtins_rank_as_the_hardware_does():
    t = {name: p.compute_s(1024, 1024, 1024) for name, p in BUILTIN.items()}
    assert t["agx-orin"] < t["orin-nano-super"] < t["orin-nano"] < t["jetson-nano"]
    assert t["jetson-nano"] < t["rpi5"] < t["rpi4"]
    assert t["orin-nano"] < t["rpi4"] / 10


def test_builtin_figures_follow_their_derivation():
    assert BUILTIN["rpi4"].flops == pytest.approx(2 * 11.9e9)
    assert BUILTIN["rpi5"].flops == pytest.approx(2 * 30.2e9)
    assert BUILTIN["jetson-nano"].flops == pytest.approx(0.75 * 236e9)
    assert BUILTIN["orin-nano"].flops == pytest.approx(0.75 * 1.28e12, rel=1e-3)
    assert BUILTIN["agx-orin"].flops == pytest.approx(0.75 * 5.3e12)


# --- load_profile ------------------------------------------------------------------------


def test_load_builtin_by_name():
    assert load_profile("orin-nano") is BUILTIN["orin-nano"]


def test_unknown_name_lists_the_builtins():
    with pytest.raises(ValueError, match="unknown profile 'rpi9'") as info:
        load_profile("rpi9")
    for name in [*BUILTIN, "host"]:
        assert name in str(info.value)


def test_host_is_this_host_read_from_the_user_cache(tmp_path, monkeypatch, caplog):
    """``host`` (so ``--devices host:N``) is this host's profile from the cache that
    ``XDG_CACHE_HOME`` names, for ``MORPHLING_HOST_THREADS``; measuring it on first use and
    again when stale is ``test_profiler``'s."""
    cached = cached_host_profile(threads=1, directory=tmp_path / "morphling", plan=SMALL)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(HOST_THREADS_ENV, "1")
    caplog.set_level(logging.WARNING)
    caplog.clear()  # the measuring above
    [(profile, count)] = parse_fleet_spec("host:2")
    assert count == 2 and profile == load_profile(str(cached))
    assert not any("measuring this host" in r.getMessage() for r in caplog.records)
    assert profile.name == "host" and profile.compute["kind"] == "fitted"
    assert profile.conv["kind"] == "fitted"
    assert profile.dl_bw == profile.ul_bw == math.inf and profile.dl_lat_s == profile.ul_lat_s == 0
    assert profile.source.startswith("measured on ")


def test_load_toml_file(profile_file):
    p = load_profile(str(profile_file))
    assert p.name == "lab-pi"
    assert p.flops == 20e9 and type(p.flops) is float
    assert p.memory_bytes == 2 * GIB
    assert p.ul_bw == 1.25e6
    assert p.source == str(profile_file)


def test_toml_source_may_be_given(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(PROFILE_TOML + 'source = "measured"\n')
    assert load_profile(str(path)).source == "measured"


def test_toml_people_tables_are_left_alone(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(PROFILE_TOML + "\n[provenance]\nhost = 'bench-3'\n")
    assert load_profile(str(path)).name == "lab-pi"


def test_toml_thermal_table_is_the_thermal_model_and_is_validated(tmp_path):
    from morphling.devices.models.thermal import BUILTIN_THERMAL

    path = tmp_path / "p.toml"
    params = BUILTIN_THERMAL["rpi4"]
    lines = [
        f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}"
        for k, v in params.to_dict().items()
    ]
    path.write_text(PROFILE_TOML + "\n[thermal]\n" + "\n".join(lines) + "\n")
    assert load_profile(str(path)).thermal == params.to_dict()
    path.write_text(PROFILE_TOML + "\n[thermal]\nambient_c = 25.0\n")
    with pytest.raises(ValueError, match=r"'thermal'.*missing key.*'tau_s'"):
        load_profile(str(path))


def test_toml_conv_table_is_the_conv_model_and_is_validated(tmp_path):
    model = ConvModel.analytic(5e9, mem_bw=2e9)
    path = tmp_path / "p.toml"
    path.write_text(PROFILE_TOML + "\n" + dump_toml({"conv": model.to_dict()}))
    loaded = load_profile(str(path))
    assert loaded.conv == model.to_dict()
    assert loaded.conv_model().predict_s(CONV) == model.predict_s(CONV)
    path.write_text(PROFILE_TOML + "\n[conv]\nkind = 'analytic'\nflops = 5e9\n")
    with pytest.raises(ValueError, match=r"'conv'.*missing key.*'fp64_ratio'") as info:
        load_profile(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("conv", "message"),
    [
        ([], r"'conv' must be a table"),
        ({"kind": "fitted", "form": FORM}, r"'conv'.*missing key.*'vector_bytes'"),
        ({"kind": "fitted"}, r"'conv'.*'form' is 1 \(absent: 1\).*morphling profile"),
        ({**ConvModel.analytic(1e9).to_dict(), "mem_bw": -1.0}, r"'conv'.*'mem_bw'"),
        (
            {**ConvModel.analytic(1e9).to_dict(), "exact": [BAD_RECORD]},
            r"'conv'.*'n'",
        ),
    ],
)
def test_malformed_conv_table_is_refused_naming_the_field(conv, message):
    with pytest.raises(ValueError, match=message):
        make(conv=conv)
    with pytest.raises(ValueError, match=message):
        DeviceProfile.from_wire({**make().to_wire(), "conv": conv})


def test_a_profile_without_a_conv_model_prices_convolutions_by_its_flops():
    profile = make()
    assert profile.conv == {}
    model = profile.conv_model()
    assert model.predict_s(CONV) == pytest.approx(CONV.flops / profile.flops)
    f64 = ConvShape.from_dict({**CONV.to_dict(), "dtype": "float64"})
    assert model.predict_s(f64) == pytest.approx(2 * f64.flops / profile.flops)


def test_builtin_conv_models_are_analytic_with_their_memory_traffic():
    """Built-ins price a convolution by its FLOPs at their (calibrated or assumed) rate and
    its memory traffic at their elementwise bandwidth; depthwise ones at their own rate."""
    depthwise = ConvShape("forward", 2, 8, 16, 16, 8, (3, 3), groups=8)
    for profile in BUILTIN.values():
        conv, ops = profile.conv, profile.ops
        assert conv["kind"] == "analytic" and conv["mem_bw"] == ops["bandwidth"]["elementwise"]
        model = profile.conv_model()
        for shape, rate in ((CONV, conv["flops"]), (depthwise, conv["depthwise_flops"])):
            expected = shape.flops / rate + traffic_bytes(shape) / conv["mem_bw"]
            assert model.predict_s(shape) == pytest.approx(expected)


def test_path_without_toml_suffix_is_loaded_when_it_has_a_slash(tmp_path):
    path = tmp_path / "profile.conf"
    path.write_text(PROFILE_TOML)
    assert load_profile(str(path)).name == "lab-pi"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (PROFILE_TOML + "turbo = true\n", "unknown key.*'turbo'"),
        (PROFILE_TOML.replace('kind = "cpu"\n', ""), "missing key.*'kind'"),
        (PROFILE_TOML.replace("flops = 20000000000", 'flops = "20G"'), "'flops'"),
        (PROFILE_TOML.replace("memory_bytes = 2147483648", "memory_bytes = 2e9"), "memory_bytes"),
        ("[other]\nname = 'x'\n", r"no \[profile\] table"),
        ("profile = 3\n", r"no \[profile\] table"),
        ("[profile\n", "not valid TOML"),
    ],
)
def test_bad_toml_file_is_named(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_profile(str(path))
    assert str(path) in str(info.value)


def test_missing_toml_file(tmp_path):
    path = tmp_path / "absent.toml"
    with pytest.raises(ValueError, match="cannot read profile file"):
        load_profile(str(path))


# --- fleet specs -------------------------------------------------------------------------


def test_fleet_spec_with_counts():
    assert parse_fleet_spec("rpi4:12,orin-nano:4") == [
        (BUILTIN["rpi4"], 12),
        (BUILTIN["orin-nano"], 4),
    ]


def test_bare_count_is_that_many_default_devices():
    assert parse_fleet_spec("16") == [(BUILTIN[DEFAULT_PROFILE], 16)]
    assert parse_fleet_spec(" 3 ") == [(BUILTIN["rpi4"], 3)]


def test_name_without_count_is_one_device():
    assert parse_fleet_spec("rpi4") == [(BUILTIN["rpi4"], 1)]
    assert parse_fleet_spec("rpi5,agx-orin:2") == [(BUILTIN["rpi5"], 1), (BUILTIN["agx-orin"], 2)]


def test_whitespace_is_tolerated():
    assert parse_fleet_spec("  rpi4 : 2 ,  jetson-nano  ") == [
        (BUILTIN["rpi4"], 2),
        (BUILTIN["jetson-nano"], 1),
    ]


def test_fleet_entries_may_be_toml_paths(profile_file):
    fleet = parse_fleet_spec(f"{profile_file}:3,rpi4:1")
    assert [(p.name, n) for p, n in fleet] == [("lab-pi", 3), ("rpi4", 1)]
    assert parse_fleet_spec(str(profile_file))[0][1] == 1


@pytest.mark.parametrize(
    ("spec", "quoted"),
    [
        ("", "empty fleet spec"),
        ("   ", "empty fleet spec"),
        ("0", "'0'"),
        ("-4", "'-4'"),
        ("rpi4:0", "'rpi4:0'"),
        ("rpi4:-2", "'rpi4:-2'"),
        ("rpi4:x", "'rpi4:x'"),
        ("rpi4:", "'rpi4:'"),
        ("rpi4:1.5", "'rpi4:1.5'"),
        (":3", "':3'"),
        ("rpi9:2", "'rpi9:2'"),
        ("rpi4:2,,rpi5", "empty entry"),
        ("rpi4,", "empty entry"),
        ("rpi4:2,nope", "'nope'"),
        ("missing/dir/p.toml:2", "'missing/dir/p.toml:2'"),
    ],
)
def test_bad_fleet_spec_quotes_the_entry(spec, quoted):
    with pytest.raises(ValueError, match=quoted):
        parse_fleet_spec(spec)


def test_unknown_fleet_name_lists_the_builtins():
    with pytest.raises(ValueError, match=r"built-ins are .*orin-nano"):
        parse_fleet_spec("rpi4:2,pi-zero:3")


def test_expand_fleet_keeps_spec_order():
    fleet = expand_fleet("orin-nano:2,rpi4:3,agx-orin")
    assert [p.name for p in fleet] == ["orin-nano"] * 2 + ["rpi4"] * 3 + ["agx-orin"]
    assert len(expand_fleet("16")) == 16
    assert all(p is BUILTIN["rpi4"] for p in expand_fleet("16"))


def test_max_devices_replaces_the_memory_bound_both_ways():
    """``--max-devices`` allows a fleet past the available memory and refuses one past it."""
    too_many = 2 * psutil.virtual_memory().available // DEVICE_BYTES
    with pytest.raises(ValueError, match=f"a fleet of {too_many} devices needs about"):
        check_fleet_size(too_many)
    check_fleet_size(too_many, max_devices=too_many)  # allowed: the user said so
    with pytest.raises(ValueError, match="a fleet of 3 devices is more than --max-devices 2"):
        expand_fleet("rpi4:2,orin-nano", max_devices=2)
    assert len(expand_fleet("rpi4:2,orin-nano", max_devices=3)) == 3
