"""Container image references: the worker images a release publishes, and the pure parts of asking an OCI
registry about one (parsing a reference, a registry's `WWW-Authenticate` challenge). No I/O here; the HTTP
side is `coderai pods check` (pods_cli.py).

The release workflow (`.github/workflows/release.yml`, run on a `v*` tag) pushes, for version V,
`ghcr.io/<repository owner>/coderai-worker-cuda:V` (llama.cpp built for CUDA, `docker/Dockerfile.llama-cuda`)
and `ghcr.io/<repository owner>/coderai-worker-vllm:V` (`docker/Dockerfile.vllm`), each signed with cosign
keyless. `RELEASE_OWNER` is the upstream repository's owner, so `DEFAULT_POD_IMAGE` names what the upstream
release pushed for the running version; a fork that releases its own images sets the broker's `pod_image`
(`CODERAI_POD_BROKER_POD_IMAGE`) instead of editing this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from coderai import __version__

RELEASE_REGISTRY = "ghcr.io"
RELEASE_OWNER = "coderai"  # GitHub's repository_owner of the upstream repository, lower-cased as ghcr.io wants
WORKER_CUDA = "coderai-worker-cuda"  # docker/Dockerfile.llama-cuda: llama.cpp with CUDA; the default pod image
WORKER_VLLM = "coderai-worker-vllm"  # docker/Dockerfile.vllm: a model with engine = "vllm" needs this one

# What a manifest HEAD accepts: a multi-arch index or a single manifest, OCI or Docker's. Without the index
# types a registry may answer 404 for an image pushed as an index (buildx pushes one with attestations).
MANIFEST_MEDIA_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"  # where Docker Hub's registry API answers
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"}

_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_DOMAIN = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]+)?"
)
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}")


def release_image(name: str = WORKER_CUDA, version: str = __version__) -> str:
    """The reference the release workflow pushes for `name` at `version` (a `+local` part becomes `-`: tags
    allow no `+`)."""
    return f"{RELEASE_REGISTRY}/{RELEASE_OWNER}/{name}:{version.replace('+', '-')}"


DEFAULT_POD_IMAGE = release_image(WORKER_CUDA)


class ImageRefError(ValueError):
    """Not a valid image reference; the message says which part is wrong."""


@dataclass(frozen=True)
class ImageRef:
    """A parsed `[registry/]repository[:tag][@digest]`.

    `registry` is the host (and port) as written, `docker.io` when none was; `repository` is the full path
    (`library/python` for Docker Hub's short names); `tag` is `latest` when neither a tag nor a digest was
    given; with a digest, the digest is what identifies the image."""

    registry: str
    repository: str
    tag: str = ""
    digest: str = ""

    @property
    def reference(self) -> str:
        """What goes after `/manifests/`: the digest when there is one, else the tag."""
        return self.digest or self.tag

    @property
    def api_host(self) -> str:
        """The host that answers the registry API (Docker Hub's is not `docker.io`)."""
        return DOCKER_HUB_API if self.registry in _HUB_ALIASES else self.registry

    def __str__(self) -> str:
        return (
            f"{self.registry}/{self.repository}"
            + (f":{self.tag}" if self.tag else "")
            + (f"@{self.digest}" if self.digest else "")
        )


def parse_image_ref(text: str) -> ImageRef:
    """Parse an image reference as docker does: the first path part is a registry only when it has a `.` or a
    `:` or is `localhost`; otherwise the image is on Docker Hub, and a one-part name is under `library/`."""
    ref = text.strip()
    if not ref:
        raise ImageRefError("empty image reference")
    name, _, digest = ref.partition("@")
    if digest and not _DIGEST.fullmatch(digest):
        raise ImageRefError(f"{text!r}: bad digest {digest!r} (want algorithm:hex, e.g. sha256:...)")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:  # a ':' in the last part is a tag; before a '/' it is a registry's port
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG.fullmatch(tag):
            raise ImageRefError(f"{text!r}: bad tag {tag!r}")
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first != first.lower()):
        registry, path = first, rest
        if not _DOMAIN.fullmatch(registry):
            raise ImageRefError(f"{text!r}: bad registry {registry!r}")
    else:
        registry, path = DOCKER_HUB, name
    if registry in _HUB_ALIASES:
        registry = DOCKER_HUB
        if "/" not in path:
            path = f"library/{path}"
    parts = path.split("/")
    bad = [p for p in parts if not _COMPONENT.fullmatch(p)]
    if bad:
        raise ImageRefError(f"{text!r}: bad repository name part {bad[0]!r} (lower-case letters, digits, . _ -)")
    if not digest and not tag:
        tag = "latest"
    return ImageRef(registry=registry, repository=path, tag=tag, digest=digest)


@dataclass(frozen=True)
class Challenge:
    """An HTTP authentication challenge: `scheme` lower-cased, parameter names lower-cased."""

    scheme: str
    params: dict[str, str] = field(default_factory=dict)


_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]*)")
_PARAM = re.compile(r'\s*([A-Za-z0-9!#$%&\'*+.^_`|~-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,"]*)\s*(?:,|$)')


def parse_www_authenticate(header: str) -> Challenge | None:
    """The first challenge of a `WWW-Authenticate` header (`Bearer realm="...",service="...",scope="..."`), or
    None when the header has none. Quoted values may hold commas (`scope="repository:a/b:pull,push"`) and
    backslash escapes."""
    m = _SCHEME.match(header)
    if not m:
        return None
    scheme, pos, params = m.group(1).lower(), m.end(), {}
    while pos < len(header):
        p = _PARAM.match(header, pos)
        if not p:  # the next challenge's scheme, or something unparsable: this challenge ends here
            break
        value = p.group(2)
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        params[p.group(1).lower()] = value
        pos = p.end()
    return Challenge(scheme=scheme, params=params)


def token_request(challenge: Challenge, ref: ImageRef) -> tuple[str, dict[str, str]]:
    """(URL, query parameters) of the anonymous token request a Bearer challenge asks for: its realm, with its
    service and scope (a pull of `ref`'s repository when it names none). Raises ImageRefError on a challenge
    that is not Bearer or has no http(s) realm."""
    realm = challenge.params.get("realm", "")
    if challenge.scheme != "bearer" or urlsplit(realm).scheme not in ("http", "https"):
        raise ImageRefError(
            f"the registry asks for {challenge.scheme} authentication at {realm!r}, not an anonymous bearer token"
        )
    query = {"scope": challenge.params.get("scope") or f"repository:{ref.repository}:pull"}
    if challenge.params.get("service"):
        query["service"] = challenge.params["service"]
    return realm, query


def manifest_url(ref: ImageRef, base_url: str = "") -> str:
    """`<base>/v2/<repository>/manifests/<tag or digest>`; the base is `https://<api host>` unless given."""
    base = (base_url or f"https://{ref.api_host}").rstrip("/")
    return f"{base}/v2/{ref.repository}/manifests/{ref.reference}"
