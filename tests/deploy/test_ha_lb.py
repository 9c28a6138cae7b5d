"""compose/ha-lb.yml: HAProxy in front of three heads' gateways. Checked statically (no daemon here): every variable
the HAProxy config reads is one compose hands it, each head's gateway is health-checked on `/healthz` (which the
gateway answers without a key: tests/gateway/test_guards.py; `coderai up --head --no-worker` waits on it, which
tests/ha runs), and the timeouts let a long stream finish."""

from __future__ import annotations

import re

import pytest

from tests.deploy.conftest import COMPOSE, interpolate

HEADS = {"HEAD1": "10.0.0.1:8000", "HEAD2": "10.0.0.2:8000", "HEAD3": "10.0.0.3:8000"}


def _lb() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(interpolate((COMPOSE / "ha-lb.yml").read_text(), HEADS))["services"]["lb"]


def _cfg() -> str:
    return (COMPOSE / "haproxy.cfg").read_text()


def test_every_head_is_required_and_handed_to_haproxy():
    lb = _lb()
    assert lb["environment"] == HEADS
    with pytest.raises(KeyError, match="HEAD2"):
        interpolate((COMPOSE / "ha-lb.yml").read_text(), {"HEAD1": "a:1", "HEAD3": "c:3"})
    assert set(re.findall(r"\$\{(\w+)\}", _cfg())) == set(HEADS)
    mount = [v for v in lb["volumes"] if v.endswith("haproxy.cfg:ro")]
    assert mount and (COMPOSE / mount[0].split(":")[0]).exists()
    assert lb["ports"] == ["8000:8000"]


def test_gateways_are_health_checked_on_healthz_and_streams_may_run_long():
    cfg = _cfg()
    assert "option httpchk GET /healthz" in cfg
    assert re.search(r"default-server check inter 1s fall 2 rise 2", cfg)
    assert len(re.findall(r"^\s*server h\d ", cfg, re.M)) == 3
    timeouts = dict(re.findall(r"^\s*timeout (\w+) (\d+)s", cfg, re.M))
    assert int(timeouts["server"]) >= 600 and int(timeouts["client"]) >= 600
    assert "option redispatch" in cfg  # a refused connection goes to another gateway
