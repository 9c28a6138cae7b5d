"""What `coderai up` keeps in its data dir, made on first run and read at every start: the default models file,
the admin key, the scrape token, NATS' users (this head's services and its own worker) and the RunPod key."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import bcrypt

from coderai.accounts.keyfile import KeyRecord, hash_key, load_keys, new_key, write_keys
from coderai.runtime import members


def runpod_api_key(key_file: str) -> str:
    """The RunPod API key: the first line of `key_file`, else RUNPOD_API_KEY (the `runpod` SDK's variable), else
    CODERAI_POD_BROKER_RUNPOD_API_KEY; "" with none."""
    if key_file:
        try:
            return Path(os.path.expanduser(key_file)).read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise SystemExit(f"coderai up: cannot read the RunPod API key from {key_file}: {exc}") from None
    return os.environ.get("RUNPOD_API_KEY") or os.environ.get("CODERAI_POD_BROKER_RUNPOD_API_KEY", "")


def port_free(host: str, port: int) -> bool:
    """Whether `host:port` can be bound now, as the servers bind it."""
    with socket.socket() as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as the servers bind: a closed socket's TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ensure_default_model(data: Path) -> Path:
    """Write, once, a models file serving the tiny defaults: a GGUF chat model and one model per installed
    modality (coderai.defaults); building them is offline and takes seconds to a minute."""
    models_file = data / "models.toml"
    if not models_file.exists():
        try:
            from coderai.defaults import default_models
            from coderai.models_file import write_models_file
        except ImportError:
            raise SystemExit(
                "coderai up: building the default model needs the llama extra: pip install 'coderai[llama]'"
            )
        models = default_models(data, say=lambda m: print(m, flush=True))
        write_models_file(models_file, models)
        text = models_file.read_text()
        models_file.write_text("# Models this box serves. Add your own by path; see docs/modalities.md.\n" + text)
    return models_file


def ensure_api_key(data: Path) -> tuple[Path, str]:
    """Create an admin key on first run: its hash in keys.toml, the key itself in admin.key (mode 0600). A head that
    joined by invite has the first head's keys.toml already: its own admin key is added beside that head's, so the
    first head's admin key works at every gateway."""
    keys_file, key_file = data / "keys.toml", data / "admin.key"
    if keys_file.exists() and key_file.exists():
        return keys_file, key_file.read_text().strip()
    key = new_key()
    others = list(load_keys(str(keys_file)).values()) if keys_file.exists() else []
    name = f"admin-{secrets.token_hex(3)}" if any(r.name == "admin" for r in others) else "admin"
    write_keys(str(keys_file), [*others, KeyRecord(name=name, sha256=hash_key(key), scopes=["inference", "admin"])])
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return keys_file, key


def ensure_scrape_token(data: Path) -> str:
    """A token for Prometheus to read /metrics with (kept in scrape.token, mode 0600), made on first run."""
    path = data / "scrape.token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def ensure_members(data: Path, token: str, worker_id: str, own_worker: bool = True) -> tuple[str, str]:
    """NATS' users for this head: the registry (kept across restarts, so joined nodes stay members), the service
    password (made once, in secrets/nats-service.password) and a password for this box's own worker, which is a
    node like any other (made once, in secrets/worker.password: a restart changes no member, so the registry the
    other heads share stays what it was). Writes the users file nats-server reads; returns (service, worker)
    passwords."""
    reg, password = members.ensure_registry(data / "nats", data / "secrets" / "nats-service.password", token)
    if not own_worker:  # a head that joined: its worker (if any) joins like any node, through the leader
        members.save(data / "nats" / "members.json", reg)
        members.write_users(data / "nats" / "users.conf", reg)
        return password, ""
    secret = data / "secrets" / "worker.password"
    mine = reg.members.get(worker_id)
    worker_password = members.read_secret(secret) if secret.exists() else ""
    if (
        mine is None
        or mine.kind != "node"
        or not worker_password
        or not bcrypt.checkpw(worker_password.encode(), mine.password_hash.encode())
    ):
        worker_password = members.add_node(reg, worker_id)
        members.write_secret(secret, worker_password)
    members.save(data / "nats" / "members.json", reg)
    members.write_users(data / "nats" / "users.conf", reg)
    return password, worker_password
