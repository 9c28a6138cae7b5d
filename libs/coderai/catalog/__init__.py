"""The model catalogue: pull a model by name from the Hugging Face Hub into `<data>/models`, list and remove what
was pulled, and tell which nodes it fits on. See docs/catalog.md."""

from coderai.catalog.entries import BUILTIN, Entry, resolve
from coderai.catalog.errors import (
    Cancelled,
    CatalogError,
    ChecksumError,
    MissingExtra,
    NotFound,
    Unreachable,
)
from coderai.catalog.pull import Progress, pull
from coderai.catalog.store import ModelStore, Pulled, estimate_bytes, fits

__all__ = [
    "BUILTIN",
    "Cancelled",
    "CatalogError",
    "ChecksumError",
    "Entry",
    "MissingExtra",
    "ModelStore",
    "NotFound",
    "Progress",
    "Pulled",
    "Unreachable",
    "estimate_bytes",
    "fits",
    "pull",
    "resolve",
]
