"""The official openai SDK against a coderai gateway, for tests/cluster/test_finetune.py, run inside the head's
network namespace: `python finetune_client.py BASE_URL KEY COMMAND [ARGS]`; prints one JSON line."""

from __future__ import annotations

import io
import json
import sys

import openai

BAD_FILES = {
    "not_jsonl": b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\nnot json\n',
    "wrong_role": b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
    b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
    b'{"messages": [{"role": "wizard", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
    "empty": b"",
}


def main() -> None:
    base_url, key, cmd, *args = sys.argv[1:]
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    out: object
    if cmd == "bad":
        out = {}
        for name, data in BAD_FILES.items():
            try:
                client.files.create(file=(f"{name}.jsonl", io.BytesIO(data)), purpose="fine-tune")
                out[name] = {"status": 200}
            except openai.APIStatusError as exc:
                out[name] = {"status": exc.status_code, "message": exc.body["message"], "param": exc.body["param"]}
        good = client.files.create(
            file=("good.jsonl", io.BytesIO(BAD_FILES["wrong_role"].rsplit(b"\n", 2)[0] + b"\n")), purpose="fine-tune"
        )  # a file of this key's, so the model is what is wrong
        for name, call in (
            ("unknown_job", lambda: client.fine_tuning.jobs.retrieve("ftjob-doesnotexist")),
            ("unknown_file", lambda: client.fine_tuning.jobs.create(model="tiny", training_file="file-nope")),
            ("unknown_model", lambda: client.fine_tuning.jobs.create(model="nope", training_file=good.id)),
        ):
            try:
                call()
                out[name] = {"status": 200}
            except openai.APIStatusError as exc:
                out[name] = {"status": exc.status_code, "message": exc.body["message"], "param": exc.body["param"]}
    elif cmd == "upload":
        with open(args[0], "rb") as fh:
            f = client.files.create(file=("train.jsonl", fh), purpose="fine-tune")
        out = {"id": f.id, "object": f.object, "bytes": f.bytes, "purpose": f.purpose}
    elif cmd == "create":  # FILE_ID SUFFIX N_EPOCHS [METHOD [VALIDATION_FILE_ID]]
        extra = {"nodes": 2, "lora_rank": 8, "lora_alpha": 16}
        if len(args) > 3:
            extra["method"] = args[3]
        valid = {"validation_file": args[4]} if len(args) > 4 else {}
        try:
            job = client.fine_tuning.jobs.create(
                model="tiny",
                training_file=args[0],
                suffix=args[1],
                seed=7,
                **valid,
                hyperparameters={"n_epochs": int(args[2]), "batch_size": 1, "learning_rate_multiplier": 25},
                extra_body=extra,
            )
            out = {"status": 200, "id": job.id, "job_status": job.status}
        except openai.APIStatusError as exc:
            out = {"status": exc.status_code, "message": exc.body["message"], "param": exc.body["param"]}
    elif cmd == "get":
        job = client.fine_tuning.jobs.retrieve(args[0])
        events = client.fine_tuning.jobs.list_events(args[0], limit=100)
        listed = [j.id for j in client.fine_tuning.jobs.list(limit=10).data]
        out = {"job": job.model_dump(), "events": [e.model_dump() for e in events.data], "listed": listed}
    elif cmd == "cancel":
        out = client.fine_tuning.jobs.cancel(args[0]).model_dump()
    elif cmd == "chat":
        try:
            r = client.chat.completions.create(
                model=args[0], messages=[{"role": "user", "content": "What is 2 plus 2?"}], max_tokens=8, temperature=0
            )
            out = {"status": 200, "content": r.choices[0].message.content, "model": r.model}
        except openai.APIStatusError as exc:
            out = {"status": exc.status_code, "message": str(exc)}
    elif cmd == "models":
        out = [m.id for m in client.models.list().data]
    elif cmd == "delete":  # OpenAI's delete of a fine-tuned model
        try:
            out = {"status": 200, **client.models.delete(args[0]).model_dump()}
        except openai.APIStatusError as exc:
            out = {"status": exc.status_code, "message": exc.body["message"]}
    elif cmd == "newkey":  # a tenant's inference key, made with this (admin) key: the admin API has no SDK
        import httpx

        r = httpx.post(
            base_url.removesuffix("/v1") + "/admin/keys",
            json={"name": args[0]},
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        r.raise_for_status()
        out = {"key": r.json()["key"]}
    elif cmd == "revoke":
        import httpx

        r = httpx.post(
            base_url.removesuffix("/v1") + f"/admin/keys/{args[0]}/revoke",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )
        out = {"status": r.status_code}
    else:
        raise SystemExit(f"unknown command {cmd}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
