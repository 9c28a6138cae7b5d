"""`coderai pods check`: does the image a rented pod would run exist in its registry, and can a pod reach this
cluster's NATS over TLS?

RunPod pulls the pod image anonymously when the broker creates a pod; an image that is not there (a typo, a
version never released, a private package) costs a boot timeout of billed GPU time before the broker gives up.
This asks each registry first, with the OCI distribution API: `HEAD /v2/<name>/manifests/<tag>`, and on a 401
the anonymous bearer token its `WWW-Authenticate` challenge names (how ghcr.io and Docker Hub serve public
images). The images are the broker's `pod_image`, read as the broker reads it (`CODERAI_POD_BROKER_POD_IMAGE`,
`CODERAI_POD_IMAGE`, the `[pod_broker]` table of `CODERAI_CONFIG`, else the release image of this version), and
with `--models-file` every model's own `pod.image`.

With the broker's `pod_nats_url` set (or `--pod-nats-url`), each server there is asked for a TLS handshake and
checked to show a certificate of the cluster's CA (`--ca`, else CODERAI_NATS_CA: the CA a pod pins), without
renting anything or logging in.

Exit status: 0 when every image was found (or could not be asked because its registry is unreachable: such a
line says `skipped`) and every pods' NATS server answered TLS; 1 when an image is missing, denied to an anonymous
pull or its registry answered an error, or when a pods' NATS server is unreachable from here, speaks plain text
beyond loopback or shows a certificate of another CA; 2 on bad settings, a bad reference or a bad models file.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import msgspec

from coderai.oci import (
    DEFAULT_POD_IMAGE,
    MANIFEST_MEDIA_TYPES,
    WORKER_CUDA,
    WORKER_VLLM,
    ImageRef,
    ImageRefError,
    manifest_url,
    parse_image_ref,
    parse_www_authenticate,
    release_image,
    token_request,
)
from coderai.runtime.settings import SettingsError, load_settings
from coderai.runtime.tls import ca_text


class _BrokerImage(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of the pod-broker's settings this command needs. load_settings reads a struct's own fields
    only, so this reads them from the same variables and TOML keys as the broker's BrokerSettings
    (which a library may not import: services import libs, never the other way round)."""

    pod_image: str = DEFAULT_POD_IMAGE
    pod_nats_url: str = ""  # where a pod reaches this cluster's NATS: checked for reachability over TLS when set


@dataclass(frozen=True)
class Outcome:
    """What a registry said about one image: `status` is found, missing, denied, error or skipped."""

    status: str
    detail: str = ""
    digest: str = ""

    @property
    def ok(self) -> bool:
        """Found, or not checked because the registry could not be reached (offline)."""
        return self.status in ("found", "skipped")


class _Unreachable(Exception):
    def __init__(self, host: str, exc: Exception) -> None:
        super().__init__(host)
        self.host, self.exc = host, exc


def _host(url: str) -> str:
    return urlsplit(url).netloc or url


def _send(client: httpx.Client, method: str, url: str, **kw) -> httpx.Response:
    try:
        return client.request(method, url, **kw)
    except httpx.TransportError as exc:  # refused, no route, DNS, TLS, timeouts: nothing usable came back
        raise _Unreachable(_host(url), exc) from None


def anonymous_token(client: httpx.Client, challenge_header: str, ref: ImageRef) -> str:
    """The bearer token a registry's challenge hands out to anyone for a pull; "" when it hands out none."""
    challenge = parse_www_authenticate(challenge_header)
    if challenge is None or challenge.scheme != "bearer":
        return ""
    realm, query = token_request(challenge, ref)
    r = _send(client, "GET", realm, params=query)
    if r.status_code != 200:
        return ""
    try:
        body = r.json()
    except ValueError:
        return ""
    token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else ""
    return token if isinstance(token, str) else ""


