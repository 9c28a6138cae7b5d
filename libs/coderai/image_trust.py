"""Is this image signed by a key we trust? Checked by the pod-broker before a rented pod runs an image, the same
check `scripts/image-trust pull` makes (with skopeo) before a machine loads one.

The format is containers' simple signing, what `skopeo copy --sign-by` writes (and `scripts/image-trust sign`): an
OpenPGP-signed JSON document naming the image (`docker-reference`) and its manifest's digest, kept beside the
registry in a "lookaside" store, `<sigstore>/<repository>@sha256=<hex>/signature-<n>`, an http(s) URL or a folder.

`verify` reads the manifest the registry serves for the reference, hashes it, reads the signatures of that digest,
checks each with `gpgv` against the trusted public keys only (a keyring of its own: no user's keys, no trust
database) and accepts one that is good, names this reference (by tag: exactly this repository and tag; by digest:
this repository) and this digest. It returns the reference pinned to the digest, `registry/repository@sha256:...`,
which is what the pod is given: RunPod pulls exactly the bytes that were checked, whatever the tag says later.
Needs `gpgv` (Debian's gpgv, which apt itself depends on)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from coderai.oci import MANIFEST_MEDIA_TYPES, ImageRef, ImageRefError, manifest_url, parse_image_ref
from coderai.pods_cli import anonymous_token

SIGNATURE_TYPE = "atomic container signature"
MAX_SIGNATURES = 8  # signature-1 .. signature-8 of one digest are read; a store is not a place to page through
MAX_SIGNATURE_BYTES = 64 * 1024
MAX_MANIFEST_BYTES = 4 * 1024 * 1024


class Untrusted(Exception):
    """The image is not run: the message says why (never a key's contents)."""


@dataclass(frozen=True)
class Trust:
    """What a signature must check against: `keys`, a file of OpenPGP public keys (`gpg --export`, binary or
    `--armor`); `sigstore`, the lookaside store (http(s)://, file:// or a folder); `registry_url`, the registry
    API's base URL when it is not https://<registry> (a plain-HTTP registry on a private network)."""

    keys: str
    sigstore: str
    registry_url: str = ""


def check_settings(keys: str, sigstore: str) -> None:
    """Raise Untrusted unless a trust setting is usable: a readable key file with at least one key, a sigstore,
    and gpgv installed. Called at start, so that a broker that would refuse every image says so at once."""
    if not sigstore:
        raise Untrusted("a pod image key is set but no signature store (pod_image_sigstore)")
    if not shutil.which("gpgv"):
        raise Untrusted("checking pod images needs gpgv (apt-get install gpgv)")
    try:
        _keyring_bytes(Path(keys))
    except OSError as exc:
        raise Untrusted(f"cannot read the pod image key file {keys}: {exc.strerror or exc}") from None


def _keyring_bytes(path: Path) -> bytes:
    """The key file as binary OpenPGP packets (an ASCII-armored export is decoded)."""
    data = path.read_bytes()
    if not data.lstrip().startswith(b"-----BEGIN PGP"):
        if not data:
            raise OSError(0, "the file is empty")
        return data
    body: list[str] = []
    lines = data.decode("ascii", "replace").splitlines()
    start = next((i for i, line in enumerate(lines) if not line.strip()), None)  # headers end at a blank line
    for line in lines[(start or 0) + 1 :]:
        if line.startswith(("=", "-----END")):
            break
        body.append(line.strip())
    try:
        packets = base64.b64decode("".join(body), validate=True)
    except binascii.Error:
        raise OSError(0, "not an OpenPGP key (bad armor)") from None
    if not packets:
        raise OSError(0, "no key in the armored file")
    return packets


def signature_payload(signature: bytes, keys: str) -> tuple[dict, str]:
    """(the signed JSON, the signing key's fingerprint) when `signature` is a good signature by a key in `keys`;
    Untrusted otherwise."""
    with tempfile.TemporaryDirectory(prefix="coderai-gpgv-") as home:
        keyring = Path(home, "trusted.gpg")
        keyring.write_bytes(_keyring_bytes(Path(keys)))
        sig = Path(home, "signature")
        sig.write_bytes(signature)
        out = Path(home, "payload")
        r = subprocess.run(
            ["gpgv", "--homedir", home, "--keyring", str(keyring), "--status-fd", "1", "--output", str(out), str(sig)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"},
        )
        status = [line.split()[1:] for line in r.stdout.splitlines() if line.startswith("[GNUPG:] ")]
        valid = [s[1] for s in status if s[0] == "VALIDSIG" and len(s) > 1]
        bad = {s[0] for s in status} & {"BADSIG", "ERRSIG", "EXPKEYSIG", "REVKEYSIG", "EXPSIG"}
        if r.returncode != 0 or not valid or bad:
            why = "not signed by a trusted key" if "ERRSIG" in bad or not status else "a bad signature"
            raise Untrusted(why)
        try:
            payload = json.loads(out.read_bytes())
        except (OSError, ValueError):
            raise Untrusted("the signed document is not JSON") from None
    if not isinstance(payload, dict):
        raise Untrusted("the signed document is not a JSON object")
    return payload, valid[0]


def check_payload(payload: dict, ref: ImageRef, digest: str) -> None:
    """Untrusted unless the signed document is a container signature of `digest` that names `ref`."""
    critical = payload.get("critical")
    if not isinstance(critical, dict) or critical.get("type") != SIGNATURE_TYPE:
        raise Untrusted("not a container signature")
    image = critical.get("image")
    signed_digest = image.get("docker-manifest-digest") if isinstance(image, dict) else None
    if signed_digest != digest:
        raise Untrusted(f"it signs another image ({signed_digest}), not {digest}")
    identity = critical.get("identity")
    name = identity.get("docker-reference") if isinstance(identity, dict) else None
    try:
        signed = parse_image_ref(name) if isinstance(name, str) else None
    except ImageRefError:
        signed = None
    if signed is None:
        raise Untrusted("it names no image")
    same_repo = (signed.registry, signed.repository) == (ref.registry, ref.repository)
    if not same_repo or (ref.tag and not ref.digest and signed.tag != ref.tag):
        raise Untrusted(f"it names {name}, not {ref}")


def lookaside_url(sigstore: str, ref: ImageRef, digest: str, index: int) -> str:
    """Where signature `index` (from 1) of `digest` is: the layout skopeo writes."""
    algorithm, _, hexdigest = digest.partition(":")
    return f"{sigstore.rstrip('/')}/{ref.repository}@{algorithm}={hexdigest}/signature-{index}"


def _read_signature(client: httpx.Client, url: str) -> bytes | None:
    """The signature at `url`, or None when there is none (404, or no such file)."""
    parts = urlsplit(url)
    if parts.scheme in ("", "file"):
        path = Path(unquote(parts.path) if parts.scheme else url)
        try:
            with path.open("rb") as f:
                data = f.read(MAX_SIGNATURE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Untrusted(f"cannot read its signature: {exc.strerror}") from None
    else:
        try:
            r = client.get(url)
        except httpx.HTTPError as exc:
            raise Untrusted(f"the signature store is unreachable: {type(exc).__name__}") from None
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise Untrusted(f"the signature store answered HTTP {r.status_code}")
        data = r.content
    if len(data) > MAX_SIGNATURE_BYTES:
        raise Untrusted(f"a signature over {MAX_SIGNATURE_BYTES} bytes")
    return data


def _manifest(client: httpx.Client, ref: ImageRef, registry_url: str) -> tuple[bytes, str]:
    """(the manifest's bytes, their sha256 digest) as the registry serves them for `ref` (an anonymous pull, as a
    pod makes)."""
    url = manifest_url(ref, registry_url)
    headers = {"Accept": ", ".join(MANIFEST_MEDIA_TYPES)}
    try:
        r = client.get(url, headers=headers)
        if r.status_code == 401:
            token = anonymous_token(client, r.headers.get("WWW-Authenticate", ""), ref)
            if token:
                r = client.get(url, headers={**headers, "Authorization": f"Bearer {token}"})
    except Exception as exc:  # transport errors, a bad challenge: the registry could not be asked
        raise Untrusted(f"its registry could not be asked: {type(exc).__name__}") from None
    if r.status_code != 200:
        raise Untrusted(f"its registry answered HTTP {r.status_code} for the manifest")
    if len(r.content) > MAX_MANIFEST_BYTES:
        raise Untrusted("its manifest is too large")
    digest = "sha256:" + hashlib.sha256(r.content).hexdigest()
    said = r.headers.get("Docker-Content-Digest", "")
    if said and said != digest:
        raise Untrusted(f"the registry calls its manifest {said}, but it hashes to {digest}")
    if ref.digest and ref.digest != digest:
        raise Untrusted(f"the registry served {digest} for {ref.digest}")
    return r.content, digest


def verify(image: str, trust: Trust, client: httpx.Client | None = None) -> str:
    """`image` pinned to the digest that a trusted signature covers (`registry/repository@sha256:...`), or
    Untrusted with the reasons each signature was refused."""
    try:
        ref = parse_image_ref(image)
    except ImageRefError as exc:
        raise Untrusted(str(exc)) from None
    own = client is None
    client = client or httpx.Client(timeout=15.0, follow_redirects=True, headers={"User-Agent": "coderai-pod-broker"})
    try:
        _, digest = _manifest(client, ref, trust.registry_url)
        reasons: list[str] = []
        for index in range(1, MAX_SIGNATURES + 1):
            signature = _read_signature(client, lookaside_url(trust.sigstore, ref, digest, index))
            if signature is None:
                break
            try:
                payload, _fingerprint = signature_payload(signature, trust.keys)
                check_payload(payload, ref, digest)
            except Untrusted as exc:
                reasons.append(f"signature-{index}: {exc}")
                continue
            return f"{ref.registry}/{ref.repository}@{digest}"
    finally:
        if own:
            client.close()
    raise Untrusted(f"{image} ({digest}) is not signed by a trusted key: {'; '.join(reasons) or 'no signature'}")
