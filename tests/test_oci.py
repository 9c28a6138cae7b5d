"""coderai.oci: image references parsed as docker parses them, registry challenges, the release's image names."""

from __future__ import annotations

import re

import pytest

from coderai import __version__
from coderai.oci import (
    DEFAULT_POD_IMAGE,
    MANIFEST_MEDIA_TYPES,
    Challenge,
    ImageRef,
    ImageRefError,
    manifest_url,
    parse_image_ref,
    parse_www_authenticate,
    release_image,
    token_request,
)

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("ghcr.io/coderai/coderai-worker-cuda:0.1.0", "ghcr.io", "coderai/coderai-worker-cuda", "0.1.0", ""),
        ("python", "docker.io", "library/python", "latest", ""),
        ("python:3.11-slim-bookworm", "docker.io", "library/python", "3.11-slim-bookworm", ""),
        ("nvidia/cuda:12.8.1-devel-ubuntu24.04", "docker.io", "nvidia/cuda", "12.8.1-devel-ubuntu24.04", ""),
        ("docker.io/library/redis:7.4-alpine", "docker.io", "library/redis", "7.4-alpine", ""),
        ("index.docker.io/redis", "docker.io", "library/redis", "latest", ""),
        ("registry-1.docker.io/library/ubuntu:24.04", "docker.io", "library/ubuntu", "24.04", ""),
        ("localhost:5000/x", "localhost:5000", "x", "latest", ""),
        ("localhost/x:1", "localhost", "x", "1", ""),
        (f"127.0.0.1:5000/a/b/c@{D}", "127.0.0.1:5000", "a/b/c", "", D),
        (f"ghcr.io/a/b:1.2@{D}", "ghcr.io", "a/b", "1.2", D),
        ("[::1]:5000/x:y", "[::1]:5000", "x", "y", ""),
        ("quay.io/org/name_with__parts.and-dashes:v1_2", "quay.io", "org/name_with__parts.and-dashes", "v1_2", ""),
    ],
)
def test_references_parse_as_docker_reads_them(text, registry, repository, tag, digest):
    ref = parse_image_ref(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest)
    assert ref.reference == (digest or tag), "a digest, when given, is what identifies the image"
    assert parse_image_ref(str(ref)) == ref, "str() is a reference that parses back to the same thing"


def test_docker_hub_is_asked_at_its_api_host():
    assert parse_image_ref("python").api_host == "registry-1.docker.io"
    assert parse_image_ref("docker.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04").api_host == "registry-1.docker.io"
    assert parse_image_ref("ghcr.io/a/b").api_host == "ghcr.io"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("ghcr.io/Coderai/x", "repository name part 'Coderai'"),
        ("ghcr.io/a//b", "repository name part ''"),
        ("x:", "bad tag ''"),
        ("x:bad!tag", "bad tag"),
        ("x@sha256:zz", "bad digest"),
        ("x@md5", "bad digest"),
        ("bad_host.io:port/x", "bad registry"),
    ],
)
def test_bad_references_say_which_part(text, says):
    with pytest.raises(ImageRefError, match=re.escape(says)):
        parse_image_ref(text)


def test_release_image_is_the_cuda_worker_of_this_version():
    assert DEFAULT_POD_IMAGE == f"ghcr.io/coderai/coderai-worker-cuda:{__version__}" == release_image()
    assert release_image("coderai-worker-vllm", "1.2.3") == "ghcr.io/coderai/coderai-worker-vllm:1.2.3"
    assert release_image(version="1.0+local.1").endswith(":1.0-local.1"), "a tag allows no +"
    assert parse_image_ref(release_image(version="1.0+local.1")).tag == "1.0-local.1"


@pytest.mark.parametrize(
    ("header", "scheme", "params"),
    [
        (
            'Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:coderai/x:pull"',
            "bearer",
            {"realm": "https://ghcr.io/token", "service": "ghcr.io", "scope": "repository:coderai/x:pull"},
        ),
        (
            'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/python:pull"',
            "bearer",
            {
                "realm": "https://auth.docker.io/token",
                "service": "registry.docker.io",
                "scope": "repository:library/python:pull",
            },
        ),
        (
            'bearer Realm="r", Scope="repository:a/b:pull,push"',
            "bearer",
            {"realm": "r", "scope": "repository:a/b:pull,push"},
        ),
        (r'Bearer realm="a\"b",error="insufficient_scope"', "bearer", {"realm": 'a"b', "error": "insufficient_scope"}),
        ("Bearer realm=https://x/token,service=x", "bearer", {"realm": "https://x/token", "service": "x"}),
        ('Bearer realm="a", Basic realm="b"', "bearer", {"realm": "a"}),
        ("Basic", "basic", {}),
    ],
)
def test_www_authenticate(header, scheme, params):
    assert parse_www_authenticate(header) == Challenge(scheme, params)


def test_no_challenge_in_an_empty_header():
    assert parse_www_authenticate("") is None
    assert parse_www_authenticate("  ,") is None


def test_token_request_follows_the_challenge():
    ref = parse_image_ref("ghcr.io/coderai/coderai-worker-cuda:0.1.0")
    c = parse_www_authenticate('Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:x/y:pull"')
    assert token_request(c, ref) == ("https://ghcr.io/token", {"scope": "repository:x/y:pull", "service": "ghcr.io"})
    bare = parse_www_authenticate('Bearer realm="http://127.0.0.1:1/token"')
    assert token_request(bare, ref) == (
        "http://127.0.0.1:1/token",
        {"scope": "repository:coderai/coderai-worker-cuda:pull"},
    )
    for header in ('Basic realm="registry"', 'Bearer realm="file:///etc/passwd"', "Bearer service=x"):
        with pytest.raises(ImageRefError, match="not an anonymous bearer token"):
            token_request(parse_www_authenticate(header), ref)


def test_manifest_url():
    assert (
        manifest_url(parse_image_ref("python:3.11")) == "https://registry-1.docker.io/v2/library/python/manifests/3.11"
    )
    ref = ImageRef("ghcr.io", "a/b", "1", D)
    assert manifest_url(ref, "http://127.0.0.1:9/") == f"http://127.0.0.1:9/v2/a/b/manifests/{D}"


def test_accepts_indexes_and_manifests_of_both_kinds():
    assert set(MANIFEST_MEDIA_TYPES) == {
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    }
