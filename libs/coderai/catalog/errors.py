"""The catalogue's errors: one root, narrow subclasses."""

from __future__ import annotations


class CatalogError(Exception):
    """A pull, lookup or store operation failed; the message is meant for the operator."""


class NotFound(CatalogError):
    """The repo, revision, file or stored model does not exist."""


class Unreachable(CatalogError):
    """The Hub (or its mirror) could not be reached at all: offline, refused, no route, DNS."""


class ChecksumError(CatalogError):
    """A downloaded file's hash is not the one the Hub announced; the file was deleted."""

    def __init__(self, file: str, want: str, got: str) -> None:
        super().__init__(
            f"{file}: checksum mismatch (the Hub says {want}, the download hashes to {got}); "
            "the file was deleted, pull again"
        )
        self.file, self.want, self.got = file, want, got


class Cancelled(CatalogError):
    """The pull was stopped on request; what was downloaded is kept for a resume."""


class MissingExtra(CatalogError):
    """huggingface_hub is not installed."""
