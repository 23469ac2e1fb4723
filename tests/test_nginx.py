"""Physical devices behind a real nginx stream proxy: the generated configuration, run.

``make test`` (and so CI) installs Debian's nginx and libnginx-mod-stream
first; on a machine without them these tests skip and say what is missing.
Every case starts nginx in the foreground on loopback ports with a
configuration from ``morphling nginx-config``, a real ``morphling emulator``
and real ``morphling device`` processes; jobs talk to the emulator directly.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from morphling.nginx.conf import NginxConfig, render
from morphling.nginx.harness import Nginx, NginxUnavailable, find_nginx
from morphling.proxy.job.client import AsyncClient, gemm_request, result_array
from processes import MORPHLING, Procs, child_env, free_port, gemm_cases

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def install():
    try:
        return find_nginx()
    except NginxUnavailable as exc:
        pytest.skip(f"no usable nginx: {exc}")


def nginx_for(tmp: Path, emulator_port: int, **settings) -> tuple[Nginx, int]:
    """A started nginx on a free loopback port forwarding to ``emulator_port``."""
    port = free_port()
    cfg = NginxConfig(listen=f"127.0.0.1:{port}", emulators=f"127.0.0.1:{emulator_port}",
                      **settings)  # fmt: skip
    return Nginx(cfg, tmp / "nginx").start(), port


async def gemm_on(port: int, device_id: int, token: str = "") -> None:
    """A GEMM through the emulator at ``port``, right, and computed by ``device_id``."""
    client = await AsyncClient.connect("127.0.0.1", port, name="job", token=token)
    try:
        rng = np.random.default_rng(device_id)
        a = rng.standard_normal((96, 40)).astype(np.float32)
        b = rng.standard_normal((40, 72)).astype(np.float32)
        request, shape = gemm_request(1, a, b)
        result = await client.submit(request, timeout=30)
        c = result_array(request, result, shape, None)
        np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)
        assert set(result.devices) == {device_id}
    finally:
        await client.close()


def openssl_ca(tmp: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost signed by it."""
    files = {name: tmp / f"{name}.pem" for name in ("ca", "ca-key", "cert", "key")}

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(files["ca-key"]), "-out", str(files["ca"]), "-days", "1",
            "-subj", "/CN=morphling test CA")  # fmt: skip
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(files["key"]), "-out", str(tmp / "server.csr"),
            "-subj", "/CN=localhost")  # fmt: skip
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", str(tmp / "server.csr"), "-CA", str(files["ca"]),
            "-CAkey", str(files["ca-key"]), "-CAcreateserial", "-days", "1",
            "-extfile", str(tmp / "san.ext"), "-out", str(files["cert"]))  # fmt: skip
    return files


# -- the generator ------------------------------------------------------------------------


def test_defaults_follow_the_emulator_heartbeats_and_size_for_devices():
    text = render(NginxConfig())
    assert "proxy_timeout 20s;" in text  # heartbeat timeout 15 s + one 5 s heartbeat
    assert "listen 0.0.0.0:39000 so_keepalive=60s:10s:3;" in text
    assert "proxy_socket_keepalive on;" in text
    assert "worker_connections 8256;" in text  # 2 × 4096 devices + 64
    assert "hash $remote_addr" not in text  # one emulator: nothing to choose
    assert "ssl" not in text
    several = render(NginxConfig(emulators="10.0.0.2:39000, [fd00::3]:39000", heartbeat_s=0.3,
                                 heartbeat_timeout_s=1))  # fmt: skip
    assert "hash $remote_addr consistent;" in several
    assert "server 10.0.0.2:39000;" in several and "server [fd00::3]:39000;" in several
    assert "proxy_timeout 1300ms;" in several


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tls_cert": "/etc/c.pem"}, "--tls-cert and --tls-key go together"),
        ({"heartbeat_s": 5, "heartbeat_timeout_s": 5}, "--heartbeat-timeout-s (5) must exceed"),
        ({"emulators": " , "}, "--emulators: give at least one"),
        ({"emulators": "host:0"}, "--emulators 'host:0': port '0' is not 1..65535"),
        ({"listen": "[::1"}, "--listen '[::1': expected [ADDRESS]:PORT"),
        ({"access_log": "/tmp/a b.log"}, "--access-log '/tmp/a b.log': spaces"),
        ({"tls_cert": "/x;evil", "tls_key": "/k"}, "--tls-cert '/x;evil'"),
    ],
)
def test_bad_settings_name_the_option(settings, message):
    with pytest.raises(ValueError) as info:
        render(NginxConfig(**settings))
    assert message in str(info.value)


def nginx_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MORPHLING, "nginx-config", *args], capture_output=True,
                          text=True, timeout=60, env=child_env())  # fmt: skip


