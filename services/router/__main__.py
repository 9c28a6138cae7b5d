"""python -m coderai.router"""

from coderai.router.service import make
from coderai.router.settings import RouterSettings
from coderai.runtime.entry import run_service


def main(argv: list[str] | None = None) -> int:
    return run_service(
        "router", "Answers coderai.route.pick: which engine serves a request.", RouterSettings, make, argv
    )


if __name__ == "__main__":
    raise SystemExit(main())