def check_image(client: httpx.Client, ref: ImageRef, registry_url: str = "") -> Outcome:
    """Ask `ref`'s registry (or `registry_url`, for every image) whether its manifest exists. Never raises for
    what the network or the registry does: each answer is an Outcome, and no token ever appears in one."""
    url = manifest_url(ref, registry_url)
    headers = {"Accept": ", ".join(MANIFEST_MEDIA_TYPES)}
    try:
        r = _send(client, "HEAD", url, headers=headers)
        if r.status_code == 401:
            try:
                token = anonymous_token(client, r.headers.get("WWW-Authenticate", ""), ref)
            except ImageRefError as exc:
                return Outcome("denied", f"{exc}; a pod pulls anonymously")
            if token:
                r = _send(client, "HEAD", url, headers={**headers, "Authorization": f"Bearer {token}"})
    except _Unreachable as exc:
        return Outcome("skipped", f"{exc.host} unreachable (offline?): {type(exc.exc).__name__}: {exc.exc}")
    host = _host(url)
    if r.status_code == 200:
        return Outcome("found", digest=r.headers.get("Docker-Content-Digest", ""))
    if r.status_code == 404:
        return Outcome("missing", f"{host} has no {ref.reference} of {ref.repository} (HTTP 404)")
    if r.status_code in (401, 403):
        return Outcome(
            "denied",
            f"{host} refuses an anonymous pull (HTTP {r.status_code}): missing, or private; a pod pulls anonymously",
        )
    return Outcome("error", f"{host} answered HTTP {r.status_code}")


@dataclass
class _Wanted:
    image: str
    sources: list[str]


def images_to_check(pod_image: str, models_file: str = "") -> tuple[list[_Wanted], list[str]]:
    """(each distinct image with what uses it, problems found without asking a registry): the broker's
    `pod_image`, and each model's `pod.image` from the models file. A model whose engine is vllm that would run
    the release's CUDA (llama.cpp) image is a problem: that image has no vLLM. Raises SettingsError for a bad
    models file."""
    wanted: dict[str, _Wanted] = {pod_image: _Wanted(pod_image, ["the broker's pod_image"])}
    problems: list[str] = []
    if models_file:
        from coderai.models_file import load_models

        for m in load_models(models_file):
            image = m.pod.image or pod_image
            if m.pod.image:
                wanted.setdefault(image, _Wanted(image, [])).sources.append(f"pod.image of {m.name}")
            if m.engine == "vllm" and m.pod.burst != "never" and _is_release(image, WORKER_CUDA):
                problems.append(
                    f"model {m.name} (engine vllm) would run {image}, which has no vLLM: "
                    f"set its pod.image to {release_image(WORKER_VLLM)}"
                )
    return list(wanted.values()), problems


def _is_release(image: str, name: str) -> bool:
    try:
        return parse_image_ref(image).repository.rsplit("/", 1)[-1] == name
    except ImageRefError:
        return False


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_endpoint(url: str, ca_pem: str, timeout: float) -> list[tuple[str, bool, str]]:
    """Whether a pod can reach the cluster's NATS at `url` (each server of a comma-separated list) the way a pod's
    worker connects: TLS first (nats-server's handshake_first), the server's certificate signed by `ca_pem` (the CA a
    pod is handed and pins), then the server's INFO. Nothing is rented and nothing logs in: a TCP connection and a
    TLS handshake, from this machine. (server, ok, what) per server; plain text is ok only on loopback (a test or
    one box), since a pod would send its login in clear."""
    import socket
    import ssl

    from coderai.runtime.tls import client_context

    out = []
    for server in [u.strip() for u in url.split(",") if u.strip()]:
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        host, port = parts.hostname or "", parts.port or 4222
        name = f"{host}:{port}"
        try:
            raw = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            out.append((name, False, f"unreachable from here: {type(exc).__name__}: {exc}"))
            continue
        with raw:
            raw.settimeout(timeout)
            try:
                with client_context(ca_pem).wrap_socket(raw, server_hostname=host or None) as tls:
                    info = tls.recv(4096)
            except ssl.SSLCertVerificationError as exc:
                out.append(
                    (name, False, f"TLS, but its certificate is not signed by this cluster's CA ({exc.verify_message})")
                )
                continue
            except (ssl.SSLError, OSError):
                info = b""
            if info.startswith(b"INFO "):
                out.append(
                    (
                        name,
                        True,
                        "TLS, certificate of this cluster's CA"
                        if ca_pem
                        else "TLS (its certificate not checked: give --ca, the CA pods pin)",
                    )
                )
                continue
        plain = _plain_info(host, port, timeout)
        if plain and host in LOOPBACK:
            out.append((name, True, "plain text on loopback (a pod elsewhere needs TLS: docs/pods.md)"))
        elif plain:
            out.append(
                (name, False, "plain text: a pod would send its login in clear (start NATS with TLS: docs/pods.md)")
            )
        else:
            out.append((name, False, "answers, but not as NATS"))
    return out


