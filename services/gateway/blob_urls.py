"""Signed, expiring URLs for `GET /v1/blobs/{name}`: what an image's `url` is, served without a key.

A URL is only good if this cluster's gateways made it: it carries its expiry (unix seconds) and an HMAC of the
blob's name and that expiry under a key kept in the data dir's secrets (`secrets/blob-url.key`, random, made on
first use, 0600, shared by every gateway process of the head and copied to every head by `coderai heads invite`).
So a blob's bare name (which a node learns when it writes one through the blob service) is worth nothing on the
gateway's address, and a URL stops working when it expires, however long the blob is kept.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from urllib.parse import quote

from coderai.contracts.topology import BLOBS

KEY_FILE = "blob-url.key"
TTL_S = int(BLOBS.ttl_s)
"""How long a URL is good for: as long as the blob store keeps what it names."""


class BlobSigner:
    """Makes and checks the `expires` and `signature` of blob URLs under one key."""

    def __init__(self, secret: str) -> None:
        self._key = hmac.new(hashlib.sha256(secret.encode()).digest(), b"coderai blob url", hashlib.sha256).digest()

    def signature(self, name: str, expires: int) -> str:
        mac = hmac.new(self._key, f"{name}\n{expires}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac[:18]).decode()  # 144 bits, 24 URL-safe characters

    def path(self, name: str, now: float | None = None, ttl_s: int = TTL_S) -> str:
        """`/v1/blobs/<name>?expires=..&signature=..`, good for `ttl_s` from `now`."""
        expires = int(now if now is not None else time.time()) + ttl_s
        return f"/v1/blobs/{quote(name, safe='')}?expires={expires}&signature={self.signature(name, expires)}"

    def valid(self, name: str, expires: str | None, signature: str | None, now: float | None = None) -> bool:
        """Whether a request's `expires` and `signature` are this key's for `name`, and not expired."""
        if not expires or not signature or not (expires.isascii() and expires.isdigit()) or len(expires) > 12:
            return False
        if int(expires) < (now if now is not None else time.time()):
            return False
        return hmac.compare_digest(signature.encode(), self.signature(name, int(expires)).encode())


_signer = BlobSigner(base64.b64encode(os.urandom(32)).decode())  # a process's own until the gateway names its data dir


def configure(data_dir: str | os.PathLike) -> None:
    """Use the data dir's key (made on first use): every gateway of the cluster then serves what another signed."""
    from coderai.runtime import members

    global _signer
    _signer = BlobSigner(members.data_secret(data_dir, KEY_FILE))


def signer() -> BlobSigner:
    return _signer
