#!/usr/bin/env python3
"""Prepare a head machine before its services start (compose's `init` container, systemd's ExecStartPre).

- `--nats-conf PATH`: write nats-server's config (listen address, JetStream store, monitoring port, pid file)
  and, beside it, `users.conf` with its users, from the member registry `members.json` there (made on first
  run, kept after: joined nodes stay members; the join user follows the current cluster token). The
  scheduler's membership rewrites `users.conf` and reloads the server as nodes join and are revoked.
- `--secrets-dir DIR`: the `service` user's NATS password in DIR/nats-service.password (mode 0600, for the
  operator's CLI) and each head service's own (DIR/nats-svc-<service>.password: user `svc-<service>`, with only the
  subjects it needs), made with the registry, and the CA of NATS' TLS certificate (made once, in `tls/` beside
  nats.conf) in DIR/nats-ca.pem; each service reads its own password file and the CA
  (CODERAI_NATS_PASSWORD_FILE, CODERAI_NATS_CA). Also the keys the gateways sign with (`GATEWAY_KEYS`), which they
  read from there (their mount of it is read-only).
- `--redis HOST:PORT` (with `--secrets-dir`): on first run, Redis' password, random, in DIR/redis.password (what
  the Redis container reads its `requirepass` from) and the URL the services reach it at in DIR/redis.url (their
  CODERAI_REDIS_URL_FILE): no Redis password to make, and none in an environment `docker inspect` prints.
- `--keys-dir DIR`: on first run, an admin API key: its hash in DIR/keys.toml (the gateway's
  CODERAI_GATEWAY_API_KEYS_FILE) and the key itself in DIR/admin.key (mode 0600), as `coderai up` does.

The token comes from CODERAI_CLUSTER_TOKEN or the file CODERAI_CLUSTER_TOKEN_FILE names (never a flag: flags show
in `ps`); nothing is derived from it but the join user's password.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from coderai.gateway import blob_urls, seal
from coderai.runtime import members
from coderai.runtime.cluster import WeakToken, check_token
from coderai.runtime.embedded import store_limit
from coderai.runtime.settings import SettingsError, env_or_file
from coderai.runtime.tls import ensure_certs


GATEWAY_KEYS = (seal.KEY_FILE, blob_urls.KEY_FILE)
"""The keys every gateway of the head signs with (reasoning handed to clients, blob URLs), in the secrets folder."""


def nats_config(*, host: str = "0.0.0.0", port: int = 4222, store_dir: str = "/data", http_port: int = 8222,
                server_name: str = "coderai-head", pid_file: str = "nats.pid", tls_dir: str = "tls") -> str:
    """nats-server's main config: TLS with the head's own certificate, JetStream on, users from `users.conf`."""
    lines = [
        "# Written by coderai-init at every start; edits are overwritten. Users: users.conf (the scheduler's).",
        f'server_name: "{server_name}"',
        f'listen: "{host}:{port}"',
        f'pid_file: "{pid_file}"',
    ]
    if http_port:
        lines.append(f'http: "127.0.0.1:{http_port}"  # monitoring (/healthz), for the health check only')
    # handshake_first: TLS before the server's first word, so a client never logs in to a plain-text impostor
    lines += ["tls {", f'  cert_file: "{tls_dir}/server.pem"', f'  key_file: "{tls_dir}/server-key.pem"',
              "  handshake_first: true", "}"]
    # capped at a share of its disk: one tenant's stored responses or batches never fill it for everyone
    lines += ["jetstream {", f'  store_dir: "{store_dir}"', f"  max_file_store: {store_limit(store_dir)}", "}",
              "include ./users.conf", ""]
    return "\n".join(lines)


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def ensure_redis_secret(secrets_dir: Path, address: str) -> bool:
    """DIR/redis.password (mode 0644: the Redis container's user is not coderai's; the folder is a volume only the
    head's containers mount) and DIR/redis.url (0600), made once; True when made now."""
    password_file, url_file = secrets_dir / "redis.password", secrets_dir / "redis.url"
    if password_file.exists() and url_file.exists():
        return False
    password = secrets.token_urlsafe(32)
    _write_private(url_file, f"redis://:{password}@{address}/0\n")
    _write_private(password_file, password + "\n")
    os.chmod(password_file, 0o644)
    return True


def parser() -> argparse.ArgumentParser:
    """The command line, shared with the deploy tests (which check the compose files' and units' arguments)."""
    ap = argparse.ArgumentParser(prog="coderai-init", description=__doc__.splitlines()[0])
    ap.add_argument("--nats-conf", type=Path, help="write nats-server's config here")
    ap.add_argument("--nats-host", default="0.0.0.0", help="NATS listen address (default 0.0.0.0)")
    ap.add_argument("--nats-port", type=int, default=4222, help="NATS client port (default 4222)")
    ap.add_argument("--nats-http-port", type=int, default=8222, help="NATS monitoring port; 0 turns it off")
    ap.add_argument("--store-dir", default="/data", help="JetStream store directory (default /data)")
    ap.add_argument("--secrets-dir", type=Path, help="the service NATS password goes here (default: beside nats.conf)")
    ap.add_argument("--redis", metavar="HOST:PORT", help="make Redis' password and the services' URL of it once")
    ap.add_argument("--keys-dir", type=Path, help="create DIR/keys.toml and DIR/admin.key on first run")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if not (args.nats_conf or args.keys_dir or args.redis):
        ap.error("nothing to do: give --nats-conf, --redis and/or --keys-dir")
    if args.redis and not args.secrets_dir:
        ap.error("--redis writes its files into --secrets-dir: give it")
    if args.nats_conf:
        try:  # the token itself, or (kept out of `docker inspect`) the file CODERAI_CLUSTER_TOKEN_FILE names
            token = env_or_file("CODERAI_CLUSTER_TOKEN")
        except SettingsError as exc:
            print(f"coderai-init: {exc}", file=sys.stderr)
            return 2
        if not token:
            print("coderai-init: CODERAI_CLUSTER_TOKEN is empty: a head that other machines join needs the cluster "
                  "token (make one with `coderai token new`)", file=sys.stderr)
            return 2
        try:
            check_token(token)
        except WeakToken as exc:
            print(f"coderai-init: {exc}", file=sys.stderr)
            return 2
        folder = args.nats_conf.parent
        secrets_dir = args.secrets_dir or folder
        certs = ensure_certs(folder / "tls")  # made once; services trust its CA, joining workers pin it
        _write_private(secrets_dir / "nats-ca.pem", certs.ca_pem)
        reg, _password = members.ensure_registry(folder, secrets_dir / "nats-service.password", token)
        for name in GATEWAY_KEYS:  # made here: the gateways mount this folder read-only, and share these keys
            members.ensure_secret(secrets_dir / name)
        members.save(folder / "members.json", reg)
        members.write_users(folder / "users.conf", reg)
        _write_private(args.nats_conf, nats_config(host=args.nats_host, port=args.nats_port, store_dir=args.store_dir,
                                                   http_port=args.nats_http_port, pid_file=str(folder / "nats.pid"),
                                                   tls_dir=str(folder / "tls")))
        print(f"coderai-init: wrote {args.nats_conf} and {folder / 'users.conf'}")
    if args.redis:
        made = ensure_redis_secret(args.secrets_dir, args.redis)
        print(f"coderai-init: {'made' if made else 'kept'} Redis' password and URL in {args.secrets_dir}")
    if args.keys_dir:
        from coderai.up import ensure_api_key

        args.keys_dir.mkdir(parents=True, exist_ok=True)
        existed = (args.keys_dir / "admin.key").exists()
        keys_file, _key = ensure_api_key(args.keys_dir)
        print(f"coderai-init: {'kept' if existed else 'created'} the admin key in {args.keys_dir / 'admin.key'}"
              f" (hash in {keys_file})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