def _plain_info(host: str, port: int, timeout: float) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(4096).startswith(b"INFO ")
    except OSError:
        return False


def check(args: argparse.Namespace) -> int:
    """Run `coderai pods check`: one line per image, one per NATS server pods connect to (when set), the exit status
    of the module's docstring."""
    try:
        broker = load_settings(_BrokerImage, "pod-broker")
        pod_image = broker.pod_image
        wanted, problems = images_to_check(pod_image, args.models_file or "")
        refs = [(w, parse_image_ref(w.image)) for w in wanted]
    except (SettingsError, ImageRefError) as exc:
        print(f"coderai pods check: {exc}", file=sys.stderr)
        return 2
    failed = bool(problems)
    for p in problems:
        print(f"problem: {p}")
    with httpx.Client(
        timeout=args.timeout, follow_redirects=True, headers={"User-Agent": "coderai-pods-check"}
    ) as client:
        for w, ref in refs:
            out = check_image(client, ref, args.registry_url or "")
            failed |= not out.ok
            said = {
                "found": f"found {out.digest or '(the registry gave no digest)'}",
                "skipped": f"skipped: {out.detail}",
            }.get(out.status, f"{out.status}: {out.detail}")
            print(f"{w.image} ({', '.join(w.sources)}): {said}")
    endpoint = args.pod_nats_url or broker.pod_nats_url
    if endpoint:
        try:
            ca = ca_text(args.ca or os.environ.get("CODERAI_NATS_CA", ""))
        except OSError as exc:
            print(f"coderai pods check: cannot read the CA: {exc}", file=sys.stderr)
            return 2
        for server, ok, what in check_endpoint(endpoint, ca, args.timeout):
            failed |= not ok
            print(f"pods' NATS {server}: {what}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """`coderai pods <subcommand>`; today only `check`."""
    ap = argparse.ArgumentParser(prog="coderai pods", description="Rented GPU pods (docs/pods.md).")
    sub = ap.add_subparsers(dest="cmd", metavar="check")
    c = sub.add_parser(
        "check",
        help="does the image a pod would run exist in its registry?",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--models-file", help="also check each model's pod.image (the scheduler's models file)")
    c.add_argument(
        "--registry-url",
        help="ask this registry base URL (http://host:port) for every image, "
        "instead of each image's own registry (a mirror, or a test server)",
    )
    c.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    c.add_argument(
        "--pod-nats-url",
        default="",
        help="where pods reach this cluster's NATS (default: the broker's "
        "pod_nats_url): checked to answer TLS with a certificate of --ca",
    )
    c.add_argument(
        "--ca", default="", help="the cluster's CA, PEM or a file (default CODERAI_NATS_CA): the one pods pin"
    )
    args = ap.parse_args(argv)
    if args.cmd != "check":
        ap.print_help(sys.stderr)
        return 2
    return check(args)


if __name__ == "__main__":
    raise SystemExit(main())
