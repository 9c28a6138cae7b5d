"""Leadership of a singleton job (placement, the pod broker's reaping, ...): one record per role in
`coderai_leaders`, held by whoever wrote it last, within the bucket's TTL."""

from __future__ import annotations

from coderai.contracts.base import Message

SINGLETONS = ("scheduler", "pod-broker", "metrics")
"""The roles that run on every head and act on one (the lease's key in `coderai_leaders`)."""


class LeaderRecord(Message, frozen=True, kw_only=True):
    """The value under a role's key. `token` is the fencing token: the revision of the write that won the lease,
    so a later holder's token is always larger; 0 in that first write, which then is its own token."""

    holder: str
    token: int = 0
    since: float = 0.0  # unix seconds it was won
    renewed: float = 0.0  # unix seconds of this write


class LeaderInfo(Message, frozen=True, kw_only=True):
    """What `/admin/cluster` and `coderai status` show for one role."""

    role: str
    holder: str = ""  # "" while nobody holds it
    token: int = 0
    since: float = 0.0
    age_s: float = 0.0  # since the last renewal
