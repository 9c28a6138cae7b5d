"""docs/env.md is generated from the settings structs (scripts/envdoc.py, a dev tool) and must be current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec

from coderai.runtime.settings import CommonSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]


def test_docs_env_md_is_current(envdoc):
    current = (ROOT / "docs" / "env.md").read_text()
    assert current == envdoc.render(), "docs/env.md is stale: run `.venv/bin/python scripts/envdoc.py`"


def test_every_field_of_every_service_is_documented(envdoc):
    text = envdoc.render()
    for svc in envdoc.SERVICES:
        cls = envdoc.settings_class(svc)
        assert cls.__name__ in text
        for name in cls.__struct_fields__:
            shown = ("CODERAI_" if name in CommonSettings.__struct_fields__ else envdoc.prefix(svc)) + name.upper()
            assert f"`{shown}`" in text, shown


def test_variables_are_the_names_load_settings_reads(envdoc, tmp_path):
    """Each name variables() gives a service really sets a field when load_settings reads it (a `..._FILE` name
    of a secret or a URL: through the file it names)."""
    for svc in envdoc.SERVICES:
        cls = envdoc.settings_class(svc)
        for var in sorted(envdoc.variables(svc) - set(envdoc.OTHER_VARIABLES)):

            def field_of(name: str) -> str | None:
                names = (
                    f for f in cls.__struct_fields__ if name in (envdoc.prefix(svc) + f.upper(), "CODERAI_" + f.upper())
                )
                return next(names, None)

            field, through_file = field_of(var), False
            if field is None and var.endswith("_FILE"):
                field, through_file = field_of(var.removesuffix("_FILE")), True
            assert field is not None, f"{var} sets no field of {svc}"
            kind = {f.name: f.type for f in msgspec.structs.fields(cls)}[field]
            value = {str: "x", int: "7", float: "7.5", bool: "true"}.get(kind)
            if value is None:
                continue  # lists and literals: parsing is runtime/settings.py's own test
            if through_file:
                (tmp_path / "value").write_text(value + "\n")
                got = getattr(load_settings(cls, svc, env={var: str(tmp_path / "value")}), field)
            else:
                got = getattr(load_settings(cls, svc, env={var: value}), field)
            assert str(got).lower() == value.lower() or got == type(got)(value), var
    assert "CODERAI_WORKER_CLUSTER_TOKEN_FILE" in envdoc.variables("worker")  # a secret, from a file
    assert "CODERAI_GATEWAY_HOST_FILE" not in envdoc.variables("gateway")
    assert "CODERAI_GATEWAY_PORT" in envdoc.variables("gateway")
    assert "CODERAI_GATEWAY_PORT" not in envdoc.variables("metrics")
    assert "CODERAI_REDIS_URL" in envdoc.variables("metrics")  # the shared name of its redis_url


def test_descriptions_come_from_the_source_comments(envdoc):
    by_name = {f.name: f for f in envdoc.fields(envdoc.settings_class("gateway"), own_only=True)}
    assert "taken for dead" in by_name["idle_timeout_s"].description  # the comment on its line
    assert by_name["max_body_bytes"].default == "`16777216` (`16 * 1024 * 1024`)"
    assert by_name["no_auth"].type == "`bool`" and by_name["no_auth"].default == "`false`"
    assert "nats_url" not in by_name  # CommonSettings' fields have their own table
    router = {f.name: f for f in envdoc.fields(envdoc.settings_class("router"))}
    assert router["policy"].type.count("`") == 6  # the Literal's three choices


def test_check_mode(tmp_path, capsys, envdoc):
    out = tmp_path / "env.md"
    assert envdoc.main(["--output", str(out), "--check"]) == 1
    assert envdoc.main(["--output", str(out)]) == 0
    assert envdoc.main(["--output", str(out), "--check"]) == 0
    assert out.read_text() == envdoc.render()


def test_the_script_checks_docs_env_md_from_any_directory(tmp_path):
    """As developers and CI run it: `python scripts/envdoc.py --check`, wherever they stand."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "envdoc.py"), "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr


def test_the_pod_ledger_prefix_is_one_setting_for_every_service(envdoc):
    text = envdoc.render()
    assert "`CODERAI_POD_LEDGER_PREFIX`" in text
    assert "CODERAI_POD_BROKER_LEDGER_PREFIX" not in text and "CODERAI_GATEWAY_POD_LEDGER_PREFIX" not in text
    for svc in ("gateway", "pod-broker", "metrics"):
        assert "CODERAI_POD_LEDGER_PREFIX" in envdoc.variables(svc)
