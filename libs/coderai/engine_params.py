"""The params each engine family takes, with their types and ranges: a model's `params` are data, never a command
line. A server family (llama-server, vLLM) turns each param it does not read itself into a `--flag value` of its
child, so a param outside its table would be a flag nobody checked (`host` binds the child on every interface,
`log_file` writes any file, `trust_remote_code` runs a repository's Python): every param is looked up here first,
and anything else is refused, naming it. The tables are each family's `params` (`contracts/families.py`).

Where the checks are made:
- the admin API and the scheduler's add/replace subject (`check(..., operator=False)`): a 400 naming the param;
- a worker, for every model an assignment brings it (`check` again, over the bus): a refused model is not loaded,
  and its engine is reported failed with the reason;
- EXEC params (what program runs, its environment, its raw arguments, remote code) come only from a models file
  the operator wrote: never from the API, and a worker honours them only when its own settings say so
  (`CODERAI_WORKER_BUS_EXEC`, which `coderai up` sets for its own worker).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from coderai.contracts.families import FAMILIES
from coderai.contracts.params import EXEC_PARAMS, P


class ParamError(ValueError):
    """A param a family does not take, or a value out of its type or range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


FAMILY_PARAMS: dict[str, Mapping[str, P]] = {name: spec.params for name, spec in FAMILIES.items()}
"""Each family's params (its `FamilySpec.params`)."""


def _show(x: float | None) -> str:
    return "?" if x is None else str(int(x)) if float(x).is_integer() else f"{x:g}"


def _fits(spec: P, value: Any) -> str | None:
    """Why `value` is not a `spec`, or None when it is."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec.kind in ("int", "float", "int_or_bool"):
        if spec.kind == "int_or_bool" and isinstance(value, bool):
            return None
        if not number or (spec.kind != "float" and not float(value).is_integer()):
            return f"must be {'a number' if spec.kind == 'float' else 'a whole number'}"
        if (
            not math.isfinite(value)
            or (spec.lo is not None and value < spec.lo)
            or (spec.hi is not None and value > spec.hi)
        ):
            return f"must be between {_show(spec.lo)} and {_show(spec.hi)}"
        return None
    if spec.kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if spec.kind == "choice":
        return None if value in spec.choices else f"must be one of {', '.join(map(str, spec.choices))}"
    if spec.kind in ("str", "path"):
        if not isinstance(value, str):
            return "must be a string"
        if "\0" in value or len(value) > spec.size:
            return f"must be a string of at most {spec.size} characters"
        return None
    if spec.kind in ("list", "table"):
        if not isinstance(value, list if spec.kind == "list" else dict):
            return "must be a list" if spec.kind == "list" else "must be a table"
        import msgspec

        return None if len(msgspec.json.encode(value)) <= spec.size else f"is over {spec.size} bytes"
    return "has no known kind"


def check(engine: str, params: dict[str, Any], *, operator: bool) -> None:
    """Raise ParamError naming the first param of `params` that family `engine` does not take (or not from this
    source: EXEC params only when `operator`, a models file the operator wrote), or whose value is out of its
    type or range. A family this table does not know is the worker's to refuse ("no engine family")."""
    table = FAMILY_PARAMS.get(engine)
    if table is None:
        return
    for name, value in params.items():
        where = f"params.{name}"
        if name in EXEC_PARAMS and not operator:
            raise ParamError(
                where,
                f"params.{name} chooses what runs on a node (a program, its environment or "
                "arguments, or a repository's code): only a models file the operator writes may "
                "set it, never the API or the bus",
            )
        spec = table.get(name)
        if spec is None:
            raise ParamError(
                where,
                f"engine {engine} takes no param {name!r} (it takes {', '.join(sorted(set(table) - EXEC_PARAMS))})",
            )
        if value is None:
            continue
        why = _fits(spec, value)
        if why is not None:
            raise ParamError(where, f"params.{name} {why}, not {str(value)[:80]!r}")


def takes(engine: str) -> list[str]:
    """The params family `engine` takes from anyone (the EXEC ones left out)."""
    return sorted(set(FAMILY_PARAMS.get(engine, {})) - EXEC_PARAMS)
