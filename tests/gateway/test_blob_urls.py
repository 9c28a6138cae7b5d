"""Signed blob URLs (`gateway/blob_urls.py`): what verifies, what does not, and the key shared through the data dir."""

from __future__ import annotations

import stat

from coderai.gateway import blob_urls
from coderai.gateway.blob_urls import BlobSigner


def _parts(path: str) -> tuple[str, str, str]:
    name, query = path.removeprefix("/v1/blobs/").split("?")
    q = dict(kv.split("=", 1) for kv in query.split("&"))
    return name, q["expires"], q["signature"]


def test_a_signed_url_verifies_for_its_name_until_it_expires():
    s = BlobSigner("k1")
    name, expires, sig = _parts(s.path("abc.png", now=1000, ttl_s=60))
    assert (name, expires) == ("abc.png", "1060")
    assert s.valid(name, expires, sig, now=1000) and s.valid(name, expires, sig, now=1060)
    assert not s.valid(name, expires, sig, now=1061)  # expired
    assert not s.valid("abd.png", expires, sig, now=1000)  # another blob
    assert not s.valid(name, "1061", sig, now=1000)  # a later expiry
    assert not BlobSigner("k2").valid(name, expires, sig, now=1000)  # another cluster's key
    for bad in (
        (None, sig),
        (expires, None),
        ("", sig),
        ("-5", sig),
        ("1e9", sig),
        ("9" * 40, sig),
        ("\u00b2", sig),
        (expires, "x"),
        (expires, sig + "\u00e9"),
    ):
        assert not s.valid(name, *bad, now=1000), bad


def test_every_gateway_of_a_data_dir_signs_with_one_key_made_once_0600(tmp_path):
    blob_urls.configure(tmp_path)
    path = blob_urls.signer().path("n.png", now=5)
    key = tmp_path / "secrets" / blob_urls.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    blob_urls.configure(tmp_path)  # another gateway process of the same head
    assert blob_urls.signer().path("n.png", now=5) == path
    blob_urls.configure(tmp_path / "other")  # another cluster
    assert blob_urls.signer().path("n.png", now=5) != path
