"""`coderai pods check` against a registry on loopback that answers as ghcr.io and Docker Hub do: a HEAD without
a token gets 401 with a Bearer challenge, the realm hands out an anonymous pull token, and with it the manifest
is 200 with its digest or 404; a private repository stays 401. A closed port stands for being offline."""

from __future__ import annotations

import json
import secrets
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from coderai import pods_cli
from coderai.cli import main as coderai_main
from coderai.oci import DEFAULT_POD_IMAGE, MANIFEST_MEDIA_TYPES, parse_image_ref
from coderai.pod_broker.settings import BrokerSettings

SERVICE = "test-registry"
FOUND = "ghcr.io/coderai/coderai-worker-cuda:0.1.0"
FOUND_DIGEST = "sha256:" + "1f" * 32
OTHER = "docker.io/you/worker:2"  # a Docker Hub name: the override URL is asked for it all the same
OTHER_DIGEST = "sha256:" + "2e" * 32
MISSING = "ghcr.io/coderai/coderai-worker-cuda:9.9.9"
PRIVATE = "ghcr.io/someone/private-worker:1"


@dataclass
class Registry:
    """What the fake registry holds and what it was asked."""

    url: str = ""
    manifests: dict[tuple[str, str], str] = field(default_factory=dict)  # (repository, tag) -> digest
    private: set[str] = field(default_factory=set)
    tokens: dict[str, str] = field(default_factory=dict)  # token -> the scope it was given for
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(reg: Registry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:
            pass

        def _reply(self, code: int, headers: dict[str, str] | None = None, body: bytes = b"") -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _record(self) -> None:
            with reg.lock:
                reg.seen.append((self.command, self.path, dict(self.headers)))

        def do_GET(self) -> None:  # the token realm
            self._record()
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path != "/token" or query.get("service") != SERVICE or not query.get("scope"):
                return self._reply(400)
            token = "tok-" + secrets.token_hex(16)
            with reg.lock:
                reg.tokens[token] = query["scope"]
            self._reply(200, {"Content-Type": "application/json"}, json.dumps({"token": token}).encode())

        def do_HEAD(self) -> None:  # a manifest
            self._record()
            path = urlsplit(self.path).path
            if not (path.startswith("/v2/") and "/manifests/" in path):
                return self._reply(404)
            repository, _, tag = path.removeprefix("/v2/").partition("/manifests/")
            scope = f"repository:{repository}:pull"
            auth = self.headers.get("Authorization", "")
            with reg.lock:
                granted = reg.tokens.get(auth.removeprefix("Bearer ")) == scope and auth.startswith("Bearer ")
            if not granted or repository in reg.private:
                return self._reply(
                    401, {"WWW-Authenticate": f'Bearer realm="{reg.url}/token",service="{SERVICE}",scope="{scope}"'}
                )
            digest = reg.manifests.get((repository, tag))
            if digest is None:
                return self._reply(404, {"Content-Type": "application/json"})
            self._reply(
                200, {"Docker-Content-Digest": digest, "Content-Type": "application/vnd.oci.image.index.v1+json"}
            )

    return Handler


@pytest.fixture
def registry() -> Iterator[Registry]:
    reg = Registry()
    for image, digest in ((FOUND, FOUND_DIGEST), (OTHER, OTHER_DIGEST), (DEFAULT_POD_IMAGE, FOUND_DIGEST)):
        ref = parse_image_ref(image)
        reg.manifests[(ref.repository, ref.tag)] = digest
    reg.private.add(parse_image_ref(PRIVATE).repository)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(reg))
    reg.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )  # quick shutdown
    thread.start()
    yield reg
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Only what a test sets decides the broker's image; loopback is never sent through a proxy."""
    for var in ("CODERAI_CONFIG", "CODERAI_POD_IMAGE", "CODERAI_POD_BROKER_POD_IMAGE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.lower(), raising=False)


def _check(capsys, *args: str) -> tuple[int, str, str]:
    rc = pods_cli.main(["check", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_found_after_the_anonymous_token_dance(registry, capsys, monkeypatch):
    monkeypatch.setenv("CODERAI_POD_BROKER_POD_IMAGE", FOUND)
    rc, out, _ = _check(capsys, "--registry-url", registry.url)
    assert rc == 0
    assert out == f"{FOUND} (the broker's pod_image): found {FOUND_DIGEST}\n"
    heads = [s for s in registry.seen if s[0] == "HEAD"]
    assert [h[1] for h in heads] == ["/v2/coderai/coderai-worker-cuda/manifests/0.1.0"] * 2
    assert "Authorization" not in heads[0][2] and heads[1][2]["Authorization"].startswith("Bearer tok-")
    assert set(heads[0][2]["Accept"].split(", ")) == set(MANIFEST_MEDIA_TYPES), "indexes and manifests, both kinds"
    [get] = [s for s in registry.seen if s[0] == "GET"]
    assert parse_qs(urlsplit(get[1]).query)["scope"] == ["repository:coderai/coderai-worker-cuda:pull"]
    assert not any(token in out for token in registry.tokens), "a token is never printed"


def test_the_default_is_the_release_image_of_this_version(registry, capsys):
    assert BrokerSettings().pod_image == DEFAULT_POD_IMAGE, "the command reads the default the broker has"
    rc, out, _ = _check(capsys, "--registry-url", registry.url)
    assert rc == 0 and out.startswith(f"{DEFAULT_POD_IMAGE} (the broker's pod_image): found sha256:")


def test_missing_exits_1(registry, capsys, monkeypatch):
    monkeypatch.setenv("CODERAI_POD_IMAGE", MISSING)  # the shared name, as load_settings reads it for the broker
    rc, out, _ = _check(capsys, "--registry-url", registry.url)
    assert rc == 1
    assert out.startswith(f"{MISSING} (the broker's pod_image): missing: ")
    assert "(HTTP 404)" in out


def test_private_is_denied_exits_1(registry, capsys, monkeypatch):
    monkeypatch.setenv("CODERAI_POD_BROKER_POD_IMAGE", PRIVATE)
    rc, out, _ = _check(capsys, "--registry-url", registry.url)
    assert rc == 1 and "denied: " in out and "anonymous" in out


def test_unreachable_is_skipped_and_says_so(capsys, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("CODERAI_POD_BROKER_POD_IMAGE", FOUND)
    rc, out, _ = _check(capsys, "--registry-url", f"http://127.0.0.1:{port}", "--timeout", "5")
    assert rc == 0
    assert f"skipped: 127.0.0.1:{port} unreachable (offline?)" in out


def test_settings_file_and_models_file(registry, capsys, tmp_path, monkeypatch):
    config = tmp_path / "coderai.toml"
    config.write_text(f'[pod_broker]\npod_image = "{FOUND}"\nmax_hourly_usd = 3.0\n')
    monkeypatch.setenv("CODERAI_CONFIG", str(config))
    models = tmp_path / "models.toml"
    models.write_text(f"""
[[models]]
name = "a"
engine = "llama"
path = "/models/a.gguf"
pod = {{ burst = "when_no_fit", image = "{MISSING}" }}

[[models]]
name = "b"
engine = "llama"
path = "/models/b.gguf"
pod = {{ burst = "always", image = "{OTHER}" }}

[[models]]
name = "c"
engine = "llama"
path = "/models/c.gguf"
pod = {{ image = "{OTHER}" }}

[[models]]
name = "d"
engine = "llama"
path = "/models/d.gguf"
""")
    rc, out, _ = _check(capsys, "--registry-url", registry.url, "--models-file", str(models))
    assert rc == 1, "one image is missing"
    assert out.splitlines() == [
        f"{FOUND} (the broker's pod_image): found {FOUND_DIGEST}",
        f"{MISSING} (pod.image of a): missing: 127.0.0.1:{registry.url.rsplit(':', 1)[1]} has no 9.9.9 of "
        "coderai/coderai-worker-cuda (HTTP 404)",
        f"{OTHER} (pod.image of b, pod.image of c): found {OTHER_DIGEST}",
    ]


def test_a_vllm_model_on_the_cuda_image_is_a_problem(registry, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CODERAI_POD_BROKER_POD_IMAGE", FOUND)
    models = tmp_path / "models.toml"
    models.write_text("""
[[models]]
name = "big"
engine = "vllm"
path = "/models/big"
pod = { burst = "when_busy" }

[[models]]
name = "quiet"
engine = "vllm"
path = "/models/quiet"
""")
    rc, out, _ = _check(capsys, "--registry-url", registry.url, "--models-file", str(models))
    assert rc == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"problem: model big (engine vllm) would run {FOUND}, which has no vLLM")
    assert "ghcr.io/coderai/coderai-worker-vllm:" in lines[0]
    assert len(lines) == 2 and "found" in lines[1], "a model that never bursts is no problem"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"CODERAI_POD_BROKER_POD_IMAGE": "ghcr.io/Bad/Name"}, "repository name part 'Bad'"),
        ({"CODERAI_CONFIG": "/nonexistent/coderai.toml"}, "CODERAI_CONFIG=/nonexistent/coderai.toml"),
    ],
)
def test_bad_settings_exit_2(capsys, monkeypatch, env, says):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, err = _check(capsys, "--registry-url", "http://127.0.0.1:9")
    assert rc == 2 and out == "" and says in err


