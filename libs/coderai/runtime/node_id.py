"""A machine's node id, made once and kept: the worker's, and what `coderai up` gives its own worker a user for."""

from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path


def stable_node_id(data_dir: str | os.PathLike, given: str = "") -> str:
    """The configured id, else one made once from the host name and kept in `<data_dir>/node_id`.

    Stable across restarts so that a rebooted node finds its assignment under the same key.
    """
    if given:
        return given
    path = Path(os.path.expanduser(data_dir)) / "node_id"
    if path.exists():
        return path.read_text().strip()
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0])[:32].strip("-") or "node"
    node_id = f"{host}-{secrets.token_hex(3)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(node_id + "\n")
    return node_id
