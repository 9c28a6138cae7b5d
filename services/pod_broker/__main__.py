"""python -m coderai.pod_broker"""

from coderai.pod_broker.service import make
from coderai.pod_broker.settings import BrokerSettings
from coderai.runtime.entry import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(
        "pod-broker", "Rents, watches and reaps RunPod pods under price caps and budgets.", BrokerSettings, make, argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