def test_cli_writes_refuses_to_overwrite_and_rejects_unknown_flags(tmp_path):
    out = tmp_path / "nginx.conf"
    cli = nginx_config
    assert cli("--output", str(out), "--devices", "10").returncode == 0
    assert "worker_connections 84;" in out.read_text()
    again = cli("--output", str(out))
    assert again.returncode == 2 and "exists (use --force" in again.stderr
    assert cli("--output", str(out), "--force", "--part", "stream").returncode == 0
    assert out.read_text().startswith("stream {")
    bad = cli("--devices", "0")
    assert bad.returncode == 2 and "--devices" in bad.stderr
    assert cli("--listne", "x").returncode == 2


@pytest.mark.parametrize(
    ("output", "problem"),
    [("nodir/x.conf", "No such file or directory"), (".", "Is a directory")],
)
def test_an_unwritable_output_is_one_line_and_exit_2(tmp_path, output, problem):
    path = tmp_path / output
    done = nginx_config("--output", str(path), "--force")
    assert (done.returncode, done.stderr) == (
        2, f"morphling nginx-config: cannot write {path}: {problem}\n",
    )  # fmt: skip


def test_the_emulator_and_nginx_config_refuse_the_same_contradicting_heartbeats(tmp_path):
    """A timeout below the heartbeat period dropped every device every second (the emulator
    took the pair nginx-config refused); both now refuse it with the one shared rule."""
    pair = ("--heartbeat-s", "3", "--heartbeat-timeout-s", "1")
    rule = (
        "--heartbeat-timeout-s (1.0) must exceed --heartbeat-s (3.0): peers heartbeat "
        "only after --heartbeat-s of quiet, so a shorter timeout drops live ones\n"
    )
    emulator = subprocess.run(
        [*MORPHLING, "emulator", "--listen-ip", "127.0.0.1", "--listen-port", "0", *pair],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )  # fmt: skip
    assert (emulator.returncode, emulator.stderr) == (2, f"morphling emulator: {rule}")
    settings = tmp_path / "emulator.toml"
    settings.write_text("[emulator]\nheartbeat_s = 3.0\nheartbeat_timeout_s = 1.0\n")
    from_file = subprocess.run(
        [*MORPHLING, "emulator", "--listen-ip", "127.0.0.1", "--listen-port", "0",
         "--config", str(settings)],
        capture_output=True, text=True, timeout=60, env=child_env(),
    )  # fmt: skip
    assert (from_file.returncode, from_file.stderr) == (2, f"morphling emulator: {rule}")
    nginx = nginx_config(*pair)
    assert (nginx.returncode, nginx.stdout, nginx.stderr) == (
        2,
        "",
        f"morphling nginx-config: {rule}",
    )


def test_nginx_config_refuses_an_upstream_that_is_its_own_listen_address():
    """``--emulators 127.0.0.1`` wrote an upstream equal to nginx's own 0.0.0.0:39000:
    nginx proxied every connection to itself."""
    done = nginx_config("--emulators", "127.0.0.1")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "morphling nginx-config: --emulators '127.0.0.1' (port 39000) is nginx's own "
        "--listen '0.0.0.0:39000': nginx would proxy to itself; give the emulator's address "
        "(its --listen-port differs from nginx's)\n"
    )


@pytest.mark.parametrize(
    ("listen", "emulators", "itself"),
    [
        ("0.0.0.0:39000", "localhost:39000", True),
        ("0.0.0.0:39000", "10.0.0.2:39000,0.0.0.0", True),
        ("[::]:39000", "[::1]:39000", True),
        ("[::]:39000", "127.0.0.1", False),  # nginx's [::] is ipv6only=on by default
        ("0.0.0.0:39000", "[::1]:39000", False),  # an IPv4 wildcard has no IPv6 address
        ("127.0.0.1:40000", "localhost:40000", True),
        ("0.0.0.0:39000", "127.0.0.1:39001", False),
        ("127.0.0.1:39000", "127.0.0.2:39000", False),  # another socket: nginx binds only .1
        ("0.0.0.0:39000", "203.0.113.7:39000", False),  # another machine
        ("0.0.0.0:39000", "emulator.invalid:39000", False),  # resolved by nginx, elsewhere
    ],
)
def test_an_upstream_is_itself_when_it_is_an_address_nginx_listens_on(listen, emulators, itself):
    cfg = NginxConfig(listen=listen, emulators=emulators)
    if itself:
        with pytest.raises(ValueError, match="nginx would proxy to itself"):
            render(cfg)
    else:
        assert "proxy_pass morphling_emulators;" in render(cfg)


