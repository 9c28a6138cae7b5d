"""The Grafana dashboard is valid JSON and only queries series the metrics service exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from coderai.metrics.prom import Series

DASH = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "coderai.json"


def test_dashboard_queries_exported_series():
    doc = json.loads(DASH.read_text())
    exported = set()
    for metric in Series().registry.collect():
        exported |= {metric.name, metric.name + "_total", metric.name + "_bucket"}
    used = set()
    for p in doc["panels"]:
        for t in p["targets"]:
            used |= set(re.findall(r"\bcoderai_[a-z_]+", t["expr"]))
    assert used and used <= exported, used - exported
