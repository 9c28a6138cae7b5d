"""Files a head or node writes are its user's only: a data dir holds API key hashes, usage, budgets, prompts in
logs, models and fine-tuning data, and a local user who is not its owner must read none of it."""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_UMASK = 0o077  # every file this process and its children create: 0600, every folder 0700


def private_process() -> None:
    """From now on this process and every child it starts (nats-server, redis-server, engine servers) create
    files for their user only."""
    os.umask(PRIVATE_UMASK)


def private_tree(root: Path) -> int:
    """`root` made (0700) if missing, and what an older version left readable by others in it taken back to its
    user (group and other bits cleared; links left alone). Returns how many paths were changed."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    changed = 0
    for folder, dirs, files in os.walk(root):
        for path in [folder] + [os.path.join(folder, n) for n in dirs + files]:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if os.path.islink(path) or not st.st_mode & 0o077:
                continue
            try:
                os.chmod(path, st.st_mode & 0o7700)
                changed += 1
            except OSError:
                pass  # not ours to change (a mount, a file of another user): left as it is
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
    return changed