def test_an_address_of_this_hosts_interfaces_is_itself_under_a_wildcard_listen():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.7", 9))  # no packet: only picks the outgoing interface
        except OSError:
            pytest.skip("no route off this host, so no interface address to try")
        own = probe.getsockname()[0]
    with pytest.raises(ValueError, match="nginx would proxy to itself"):
        render(NginxConfig(emulators=f"{own}:39000"))
    assert f"server {own}:39001;" in render(NginxConfig(emulators=f"{own}:39001"))


def test_checked_in_config_is_what_the_documented_command_writes():
    """nginx/morphling.conf is ``morphling nginx-config --stream-module
    /usr/lib/nginx/modules/ngx_stream_module.so`` (docs/DEPLOY.md); it must not drift."""
    expected = render(NginxConfig(stream_module="/usr/lib/nginx/modules/ngx_stream_module.so"))
    assert (REPO / "nginx" / "morphling.conf").read_text() == expected


def test_nginx_accepts_every_generated_shape(install, tmp_path):
    """``nginx -t`` on the configurations the generator writes (TLS loads real files)."""
    tls = openssl_ca(tmp_path)
    shapes = {
        "one": NginxConfig(),
        "several-v6": NginxConfig(emulators="127.0.0.1:1,[::1]:2,localhost:3"),
        "tls": NginxConfig(tls_cert=str(tls["cert"]), tls_key=str(tls["key"]), devices=10000),
    }
    for name, cfg in shapes.items():
        conf = tmp_path / f"{name}.conf"
        conf.write_text(render(NginxConfig(**{**cfg.__dict__, "stream_module":
                                              install.stream_module,
                                              "access_log": str(tmp_path / "a.log")})))  # fmt: skip
        check = subprocess.run(
            [install.binary, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf),
             "-g", f"pid {tmp_path / 'nginx.pid'};"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert check.returncode == 0, f"{name}: {check.stderr}"
        assert "test is successful" in check.stderr


# -- over a running nginx -----------------------------------------------------------------


async def test_device_through_nginx_registers_passes_probes_and_computes(install, procs: Procs):
    emulator, port = procs.emulator()  # probes on: latency, both bandwidths, FLOPS
    proxy, proxy_port = nginx_for(procs.tmp, port)
    try:
        device = procs.device(proxy_port, "board-0")
        text = procs.wait_for(emulator, "device 0 (board-0) ready", timeout=60)
        assert "device 0 (board-0) PROFILE_DELTA" in text
        procs.wait_for(device, "FLOPS challenge passed")
        await gemm_on(port, 0)
        device.signal(2)
        assert device.wait(timeout=10) == 0
        deadline = time.monotonic() + 5
        while f"127.0.0.1:{port}" not in proxy.access_log.read_text():
            assert time.monotonic() < deadline, "nginx logged no session to the emulator"
            time.sleep(0.05)
        session = proxy.access_log.read_text().splitlines()[-1]
        assert session.startswith("127.0.0.1 ") and " TCP 200 " in session
    finally:
        proxy.stop()


async def test_heartbeats_keep_an_idle_device_past_proxy_timeout(install, procs: Procs):
    emulator, port = procs.emulator("--no-probe", "--heartbeat-s", "0.3",
                                    "--heartbeat-timeout-s", "1")  # fmt: skip
    proxy, proxy_port = nginx_for(procs.tmp, port, heartbeat_s=0.3, heartbeat_timeout_s=1)
    try:
        assert "proxy_timeout 1300ms;" in proxy.conf.read_text()
        device = procs.device(proxy_port, "board-0")
        procs.wait_for(emulator, "device 0 (board-0) ready")
        time.sleep(4.0)  # three proxy timeouts with nothing but heartbeats
        await gemm_on(port, 0)
        assert "disconnected" not in emulator.text()
        assert "reconnecting" not in device.text()
    finally:
        proxy.stop()


async def test_a_proxy_timeout_shorter_than_the_heartbeat_drops_idle_devices(install, procs: Procs):
    """The control for the test above: without heartbeats inside proxy_timeout, nginx
    cuts the idle connection (so that test does depend on heartbeats)."""
    emulator, port = procs.emulator("--no-probe", "--heartbeat-s", "3",
                                    "--heartbeat-timeout-s", "10")  # fmt: skip
    proxy, proxy_port = nginx_for(procs.tmp, port, heartbeat_s=0.3, heartbeat_timeout_s=0.7)
    try:
        device = procs.device(proxy_port, "board-0")
        procs.wait_for(emulator, "device 0 (board-0) ready")
        procs.wait_for(emulator, "device 0 (board-0) disconnected", timeout=10)
        procs.wait_for(device, "reconnecting in", timeout=10)
    finally:
        proxy.stop()


async def test_tls_terminated_by_nginx(install, procs: Procs):
    tls = openssl_ca(procs.tmp)
    emulator, port = procs.emulator("--no-probe")
    proxy, proxy_port = nginx_for(procs.tmp, port, tls_cert=str(tls["cert"]),
                                  tls_key=str(tls["key"]))  # fmt: skip
    try:
        procs.device(proxy_port, "board-0", "rpi4", "--tls", "--tls-ca", str(tls["ca"]))
        procs.wait_for(emulator, "device 0 (board-0) ready")
        await gemm_on(port, 0)
        # A board that does not trust the certificate stops and says why.
        untrusting = procs.device(proxy_port, "board-1", "rpi4", "--tls")
        assert untrusting.wait(timeout=30) == 2
        assert f"TLS: 127.0.0.1:{proxy_port} is not who it should be" in untrusting.text()
        assert "board-1" not in emulator.text()
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tls", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem:"),
        (["--tls-ca", "/etc/ca.pem"], "--tls-ca and --tls-server-name need --tls"),
    ],
)
def test_bad_tls_settings_exit_2_naming_the_flag(flags, message):
    done = subprocess.run([*MORPHLING, "device", "--server", "127.0.0.1:9", *flags],
                          capture_output=True, text=True, timeout=60, env=child_env())  # fmt: skip
    assert done.returncode == 2 and message in done.stderr, done.stderr


