"""The cluster token and the join handshake it allows. Pure; no I/O.

The token is for joining only. A worker proves it knows the token by answering the head's challenge, and the
head proves it too, each over a fresh nonce of the other's (so neither answer can be replayed); the worker then
logs in to NATS with a password of its own that only it knows (the head keeps its bcrypt hash). Nothing the
token gives lets anyone compute a service credential: those are random (runtime/members.py).

mDNS carries only a fingerprint, which says which cluster a head belongs to and proves nothing: a worker
trusts a head only after the head has answered its challenge.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import string
from urllib.parse import quote, unquote, urlsplit, urlunsplit

MEMBERSHIP_CONTEXT = b"coderai-cluster-membership-v1"
JOIN_USER = "join"
MIN_TOKEN_BITS = 128


class WeakToken(ValueError):
    """A cluster token with too little entropy to keep strangers out."""


def new_token() -> str:
    """A fresh cluster token: 256 random bits (what `coderai token new` prints), never starting with `-` (a
    command line would read it as an option)."""
    while True:
        token = secrets.token_urlsafe(32)
        if not token.startswith("-"):
            return token


def token_bits(token: str) -> float:
    """An upper bound of the token's entropy: its length times log2 of the alphabet its characters come from
    (hex digits, or the union of digits, lower case, upper case, `-_` and other symbols that it uses)."""
    if not token:
        return 0.0
    if set(token) <= set(string.hexdigits.lower()) or set(token) <= set(string.digits + "ABCDEF"):
        return len(token) * 4.0
    classes = [
        string.digits,
        string.ascii_lowercase,
        string.ascii_uppercase,
        "-_",
        "".join(c for c in string.punctuation + " " if c not in "-_"),
    ]
    alphabet = sum(len(c) for c in classes if any(ch in c for ch in token))
    alphabet += len({ch for ch in token if not any(ch in c for c in classes)})  # anything else (unicode)
    return len(token) * math.log2(max(alphabet, 2))


def check_token(token: str) -> str:
    """The token, or WeakToken saying how to make a good one."""
    if token_bits(token) < MIN_TOKEN_BITS:
        raise WeakToken(
            f"the cluster token is too weak (about {token_bits(token):.0f} bits; at least {MIN_TOKEN_BITS} "
            "are needed): make one with `coderai token new` and give the same token to every machine"
        )
    return token


def fingerprint(token: str) -> str:
    """What mDNS announces: 24 hex digits of HMAC-SHA256(token, membership context). It names the cluster; it
    authenticates nothing (anyone who heard it can replay it)."""
    return hmac.new(token.encode(), MEMBERSHIP_CONTEXT, hashlib.sha256).hexdigest()[:24]


def join_password(token: str) -> str:
    """The password of NATS user `join`, which may only ask to join (runtime/members.py gives it two subjects)."""
    return hmac.new(token.encode(), b"coderai-nats-join-v2", hashlib.sha256).hexdigest()


def nonce() -> str:
    return secrets.token_hex(16)


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\x00".join(parts).encode(), hashlib.sha256).hexdigest()


def head_proof(token: str, node_id: str, worker_nonce: str, head_nonce: str) -> str:
    """The head's answer to a joining worker's nonce."""
    return _mac(token, "head", node_id, worker_nonce, head_nonce)


def node_proof(token: str, node_id: str, worker_nonce: str, head_nonce: str, password_hash: str) -> str:
    """The worker's answer to the head's nonce, binding the password hash it asks to be let in with."""
    return _mac(token, "node", node_id, worker_nonce, head_nonce, password_hash)


def member_proof(current_hash: str, node_id: str, worker_nonce: str, head_nonce: str, password_hash: str) -> str:
    """A rejoining member's proof that it holds its current credential: keyed with the bcrypt hash the head keeps
    for it (the worker remakes it from its password and the hash's salt), binding this challenge and the new
    password hash, so it can be neither replayed nor moved to another hash."""
    return _mac(current_hash, "member", node_id, worker_nonce, head_nonce, password_hash)


def welcome_proof(token: str, node_id: str, head_nonce: str, user: str, tls_fingerprint: str) -> str:
    """The head's seal on what it tells the worker at the end (its user and the certificate to pin)."""
    return _mac(token, "welcome", node_id, head_nonce, user, tls_fingerprint)


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def with_user(url: str, user: str, password: str) -> str:
    """`nats://host:port` with this user and password in it."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme or "nats", netloc, parts.path, parts.query, parts.fragment))


def user_of(url: str) -> tuple[str, str]:
    """(user, password) in a URL, ("", "") when it has none."""
    parts = urlsplit(url)
    return unquote(parts.username or ""), unquote(parts.password or "")


def without_user(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return urlunsplit(
        (parts.scheme, host + (f":{parts.port}" if parts.port else ""), parts.path, parts.query, parts.fragment)
    )
