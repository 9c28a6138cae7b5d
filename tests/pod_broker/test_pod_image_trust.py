"""A rented pod runs only an image signed by a trusted key, pinned to the digest that was checked. Real parts: Debian's
docker-registry on loopback, images pushed (and signed with GPG keys) by skopeo as `scripts/image-trust sign` does,
gpgv checking, the fake RunPod API recording what the broker asked for; NATS and Redis real. Each attack is an image
the broker must not hand to RunPod: unsigned, pushed over a signed tag, signed by another key, a damaged signature,
a trusted signature of another tag or of another image."""

from __future__ import annotations

import contextlib
import functools
import http.server
import shutil
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import redis.asyncio as aioredis

from coderai.accounts.pod_money import PodMoney
from coderai.contracts import BusError, ModelConfig
from coderai.contracts.admin import PodUser
from coderai.contracts.models import PodPolicy
from coderai.contracts.subjects import CMD_SCHEDULER_POD_USER
from coderai.contracts.topology import PODS
from coderai.image_trust import Trust, Untrusted, check_settings, verify
from coderai.pod_broker.runpod_api import RunPodClient
from coderai.pod_broker.service import Broker, make
from coderai.pod_broker.settings import BrokerSettings
from coderai.runtime.settings import SettingsError, load_settings
from coderai.testing import registry as reg
from coderai.testing.fake_runpod import FakeRunPod