async def test_nginx_restarted_mid_run_devices_reconnect_and_no_tile_is_lost(install, procs: Procs):
    """nginx cut mid-run (SIGTERM, as ``systemctl restart``) and started again: the boards
    reconnect through it by themselves, and every GEMM of the job comes back right."""
    emulator, port = procs.emulator("--no-probe", "--block-size", "32", "--window", "2")
    proxy, proxy_port = nginx_for(procs.tmp, port)
    try:
        for i in range(2):
            procs.device(proxy_port, f"board-{i}")
        procs.wait_for(emulator, ") ready", 2)
        cases = gemm_cases(3)
        client = await AsyncClient.connect("127.0.0.1", port, name="through-a-restart")
        try:
            tasks = [asyncio.ensure_future(client.matmul(a, b, timeout=120)) for a, b in cases]
            await asyncio.wait_for(asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED), 60)
            assert not all(t.done() for t in tasks), "the run finished before the restart"
            proxy.stop(fast=True)
            await asyncio.sleep(0.5)
            proxy.start()
            results = await asyncio.gather(*tasks)
        finally:
            await client.close()
        for i in range(2):  # each comes back through nginx (its backoff may outlast the job)
            procs.wait_for(emulator, f"(board-{i}) ready", 2, timeout=60)
    finally:
        proxy.stop()
    for (a, b), c in zip(cases, results, strict=True):
        np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert "lost with" in emulator.text()  # the restart did cut them mid-run


async def test_wrong_token_is_refused_with_a_clear_message_on_the_device(install, procs: Procs):
    emulator, port = procs.emulator("--no-probe", "--token", "s3cret")
    proxy, proxy_port = nginx_for(procs.tmp, port)
    try:
        good = procs.device(proxy_port, "board-0", "rpi4", "--token", "s3cret")
        procs.wait_for(emulator, "device 0 (board-0) ready")
        bad = procs.device(proxy_port, "board-1", "rpi4", "--token", "wrong")
        assert bad.wait(timeout=30) == 2
        assert "board-1: emulator says auth: token does not match" in bad.text()
        await gemm_on(port, 0, token="s3cret")  # the refusal cost the good board nothing
        assert good.alive
    finally:
        proxy.stop()


# -- a device on its own host ----------------------------------------------------------------


async def test_device_in_its_own_network_namespace_through_nginx(install, procs: Procs, namespace):
    name, host_ip, device_ip = namespace.name, namespace.host_ip, namespace.ip
    emulator, port = procs.emulator()
    proxy_port = free_port()
    proxy = Nginx(NginxConfig(listen=f"{host_ip}:{proxy_port}", emulators=f"127.0.0.1:{port}"),
                  procs.tmp / "nginx").start()  # fmt: skip
    try:
        device = procs.device(proxy_port, "board-ns", host=host_ip,
                              wrap=("ip", "netns", "exec", name))  # fmt: skip
        procs.wait_for(emulator, "device 0 (board-ns) ready", timeout=60)
        await gemm_on(port, 0)
        device.signal(2)
        assert device.wait(timeout=10) == 0
        deadline = time.monotonic() + 5
        while not proxy.access_log.read_text().strip():
            assert time.monotonic() < deadline, "nginx logged no session"
            time.sleep(0.05)
        # nginx saw the board arrive from the namespace's address, not from loopback.
        assert proxy.access_log.read_text().splitlines()[-1].startswith(f"{device_ip} ")
    finally:
        proxy.stop()
