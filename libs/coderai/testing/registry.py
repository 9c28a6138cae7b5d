"""A real container registry and real signing keys for tests: Debian's `docker-registry` (distribution) on a
loopback port, GPG keys in GNUPGHOMEs of their own, a tiny OCI image made without Docker, and `skopeo` pushing it
with or without a simple-signing signature (the lookaside layout `coderai.image_trust` reads)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from coderai.runtime.embedded import free_port
from coderai.testing.procs import wait_until

TOOLS = ("docker-registry", "skopeo", "gpg", "gpgv")


def missing_tools() -> list[str]:
    """Which of the registry, skopeo and GPG programs are not installed (scripts/setup installs them with dev)."""
    return [t for t in TOOLS if not shutil.which(t)]


@contextmanager
def registry(root: Path) -> Iterator[str]:
    """Debian's docker-registry serving plain HTTP on a loopback port, its data under `root`: yields host:port."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (root / "config.yml").write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
    )
    with open(root / "registry.log", "ab") as log:
        proc = subprocess.Popen(
            ["docker-registry", "serve", str(root / "config.yml")], stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=2).status_code == 200, 60, "the registry")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


class GpgKey:
    """A signing key made in its own GNUPGHOME: `fingerprint`, `public` (the `gpg --export` file a verifier is
    given) and `env` (to sign with). `close()` stops the gpg-agent that gpg started for it."""

    def __init__(self, home: Path, name: str) -> None:
        home.mkdir(mode=0o700, parents=True)
        self.home = home
        self.env = {**os.environ, "GNUPGHOME": str(home)}
        uid = f"{name} <{name}@coderai.invalid>"
        gen = ["gpg", "--batch", "--passphrase", "", "--quick-gen-key", uid, "ed25519", "sign", "never"]
        subprocess.run(gen, env=self.env, check=True, capture_output=True, timeout=60)
        listed = subprocess.run(
            ["gpg", "--with-colons", "--list-keys", uid], env=self.env, check=True, capture_output=True, text=True
        ).stdout
        self.fingerprint = next(line.split(":")[9] for line in listed.splitlines() if line.startswith("fpr:"))
        self.public = home.parent / f"{name}.pub.gpg"
        self.public.write_bytes(
            subprocess.run(["gpg", "--export", self.fingerprint], capture_output=True, env=self.env, check=True).stdout
        )

    def close(self) -> None:
        subprocess.run(["gpgconf", "--kill", "all"], env=self.env, check=False, capture_output=True)


def _blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def oci_image(layout: Path, content: str, tag: str = "latest") -> str:
    """A one-layer OCI image (one file whose text is `content`) in an OCI layout folder, made without Docker:
    what `skopeo copy oci:<layout>:<tag>` pushes. Returns the source reference."""
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("content.txt")
        body = content.encode()
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    layer = gzip.compress(raw.getvalue(), mtime=0)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw.getvalue()).hexdigest()}"]},
        "config": {},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **_blob(layout, json.dumps(config).encode()),
        },
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_blob(layout, layer)}],
    }
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **_blob(layout, json.dumps(manifest).encode()),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return f"oci:{layout}:{tag}"


def push(source: str, dest: str, *, sigstore: Path, key: GpgKey | None = None) -> None:
    """`skopeo copy` `source` to the plain-HTTP registry reference `dest`, signed by `key` (its signature written
    to the lookaside folder `sigstore`) or unsigned."""
    registries_d = sigstore.parent / f"{sigstore.name}.registries.d"
    registries_d.mkdir(exist_ok=True)
    host = dest.split("/", 1)[0]
    (registries_d / "coderai.yaml").write_text(
        f"docker:\n  {host}:\n    sigstore: file://{sigstore}\n    sigstore-staging: file://{sigstore}\n"
    )
    cmd = ["skopeo", "--registries.d", str(registries_d), "copy", "--quiet", "--dest-tls-verify=false"]
    if key is not None:
        cmd += ["--sign-by", key.fingerprint]
    subprocess.run(
        [*cmd, source, f"docker://{dest}"], env=key.env if key else None, check=True, capture_output=True, timeout=120
    )
