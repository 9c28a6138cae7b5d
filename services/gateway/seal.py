"""Reasoning handed to a client and accepted back: Anthropic thinking blocks' `signature` and the Responses API's
`reasoning.encrypted_content`.

A client that keeps no state on the server (Claude Code; Codex with `store: false`) sends a turn's reasoning back
with the next turn. What it sends back is only taken if this cluster made it: a signature is an HMAC of the
thinking text, and encrypted content is the reasoning sealed with AES-GCM, each under a key kept in the data dir's
secrets (`secrets/reasoning-seal.key`, made on first use, 0600, copied to every head by `coderai heads invite`).
Each kind of token is bound to its use, so one is never accepted as the other. A token that does not verify (made
elsewhere, altered, or by a cluster with another key) is dropped with the reasoning it carries: the turn goes on
without it, as it would with a model that takes no reasoning back."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_FILE = "reasoning-seal.key"
_VERSION = b"\x01"


class Sealer:
    """Signs and seals reasoning under one cluster key."""

    def __init__(self, secret: str) -> None:
        root = hashlib.sha256(secret.encode()).digest()
        self._mac = hmac.new(root, b"coderai thinking signature", hashlib.sha256).digest()
        self._aead = AESGCM(hmac.new(root, b"coderai reasoning seal", hashlib.sha256).digest())
        self._handles = hmac.new(root, b"coderai engine handle", hashlib.sha256).digest()

    def handle(self, engine_id: str) -> str:
        """What a tenant is shown for an engine (`Coderai-Engine`): the same on every gateway of the cluster and
        for every request to that engine (a client can still tell its turns went to one cache), but neither the
        node's id nor its host name."""
        return "e-" + hmac.new(self._handles, engine_id.encode(), hashlib.sha256).hexdigest()[:16]

    def sign(self, thinking: str) -> str:
        return base64.b64encode(_VERSION + hmac.new(self._mac, thinking.encode(), hashlib.sha256).digest()).decode()

    def verified(self, thinking: str, signature: object) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(signature, self.sign(thinking))

    def seal(self, reasoning: str) -> str:
        nonce = os.urandom(12)
        return base64.b64encode(_VERSION + nonce + self._aead.encrypt(nonce, reasoning.encode(), b"reasoning")).decode()

    def open(self, sealed: object) -> str | None:
        """The reasoning `sealed` holds, or None when this key did not seal it."""
        if not isinstance(sealed, str) or len(sealed) > 4 * 2**20:
            return None
        try:
            raw = base64.b64decode(sealed, validate=True)
            if raw[:1] != _VERSION or len(raw) < 29:
                return None
            return self._aead.decrypt(raw[1:13], raw[13:], b"reasoning").decode()
        except (binascii.Error, ValueError, InvalidTag, UnicodeDecodeError):
            return None


_sealer = Sealer(base64.b64encode(os.urandom(32)).decode())  # a process's own until the gateway names its data dir


def configure(data_dir: str | os.PathLike) -> None:
    """Use the data dir's key (made on first use): every gateway of the cluster then accepts what another made."""
    from coderai.runtime import members

    global _sealer
    _sealer = Sealer(members.data_secret(data_dir, KEY_FILE))


def sealer() -> Sealer:
    return _sealer
