"""Every table about ops derives from `contracts/ops.py:OPS`, and each op is wired through: its subject carries
its job, its span names a gateway route, some engine family serves it, and the worker's engine base class has its
method."""

from __future__ import annotations

import typing

from coderai.contracts import ModelConfig
from coderai.contracts.jobs import Op
from coderai.contracts.families import DEFAULT_OPS, EngineFamily
from coderai.contracts.ops import ENGINE_OPS, FANOUT_OPS, KINDS, LLM_OPS, OPS, SPAN_NAMES


def test_the_tables_are_views_of_ops():
    assert set(ENGINE_OPS) == set(SPAN_NAMES) == set(KINDS) == set(OPS)
    assert LLM_OPS == {"chat", "complete"} and "chat" not in FANOUT_OPS  # tokens stream; they are never split
    assert FANOUT_OPS <= set(OPS) - LLM_OPS
    for name, spec in OPS.items():
        assert spec.subject.pattern.endswith(f".{name}") and spec.subject.request is spec.job
        assert any(name in ops for ops in DEFAULT_OPS.values()), f"no family serves {name}"


def test_every_op_is_an_op_and_every_family_serves_something():
    assert set(OPS) <= set(typing.get_args(Op))
    families = set(typing.get_args(EngineFamily))
    assert set(DEFAULT_OPS) == families
    assert ModelConfig(name="m", engine="embed", path="").serves() == ["embed", "rerank"]


def test_every_span_names_a_gateway_route():
    from coderai.gateway.app import create_app
    from coderai.gateway.settings import GatewaySettings

    routes = {r.path for r in create_app(GatewaySettings(no_auth=True)).routes}
    for spec in OPS.values():
        method, path = spec.span.split(" ", 1)
        assert method == "POST" and any(r == path or r.startswith(path + "/") for r in routes), spec.span


def test_every_family_the_worker_can_load_here_has_the_methods_of_its_ops():
    """The engine method is the third place an op touches: the host calls `getattr(engine, op)`."""
    from coderai.engine_worker.engines import FAMILIES, engine_class

    checked = []
    for family, ops in DEFAULT_OPS.items():
        module = FAMILIES[family][1].partition(":")[0]
        try:
            cls = engine_class(family)
        except ImportError:  # an extra not installed here (vllm): its module cannot even be read
            continue
        checked.append(family)
        for op in ops:
            assert callable(getattr(cls, op, None)), f"{module}: {cls.__name__}.{op}"
    assert "echo" in checked and "llama" in checked
