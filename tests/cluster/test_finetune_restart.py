"""A fine-tuning job survives a scheduler restart (one host, one rank, a stack of real processes without
namespaces): the scheduler is SIGKILLed as soon as the job's rank runs, the trainer finishes while no scheduler runs
(its step and done reports go nowhere, rank 0's adapter upload finds nobody and keeps retrying), then a new
scheduler adopts the job, gets the missed steps from the worker, takes the upload, and the job succeeds; its model
answers a chat through the gateway."""

from __future__ import annotations

import io
import json

import pytest

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from coderai.testing.procs import FINE_TUNE_ENDED, wait_until
from coderai.testing.stack import running_stack
from coderai.testing.tiny_hf_llama import tiny_hf_llama

# each wait below is bounded (times CODERAI_TEST_DEADLINE_SCALE) and says which one failed, with the logs: the
# suite's 300 s timeout would cut a stuck wait short without saying which
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1000)]

EXAMPLES = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
        ]
    }
    for i in range(4)
]
EPOCHS = 15  # 60 steps (a few seconds, after the rank's start: loading torch and the model)


def test_a_running_job_survives_a_scheduler_restart_and_its_model_answers(tmp_path):
    models = [{"name": "tiny", "engine": "transformers", "path": str(tiny_hf_llama()), "params": {"max_tokens": 8}}]
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with running_stack(tmp_path, models, gateway_args=("--no-auth",), extra_env=env) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)
        data = "".join(json.dumps(e) + "\n" for e in EXAMPLES).encode()
        file = client.files.create(file=("train.jsonl", io.BytesIO(data)), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(
            model="tiny",
            training_file=file.id,
            suffix="rs",
            seed=7,
            hyperparameters={"n_epochs": EPOCHS, "batch_size": 1, "learning_rate_multiplier": 25},
            extra_body={"nodes": 1},
        )

        def steps() -> list[int]:
            events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
            return sorted(e.data["step"] for e in events if e.type == "metrics")

        sched, worker = stack.procs["scheduler"], stack.procs["worker-w1"]

        def phase(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
            """wait_until, failing with both logs' tails: which part got stuck is the first thing to know."""
            try:
                return wait_until(predicate, timeout_s, what, interval_s=interval_s)
            except TimeoutError as exc:
                tails = (f"--- {p.name}:\n{p.log_text()[-4000:]}" for p in (sched, worker))
                raise AssertionError(f"{exc}\n" + "\n".join(tails)) from None

        # killed as soon as its rank runs (steps take a few seconds in all: one wait for the first step could see
        # them all on a loaded machine)
        phase(lambda: client.fine_tuning.jobs.retrieve(job.id).status == "running", 60, "the job's rank to run")
        sched.kill()  # SIGKILL mid-training: nothing of the old scheduler gets to say goodbye
        seen = len(steps())  # the record as the dead scheduler left it
        assert seen < 4 * EPOCHS, "the job ended before the restart"
        assert client.fine_tuning.jobs.retrieve(job.id).status == "running"
        offset = len(worker.log_text())
        # the trainer finishes with no scheduler listening: rank 0's upload finds nobody and is retried
        phase(
            lambda: f"training job {job.id}: adapter upload failed" in worker.log_text()[offset:],
            60,
            "rank 0's upload to find no scheduler",
        )
        sched.start()
        sched.wait_log('"msg": "ready"', 30)
        got = phase(
            lambda: (j := client.fine_tuning.jobs.retrieve(job.id)).status in FINE_TUNE_ENDED and j,
            60,
            "the adopted job to end",
            interval_s=0.5,
        )
        events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
        said = [e.message for e in events]
        assert got.status == "succeeded", (got.error, said, worker.log_text()[-3000:])
        name = f"tiny:rs-{job.id.removeprefix('ftjob-')[:8]}"  # the job's own name: its suffix and its id
        assert got.fine_tuned_model == name and got.error is None
        assert any("The scheduler restarted; following the job's ranks again" in m for m in said), said
        # every step recorded once: the ones of the gap came from the worker
        assert steps() == list(range(1, 4 * EPOCHS + 1)) and seen < 4 * EPOCHS
        assert got.trained_tokens and got.trained_tokens > 0
        assert name in [m.id for m in client.models.list().data]

        def answered() -> bool:
            try:
                r = client.chat.completions.create(
                    model=name, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "What is 2 plus 2?"}]
                )
            except openai.APIStatusError:
                return False  # not placed / loaded yet
            return r.model == name and isinstance(r.choices[0].message.content, str)

        phase(answered, 90, f"{name} to answer through the gateway", interval_s=1)