def test_bad_models_file_exits_2(capsys, tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text("[[models]]\nname = 1\n")
    rc, _, err = _check(capsys, "--models-file", str(bad), "--registry-url", "http://127.0.0.1:9")
    assert rc == 2 and str(bad) in err


def test_coderai_pods_check_is_a_command(registry, capsys, monkeypatch):
    monkeypatch.setenv("CODERAI_POD_BROKER_POD_IMAGE", FOUND)
    assert coderai_main(["pods", "check", "--registry-url", registry.url]) == 0
    assert "found" in capsys.readouterr().out
    assert coderai_main(["pods"]) == 2, "no subcommand: usage"


def test_the_pods_nats_endpoint_is_checked_for_tls_with_the_clusters_ca(registry, capsys, monkeypatch, tmp_path):
    """The endpoint pods connect to answers TLS with a certificate of the CA pods pin; another CA, a closed port or
    plain text beyond loopback fail (exit 1). Nothing logs in."""
    from coderai.runtime.embedded import NatsServer, free_port
    from coderai.runtime.tls import ensure_certs

    monkeypatch.setenv("CODERAI_POD_BROKER_POD_IMAGE", FOUND)
    certs, stranger = ensure_certs(tmp_path / "certs"), ensure_certs(tmp_path / "other")
    with (
        NatsServer(tmp_path / "tls", port=free_port(), tls=certs).start() as nats,
        NatsServer(tmp_path / "plain", port=free_port()).start() as plain,
    ):
        tls_url = f"tls://127.0.0.1:{nats.port}"
        monkeypatch.setenv("CODERAI_POD_BROKER_POD_NATS_URL", tls_url)
        rc, out, _ = _check(capsys, "--registry-url", registry.url, "--ca", str(certs.ca))
        assert rc == 0, out
        assert f"pods' NATS 127.0.0.1:{nats.port}: TLS, certificate of this cluster's CA" in out

        rc, out, _ = _check(capsys, "--registry-url", registry.url, "--ca", str(stranger.ca))
        assert rc == 1 and "not signed by this cluster's CA" in out

        closed = _closed_port()
        rc, out, _ = _check(
            capsys,
            "--registry-url",
            registry.url,
            "--ca",
            str(certs.ca),
            "--timeout",
            "5",
            "--pod-nats-url",
            f"{tls_url},nats://127.0.0.1:{closed}",
        )
        assert rc == 1 and f"pods' NATS 127.0.0.1:{closed}: unreachable from here" in out
        assert f"pods' NATS 127.0.0.1:{nats.port}: TLS" in out  # every server of the list is asked

        rc, out, _ = _check(capsys, "--registry-url", registry.url, "--pod-nats-url", f"nats://127.0.0.1:{plain.port}")
        assert rc == 0 and "plain text on loopback" in out
    assert pods_cli.check_endpoint(f"nats://127.0.0.1:{closed}", "", 2)[0][1] is False
