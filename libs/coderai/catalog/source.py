"""Where a model's weights come from when a node lacks its `path` (a rented pod always does): a model's `source`.

    source = "hf://bartowski/Qwen2.5-7B-Instruct-GGUF/Qwen2.5-7B-Instruct-Q4_K_M.gguf@main"
    source = "hf://Qwen/Qwen2.5-7B-Instruct-AWQ"          # the whole repo (the catalogue's file selection)
    source = "qwen2.5-7b-instruct"                          # a catalogue id (`coderai models catalog`)
    source = "store://bartowski/Qwen2.5-7B-Instruct-GGUF/Qwen2.5-7B-Instruct-Q4_K_M.gguf"   # the head's model store

`hf://` and catalogue ids are fetched by the catalogue's own pull (the same download, resume and hash check as
`coderai models pull`); `store://` names a path in the head's model store, fetched over the bus as `store_path`
is. A revision follows the first `@` (a branch, tag or commit: pin a commit for weights that never change under
you), so a file name cannot hold one. Parsing is pure: whether the repo or file exists is `coderai models check`'s
question.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import msgspec

from coderai.catalog.entries import BUILTIN, Entry
from coderai.catalog.errors import CatalogError
from coderai.contracts import check_store_path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # one part of a Hub repo id


class SourceError(CatalogError):
    """A model's `source` does not parse; the message says what is wrong and what would be right."""


@dataclass(frozen=True)
class Source:
    """A parsed `source`: `kind` hf (`repo`, `file` or "" for the whole repo, `revision`), catalog (`entry`), or
    store (`path` in the head's model store, a folder when it ends in "/")."""

    kind: Literal["hf", "catalog", "store"]
    text: str
    repo: str = ""
    file: str = ""
    revision: str = "main"
    path: str = ""

    def entry(self, name: str, engine: str) -> Entry:
        """What the catalogue's pull fetches for model `name` served by `engine` (hf and catalog sources)."""
        if self.kind == "catalog":
            return msgspec.structs.replace(BUILTIN[self.text], name=name)
        if self.kind != "hf":
            raise SourceError(f"{self.text!r} is not fetched from the Hub")
        return Entry(
            name=name,
            repo=self.repo,
            engine=engine,
            kind="",
            files=[self.file] if self.file else [],
            main=self.file,
            revision=self.revision,
        )


def parse_source(text: str) -> Source:
    """`text` as a Source; SourceError saying why not."""
    text = text.strip()
    if not text:
        raise SourceError("source is empty")
    scheme, sep, rest = text.partition("://")
    if not sep:
        if text in BUILTIN:
            return Source("catalog", text)
        hint = f"; a Hub repo is written hf://{text}" if text.count("/") >= 1 else ""
        raise SourceError(
            f"{text!r} is not hf://<org>/<repo>[/<file>][@<revision>], store://<path>, nor a catalogue "
            f"id (known: {', '.join(sorted(BUILTIN))}){hint}"
        )
    if scheme == "store":
        try:
            check_store_path(rest.removesuffix("/"))
        except ValueError as exc:
            raise SourceError(f"{text!r}: {exc}") from None
        return Source("store", text, path=rest)
    if scheme != "hf":
        raise SourceError(f"{text!r}: unknown scheme {scheme + '://'!r} (hf:// or store://)")
    body, at, revision = rest.partition("@")
    if at and not revision.strip("/"):
        raise SourceError(f"{text!r}: no revision after '@'")
    parts = body.strip("/").split("/")
    if len(parts) < 2 or not all(_NAME.match(p) for p in parts[:2]) or ".." in parts[1]:
        raise SourceError(f"{text!r}: a Hub repo is hf://<org>/<repo>, each part letters, digits, '.', '_' or '-'")
    file = "/".join(parts[2:])
    if any(p in ("", ".", "..") for p in parts[2:]):
        raise SourceError(f"{text!r}: the file {file!r} must be a plain path inside the repo")
    return Source("hf", text, repo="/".join(parts[:2]), file=file, revision=revision or "main")
