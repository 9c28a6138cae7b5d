"""python -m coderai.engine_worker"""

from coderai.engine_worker.node import stable_node_id
from coderai.engine_worker.service import Worker
from coderai.engine_worker.settings import WorkerSettings
from coderai.runtime.entry import run_service


def make(settings: WorkerSettings):
    return Worker(settings, stable_node_id(settings.data_dir, settings.node_id)).start


def main(argv: list[str] | None = None) -> int:
    return run_service(
        "worker", "Runs this machine's engines: loads what its assignment says, answers jobs, heartbeats.",
        WorkerSettings, make, argv, drain_timeout_s=30.0,
    )


if __name__ == "__main__":
    raise SystemExit(main())
