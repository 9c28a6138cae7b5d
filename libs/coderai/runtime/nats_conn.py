"""Connecting to NATS: a connection that retries until a deadline and then reconnects forever (to any head of
several, with its login), closing one safely while nats-py reconnects, and the URL helpers both need. `bus.Bus`
wraps what `connect` returns."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import nats
from nats.aio.client import Client as NATS

from coderai.contracts import BusError

log = logging.getLogger("coderai.bus")

_REFUSED_PUBLISH = re.compile(r'permissions violation for publish to "?([^"\s]+)', re.IGNORECASE)
_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "?([^"\s]+)', re.IGNORECASE)


def refused_subject(text: str) -> str:
    """The subject of a NATS 'Permissions Violation for Publish to "<subject>"' error, else ''."""
    m = _REFUSED_PUBLISH.search(text)
    return m.group(1) if m else ""


def violation(text: str) -> tuple[str, str] | None:
    """("publish" or "subscription", subject) of a NATS 'Permissions Violation for Publish to "<subject>"' (or
    'for Subscription to') error, else None."""
    m = _VIOLATION.search(text)
    return (m.group(1).lower(), m.group(2)) if m else None


def url_user(url: str) -> str:
    """The user the (first) URL of `url` logs in as, '' without one."""
    for part in map(urlsplit, split_urls(url)):
        if part.username:
            return unquote(part.username)
    return ""


ATTEMPT_S = 4.0
"""The longest one connection attempt may take (a third of the window when that is longer): a TCP connect, a TLS
handshake, INFO, CONNECT and a PING's PONG, each bounded at 2 s by nats-py, take well under it when the server
answers; one that has not connected by then is given up and a new one made."""


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 30.0,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_refused: Callable[[str], None] | None = None,
    inbox_prefix: str = "",
    tls: Any = None,
) -> NATS:
    """Connect, retrying until `connect_timeout_s`; afterwards reconnect forever with a short wait.
    `on_refused(subject)`: the server refused a publish there (the connection's role may not use it)."""

    async def _reconnected() -> None:
        log.warning("reconnected to NATS")
        if on_reconnect:
            await on_reconnect()

    async def _disconnected() -> None:
        log.warning("disconnected from NATS")
        if on_disconnect:
            await on_disconnect()

    said = ""
    last = ""  # the last error nats-py reported while connecting (a timeout ending the attempt says nothing)
    told: dict[tuple[str, str], float] = {}  # refusals logged, when
    safe_url = _without_credentials(url)

    async def _error(exc: Exception) -> None:
        nonlocal said, last
        text = str(exc)
        last = text or type(exc).__name__
        refused = violation(text)
        if refused is not None:
            # a right this login lacks: loud (at ERROR, with the subject), so a missing right shows in the logs and
            # the tests instead of as a message that silently never arrived; a repeat within a minute is not logged
            what, subject = refused
            if on_refused is not None and what == "publish":
                on_refused(subject)
            now, last = time.monotonic(), told.get(refused)
            if last is None or now - last >= 60.0:
                if len(told) > 1000:
                    told.clear()
                told[refused] = now
                user = url_user(url) or "anonymous"
                # a node binds the WORK consumers of a model as soon as it is assigned one, and the head grants them
                # by a reload of nats-server's users a moment later: its JetStream calls retry until then, so a
                # node's refused JetStream API call is a warning; any other refusal is an error
                probe = user.startswith(("node-", "pod-")) and subject.lower().startswith("$js.api.")
                level = logging.WARNING if probe else logging.ERROR
                log.log(
                    level, "NATS refused %s %s to %r: this login (%s) has no right to it", name, what, subject, user
                )
        elif "authorization" in text.lower() or "permissions" in text.lower():  # a wrong token: say it once
            if text != said:
                said = text
                log.warning("NATS at %s says: %s", safe_url, text)
        elif "certificate" in text.lower():  # a server whose certificate the pinned CA did not sign: say it once
            if text != said:
                said = text
                log.warning("NATS at %s is refused: %s (not the server this connection trusts)", safe_url, text)
        else:
            log.debug("nats error: %s", exc)

    # the login as options too: nats-py sends a URL's credentials only to that URL's server, and none to the servers
    # it learns from the cluster (every other head), which a reconnect after a head's death must reach
    login = next(
        (
            (unquote(p.username), unquote(p.password))
            for p in map(urlsplit, split_urls(url))
            if p.username and p.password
        ),
        None,
    )
    deadline = time.monotonic() + connect_timeout_s
    attempt_s = max(ATTEMPT_S, connect_timeout_s / 3)
    while True:
        try:
            # nats-py retries a refused login forever inside connect(); the deadline bounds that too. Each attempt
            # is bounded as well: after a TLS handshake that timed out nats-py makes no other (measured: one attempt
            # then nothing until the deadline), so a worker that met its head reloading nats-server's users lost its
            # whole window, 10 s, before joining again
            return await asyncio.wait_for(
                nats.connect(
                    split_urls(url) if "," in url else url,  # several heads' URLs
                    name=name,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.25,
                    ping_interval=5,
                    max_outstanding_pings=2,
                    drain_timeout=5,  # nats-py's default (30 s) outlives any service's shutdown deadline
                    reconnected_cb=_reconnected,
                    disconnected_cb=_disconnected,
                    error_cb=_error,
                    **({"inbox_prefix": inbox_prefix} if inbox_prefix else {}),
                    **({"user": login[0], "password": login[1]} if login else {}),
                    # TLS before anything else: a server that cannot (a plain-text impostor) never sees a login
                    **({"tls": tls, "tls_handshake_first": True} if tls is not None else {}),
                ),
                max(1.0, min(attempt_s, deadline - time.monotonic())),
            )
        except Exception as exc:  # any failure to reach NATS is retried until the deadline
            waited = connect_timeout_s if time.monotonic() > deadline else min(attempt_s, connect_timeout_s)
            why = str(exc) or (f"no server answered within {waited:g} s; last: {last or 'nothing'}")
            if why != said:  # say each distinct reason once (a wrong token reads "Authorization Violation")
                said = why
                log.warning("cannot connect to NATS at %s: %s", safe_url, why)
            if time.monotonic() > deadline:
                raise BusError("internal", f"cannot reach NATS at {safe_url}: {why}", retryable=True) from None
            await asyncio.sleep(0.2)


async def close_nats(nc: NATS, *, drain: bool = False) -> None:
    """`nc.close()` (or `drain()`), safe while nats-py is reconnecting.

    nats-py's reconnect task awaits the old socket's close waiter; close() cancels that task, and cancelling a task
    cancels the future it awaits, which close() then awaits too: a CancelledError out of a close that did close. It
    is swallowed here, unless it is this task that is being cancelled."""
    try:
        await (nc.drain() if drain else nc.close())
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.debug("NATS connection closed while it was reconnecting")


def split_urls(url: str) -> list[str]:
    """The servers of a NATS URL that lists several heads, comma-separated."""
    return [u.strip() for u in url.split(",") if u.strip()]


def _without_credentials(url: str) -> str:
    """The URL (or comma-separated URLs) for logs: never the derived password."""
    from urllib.parse import urlunsplit

    if "," in url:
        return ",".join(_without_credentials(u) for u in split_urls(url))
    parts = urlsplit(url)
    if not parts.password and not parts.username:
        return url
    host = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, f"{parts.username}:***@{host}", parts.path, parts.query, parts.fragment))
