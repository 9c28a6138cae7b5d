"""A fake head for the security tests: a NATS server (TLS, its own CA) that takes any login, on a test host, answering join
requests as a head that does not know the cluster token must (with a proof it cannot compute). It records
every subject a client published to (inboxes aside) in `--record`, so a test sees what a worker sent it.
`python -m coderai.testing.fake_head --host IP --port 4222 --record F`."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from pathlib import Path

import nats

from coderai.runtime.embedded import NatsServer


async def serve(host: str, port: int, record: Path, root: Path) -> None:
    from coderai.runtime.tls import client_context, ensure_certs

    # TLS with a CA of its own, as an impostor at the head's address would have: any certificate but the head's
    tls = ensure_certs(root / "tls")
    server = NatsServer(root, port=port, host=host, tls=tls).start()
    seen: list[str] = []
    payloads: list[str] = []
    nc = await nats.connect(server.url, tls=client_context(tls.ca_pem), tls_handshake_first=True)

    async def on_any(m) -> None:
        if m.subject.startswith(("_INBOX", "_JOIN", "$JS", "_N.")):
            return
        seen.append(m.subject)
        payloads.append(m.data.decode(errors="replace"))
        record.write_text(json.dumps({"subjects": seen, "payloads": payloads}))
        if m.subject == "coderai.join.hello" and m.reply:  # a proof made without the token
            await nc.publish(
                m.reply,
                json.dumps(
                    {"t": "join.challenge", "nonce": secrets.token_hex(16), "proof": secrets.token_hex(32)}
                ).encode(),
            )

    await nc.subscribe(">", cb=on_any)
    record.write_text(json.dumps({"subjects": [], "payloads": []}))
    print("fake head up", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m coderai.testing.fake_head")
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, default=4222)
    ap.add_argument("--record", required=True)
    a = ap.parse_args(argv)
    record = Path(a.record)
    asyncio.run(serve(a.host, a.port, record, record.parent / "fake-head-nats"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
