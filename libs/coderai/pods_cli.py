"""`coderai pods check`: does the image a rented pod would run exist in its registry?

RunPod pulls the pod image anonymously when the broker creates a pod; an image that is not there (a typo, a
version never released, a private package) costs a boot timeout of billed GPU time before the broker gives up.
This asks each registry first, with the OCI distribution API: `HEAD /v2/<name>/manifests/<tag>`, and on a 401
the anonymous bearer token its `WWW-Authenticate` challenge names (how ghcr.io and Docker Hub serve public
images). The images are the broker's `pod_image`, read as the broker reads it (`CODERAI_POD_BROKER_POD_IMAGE`,
`CODERAI_POD_IMAGE`, the `[pod_broker]` table of `CODERAI_CONFIG`, else the release image of this version), and
with `--models-file` every model's own `pod.image`.

Exit status: 0 when every image was found, or could not be asked because its registry is unreachable (each
such line says `skipped`); 1 when one is missing, denied to an anonymous pull, or the registry answered an
error; 2 on bad settings, a bad reference or a bad models file.
"""

from __future__ import annotations

import argparse
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


class _BrokerImage(msgspec.Struct, frozen=True, kw_only=True):
    """The one field of the pod-broker's settings this command needs. load_settings reads a struct's own fields
    only, so this reads `pod_image` from the same variables and TOML keys as the broker's BrokerSettings
    (which a library may not import: services import libs, never the other way round)."""

    pod_image: str = DEFAULT_POD_IMAGE


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


def _anonymous_token(client: httpx.Client, challenge_header: str, ref: ImageRef) -> str:
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
                token = _anonymous_token(client, r.headers.get("WWW-Authenticate", ""), ref)
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
        return Outcome("denied", f"{host} refuses an anonymous pull (HTTP {r.status_code}): missing, or private; "
                       "a pod pulls anonymously")
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
                problems.append(f"model {m.name} (engine vllm) would run {image}, which has no vLLM: "
                                f"set its pod.image to {release_image(WORKER_VLLM)}")
    return list(wanted.values()), problems


def _is_release(image: str, name: str) -> bool:
    try:
        return parse_image_ref(image).repository.rsplit("/", 1)[-1] == name
    except ImageRefError:
        return False


def check(args: argparse.Namespace) -> int:
    """Run `coderai pods check`: one line per image, the exit status of the module's docstring."""
    try:
        pod_image = load_settings(_BrokerImage, "pod-broker").pod_image
        wanted, problems = images_to_check(pod_image, args.models_file or "")
        refs = [(w, parse_image_ref(w.image)) for w in wanted]
    except (SettingsError, ImageRefError) as exc:
        print(f"coderai pods check: {exc}", file=sys.stderr)
        return 2
    failed = bool(problems)
    for p in problems:
        print(f"problem: {p}")
    with httpx.Client(timeout=args.timeout, follow_redirects=True,
                      headers={"User-Agent": "coderai-pods-check"}) as client:
        for w, ref in refs:
            out = check_image(client, ref, args.registry_url or "")
            failed |= not out.ok
            said = {"found": f"found {out.digest or '(the registry gave no digest)'}",
                    "skipped": f"skipped: {out.detail}"}.get(out.status, f"{out.status}: {out.detail}")
            print(f"{w.image} ({', '.join(w.sources)}): {said}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """`coderai pods <subcommand>`; today only `check`."""
    ap = argparse.ArgumentParser(prog="coderai pods", description="Rented GPU pods (docs/pods.md).")
    sub = ap.add_subparsers(dest="cmd", metavar="check")
    c = sub.add_parser("check", help="does the image a pod would run exist in its registry?", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--models-file", help="also check each model's pod.image (the scheduler's models file)")
    c.add_argument("--registry-url", help="ask this registry base URL (http://host:port) for every image, "
                                          "instead of each image's own registry (a mirror, or a test server)")
    c.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    args = ap.parse_args(argv)
    if args.cmd != "check":
        ap.print_help(sys.stderr)
        return 2
    return check(args)


if __name__ == "__main__":
    raise SystemExit(main())
