"""File digests, shared by the catalogue (verifying pulls), the head's store and the workers fetching from it."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file's bytes, read in blocks."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def git_blob_sha1(path: str | os.PathLike[str]) -> str:
    """The git blob id of a file (sha1 over `blob <size>\\0` and the bytes): the Hub's etag for non-LFS files."""
    header = b"blob %d\0" % os.path.getsize(path)
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, lambda: hashlib.sha1(header)).hexdigest()
