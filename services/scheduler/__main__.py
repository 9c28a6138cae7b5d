"""python -m coderai.scheduler"""

from coderai.runtime.entry import run_service
from coderai.scheduler.service import make
from coderai.scheduler.settings import SchedulerSettings


def _args(ap) -> None:
    ap.add_argument("--models-file", dest="models_file", help="TOML file of [[models]] (CODERAI_SCHEDULER_MODELS_FILE)")


def main(argv: list[str] | None = None) -> int:
    return run_service(
        "scheduler",
        "Places models on nodes and keeps node membership from heartbeats.",
        SchedulerSettings,
        make,
        argv,
        add_args=_args,
    )


if __name__ == "__main__":
    raise SystemExit(main())
