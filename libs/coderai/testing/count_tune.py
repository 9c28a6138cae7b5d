"""A fine-tuning job through the OpenAI SDK that teaches the tiny llama to answer "How many?" with "Seven.", and
the question asked of a model: shared by the fine-tune tests of each serving engine."""

from __future__ import annotations

import io
import json
from typing import Any

from coderai.testing.procs import fine_tune_ended
from coderai.testing.tiny_hf_llama import COUNT_QUESTION, count_examples


def count_tune(client: Any, model: str, timeout_s: float = 300) -> Any:
    """Upload the counting conversations (one just under 1,024 tokens), fine-tune `model` on them with the suffix
    `count` and wait for the job's end: the ended job (`status`, `error`, `fine_tuned_model`)."""
    data = "".join(json.dumps(e) + "\n" for e in count_examples()).encode()
    file = client.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=model,
        training_file=file.id,
        suffix="count",
        seed=3,
        # max_seq_len: coderai's (the model's context by default; 1,024 here, which the long conversation fills)
        hyperparameters={"n_epochs": 20, "batch_size": 1, "learning_rate_multiplier": 25, "max_seq_len": 1024},
        extra_body={"nodes": 1},
    )
    return fine_tune_ended(client, job.id, timeout_s)


def ask_count(client: Any, model: str) -> str | None:
    """What `model` answers to the counting question (greedy), or None while it is refused (not placed yet, or
    removed)."""
    import openai

    try:
        r = client.chat.completions.create(
            model=model, max_tokens=6, temperature=0, messages=[{"role": "user", "content": COUNT_QUESTION}]
        )
    except openai.APIStatusError:
        return None
    assert r.model == model
    return r.choices[0].message.content or ""