pytestmark = pytest.mark.skipif(
    bool(reg.missing_tools()), reason=f"needs {', '.join(reg.missing_tools())} (scripts/setup installs them with dev)"
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(registry host:port, the trusted key, a stranger's key, the lookaside folder, a folder for OCI layouts)."""
    root = tmp_path_factory.mktemp("trust")
    release, stranger = reg.GpgKey(root / "release", "release"), reg.GpgKey(root / "stranger", "stranger")
    try:
        with reg.registry(root / "registry") as host:
            sigstore = root / "sigstore"
            sigstore.mkdir()
            yield SimpleNamespace(host=host, release=release, stranger=stranger, sigstore=sigstore, root=root)
    finally:
        release.close()
        stranger.close()


def image(world, content: str) -> str:
    """A fresh one-layer image (its own content, so its own digest) as a skopeo source."""
    return reg.oci_image(world.root / f"layout-{uuid.uuid4().hex[:8]}", content)


def digest_of(world, repo: str, tag: str) -> str:
    r = httpx.get(
        f"http://{world.host}/v2/{repo}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    assert r.status_code == 200, r.text
    return r.headers["Docker-Content-Digest"]


@pytest.fixture
async def broker(bus, redis_server, world):
    """A factory: (broker, fake RunPod) for a model whose pods run `image`, checked against `key`."""

    async def pod_user(req, _m) -> PodUser:  # the scheduler's part: the pod's own NATS login
        return PodUser(user=f"pod-{req.pod_id}", password="pw", expires_at=time.time() + req.ttl_s)

    async with contextlib.AsyncExitStack() as cleanup:
        sub = await bus.serve(CMD_SCHEDULER_POD_USER, pod_user)
        cleanup.push_async_callback(sub.unsubscribe)

        async def make_broker(pod_image: str, key: Path | None = None, sigstore: str = ""):
            tag = uuid.uuid4().hex[:8]
            settings = load_settings(
                BrokerSettings,
                "pod-broker",
                env={},
                max_hourly_usd=10.0,
                pod_nats_url="nats://pods:4222",
                deployment=f"t{tag}",
                pod_image_key=str(key or world.release.public),
                pod_image_sigstore=sigstore or str(world.sigstore),
                pod_image_registry_url=f"http://{world.host}",
            )
            fake = cleanup.enter_context(FakeRunPod())
            r = aioredis.from_url(redis_server.url)
            cleanup.push_async_callback(r.aclose)
            b = Broker(settings, api=RunPodClient(fake.api_key, fake.base_url), money=PodMoney(r, prefix=f"t:{tag}"))
            cleanup.push_async_callback(b.api.aclose)
            b.bus, b.kv = bus, await bus.kv(PODS)
            model = ModelConfig(
                name="m", engine="llama", path="/m.gguf", pod=PodPolicy(burst="when_no_fit", image=pod_image)
            )
            b.models = SimpleNamespace(values={"m": model})
            return b, fake

        yield make_broker


async def refused(make_broker, pod_image: str, why: str, **kw) -> str:
    """The broker refuses to rent a pod for `pod_image`: RunPod is asked for nothing, no money is held."""
    b, fake = await make_broker(pod_image, **kw)
    with pytest.raises(BusError) as err:
        await b.acquire("m")
    assert err.value.code == "no_engine" and "its image is refused" in err.value.message, why
    assert fake.pods() == [], f"{why}: a pod was rented"
    assert await b.money.ledger() == [] and b.pods == {}, f"{why}: something was held"
    return err.value.message


async def test_a_pod_runs_the_signed_image_pinned_to_the_digest_that_was_checked(world, broker):
    ref = f"{world.host}/coderai-worker:signed"
    reg.push(image(world, "signed"), ref, sigstore=world.sigstore, key=world.release)
    b, fake = await broker(ref)
    pod = await b.acquire("m")
    [rented] = fake.pods()
    assert rented.id == pod.pod_id
    assert rented.image == f"{world.host}/coderai-worker@{digest_of(world, 'coderai-worker', 'signed')}"


async def test_an_unsigned_image_pushed_over_a_signed_tag_is_refused(world, broker):
    ref = f"{world.host}/coderai-worker:moved"
    reg.push(image(world, "first"), ref, sigstore=world.sigstore, key=world.release)
    reg.push(image(world, "swapped"), ref, sigstore=world.sigstore)  # the tag now names bytes nobody signed
    message = await refused(broker, ref, "an unsigned image over a signed tag")
    assert "no signature" in message


async def test_an_image_signed_by_another_key_is_refused(world, broker):
    ref = f"{world.host}/coderai-worker:stranger"
    reg.push(image(world, "stranger"), ref, sigstore=world.sigstore, key=world.stranger)
    message = await refused(broker, ref, "another key's signature")
    assert "not signed by a trusted key" in message


async def test_a_damaged_signature_is_refused(world, broker):
    ref = f"{world.host}/coderai-worker:damaged"
    reg.push(image(world, "damaged"), ref, sigstore=world.sigstore, key=world.release)
    digest = digest_of(world, "coderai-worker", "damaged").replace(":", "=")
    signature = world.sigstore / f"coderai-worker@{digest}" / "signature-1"
    good = signature.read_bytes()
    signature.write_bytes(good[:-40] + bytes(40))
    await refused(broker, ref, "a damaged signature")


async def test_a_trusted_signature_of_another_tag_does_not_cover_this_one(world, broker):
    """The signature is stored by digest, so the same bytes pushed under another tag find it: it names the tag
    that was signed (`:stable`), and a request for `:latest-debug` must not ride on it."""
    source = image(world, "retagged")
    reg.push(source, f"{world.host}/coderai-worker:stable", sigstore=world.sigstore, key=world.release)
    reg.push(source, f"{world.host}/coderai-worker:latest-debug", sigstore=world.sigstore)
    message = await refused(broker, f"{world.host}/coderai-worker:latest-debug", "another tag's signature")
    assert "it names" in message and ":stable" in message


async def test_a_trusted_signature_of_another_image_put_beside_this_one_is_refused(world, broker):
    ref = f"{world.host}/coderai-worker:planted"
    signed = f"{world.host}/coderai-worker:genuine"
    reg.push(image(world, "genuine"), signed, sigstore=world.sigstore, key=world.release)
    reg.push(image(world, "planted"), ref, sigstore=world.sigstore)
    genuine = world.sigstore / f"coderai-worker@{digest_of(world, 'coderai-worker', 'genuine').replace(':', '=')}"
    planted = world.sigstore / f"coderai-worker@{digest_of(world, 'coderai-worker', 'planted').replace(':', '=')}"
    planted.mkdir()
    shutil.copy(genuine / "signature-1", planted / "signature-1")
    message = await refused(broker, ref, "a signature of other bytes")
    assert "signs another image" in message


async def test_signatures_served_over_http_and_an_armored_key_check_the_same(world, broker, tmp_path):
    """The lookaside store as a web server (how machines usually read it) and the key exported with --armor."""
    import subprocess

    ref = f"{world.host}/coderai-worker:web"
    reg.push(image(world, "web"), ref, sigstore=world.sigstore, key=world.release)
    armored = tmp_path / "release.asc"
    armored.write_bytes(
        subprocess.run(
            ["gpg", "--export", "--armor", world.release.fingerprint], env=world.release.env, capture_output=True
        ).stdout
    )
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(world.sigstore))
    handler.log_message = lambda *_a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        web = f"http://127.0.0.1:{server.server_port}"
        b, fake = await broker(ref, key=armored, sigstore=web)
        await b.acquire("m")
        [rented] = fake.pods()
        assert rented.image.endswith(digest_of(world, "coderai-worker", "web"))
        trust = Trust(str(armored), web, f"http://{world.host}")
        with pytest.raises(Untrusted, match="no signature"):  # nothing under that digest on the web server either
            reg.push(image(world, "web-unsigned"), f"{world.host}/coderai-worker:web2", sigstore=world.sigstore)
            verify(f"{world.host}/coderai-worker:web2", trust)
    finally:
        server.shutdown()
        server.server_close()


def test_a_broker_whose_key_cannot_be_used_does_not_start(tmp_path, world):
    """Every pod would be refused: the broker says why at start (exit 2 through its entry point)."""
    cases = {
        "cannot read": {"pod_image_key": str(tmp_path / "absent.gpg"), "pod_image_sigstore": str(world.sigstore)},
        "no signature store": {"pod_image_key": str(world.release.public)},
    }
    empty = tmp_path / "empty.gpg"
    empty.write_bytes(b"")
    cases["empty"] = {"pod_image_key": str(empty), "pod_image_sigstore": str(world.sigstore)}
    for why, settings in cases.items():
        with pytest.raises(SettingsError, match=why):
            make(load_settings(BrokerSettings, "pod-broker", env={}, **settings))
    check_settings(str(world.release.public), str(world.sigstore))  # and a usable one passes


async def test_a_refusal_is_kept_a_while_then_the_image_is_checked_again(world, broker, monkeypatch):
    """A warm floor asks for a pod every round: a refused image is refused again from memory for RECHECK_S, not
    fetched each time; once that has passed, a signature added meanwhile is seen."""
    from coderai.pod_broker import pod_images

    ref = f"{world.host}/coderai-worker:later"
    source = image(world, "later")
    reg.push(source, ref, sigstore=world.sigstore)
    b, fake = await broker(ref)
    for _ in range(2):
        with pytest.raises(BusError, match="no signature"):
            await b.acquire("m")
    reg.push(source, ref, sigstore=world.sigstore, key=world.release)  # now signed
    with pytest.raises(BusError, match="no signature"):  # still the remembered refusal
        await b.acquire("m")
    monkeypatch.setattr(pod_images, "RECHECK_S", 0.0)
    await b.acquire("m")
    [rented] = fake.pods()
    assert rented.image == f"{world.host}/coderai-worker@{digest_of(world, 'coderai-worker', 'later')}"
