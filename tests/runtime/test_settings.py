"""Settings: overrides > service env var > shared env var > TOML [service] > TOML top level > default."""

from __future__ import annotations

import msgspec
import pytest

from coderai.runtime.settings import CommonSettings, SettingsError, describe, load_settings


class GwSettings(CommonSettings, frozen=True, kw_only=True):
    port: int = 8000
    host: str = "127.0.0.1"
    debug: bool = False
    ratio: float = 0.5
    origins: list[str] = []
    ports: list[int] = []
    labels: dict[str, str] = {}
    api_token: str = ""
    client_secret: str = ""
    db_password: str = ""
    admin_key_hash: str = ""


class Needy(CommonSettings, frozen=True, kw_only=True):
    required_thing: str


def load(env: dict[str, str], service: str = "gateway", cls=GwSettings, **overrides) -> GwSettings:
    return load_settings(cls, service, env=env, **overrides)


def toml(tmp_path, text: str) -> str:
    p = tmp_path / "coderai.toml"
    p.write_text(text)
    return str(p)


def test_defaults_with_an_empty_env():
    s = load({})
    assert s == GwSettings()
    assert (s.nats_url, s.log_level, s.port, s.origins) == ("", "INFO", 8000, [])  # "": the local default or mDNS


def test_the_explicit_env_mapping_is_used_not_the_process_env(monkeypatch):
    monkeypatch.setenv("CODERAI_GATEWAY_PORT", "1111")
    assert load({}).port == 8000
    assert load({"CODERAI_GATEWAY_PORT": "2222"}).port == 2222


def test_a_shared_var_serves_every_service():
    env = {"CODERAI_NATS_URL": "nats://10.0.0.1:4222", "CODERAI_PORT": "9000"}
    assert load(env).nats_url == "nats://10.0.0.1:4222"
    assert load(env, service="router").port == 9000


def test_the_service_var_beats_the_shared_var():
    env = {"CODERAI_PORT": "9000", "CODERAI_GATEWAY_PORT": "8080", "CODERAI_ROUTER_PORT": "7070"}
    assert load(env).port == 8080
    assert load(env, service="router").port == 7070
    assert load(env, service="metrics").port == 9000


def test_a_hyphenated_service_uses_underscores_in_var_names_and_toml(tmp_path):
    cfg = toml(tmp_path, '[pod_broker]\nhost = "0.0.0.0"\n')
    s = load({"CODERAI_POD_BROKER_PORT": "7000", "CODERAI_CONFIG": cfg}, service="pod-broker")
    assert (s.port, s.host) == (7000, "0.0.0.0")


def test_toml_section_beats_top_level_and_both_beat_defaults(tmp_path):
    cfg = toml(
        tmp_path, 'port = 1000\nhost = "top"\nlog_level = "DEBUG"\n\n[gateway]\nport = 2000\n\n[router]\nport = 3000\n'
    )
    s = load({"CODERAI_CONFIG": cfg})
    assert (s.port, s.host, s.log_level) == (2000, "top", "DEBUG")
    assert load({"CODERAI_CONFIG": cfg}, service="router").port == 3000
    assert load({"CODERAI_CONFIG": cfg}, service="metrics").port == 1000


def test_toml_holds_typed_values(tmp_path):
    cfg = toml(tmp_path, '[gateway]\ndebug = true\nratio = 0.25\norigins = ["a", "b"]\nlabels = { team = "x" }\n')
    s = load({"CODERAI_CONFIG": cfg})
    assert (s.debug, s.ratio, s.origins, s.labels) == (True, 0.25, ["a", "b"], {"team": "x"})


def test_env_beats_toml(tmp_path):
    cfg = toml(tmp_path, 'port = 1000\n[gateway]\nhost = "from-toml"\n')
    env = {"CODERAI_CONFIG": cfg, "CODERAI_PORT": "5000", "CODERAI_GATEWAY_HOST": "from-env"}
    s = load(env)
    assert (s.port, s.host) == (5000, "from-env")


def test_toml_path_is_home_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    toml(tmp_path, "port = 4321\n")
    assert load({"CODERAI_CONFIG": "~/coderai.toml"}).port == 4321


def test_unknown_toml_keys_are_ignored(tmp_path):
    cfg = toml(tmp_path, 'colour = "red"\n[gateway]\nshape = "round"\nport = 1\n[other]\nx = 1\n')
    assert load({"CODERAI_CONFIG": cfg}).port == 1


def test_overrides_beat_env_and_none_overrides_are_ignored():
    env = {"CODERAI_GATEWAY_PORT": "8080", "CODERAI_GATEWAY_HOST": "env-host"}
    s = load(env, port=9999, host=None)
    assert (s.port, s.host) == (9999, "env-host")


def test_overrides_beat_toml(tmp_path):
    cfg = toml(tmp_path, "[gateway]\nport = 1000\n")
    assert load({"CODERAI_CONFIG": cfg}, port=3).port == 3


@pytest.mark.parametrize(
    "raw, want",
    [
        ("a,b,c", ["a", "b", "c"]),
        (" a , b ,, ", ["a", "b"]),
        ("single", ["single"]),
        ("", []),
        ('["x,y", "z"]', ["x,y", "z"]),
        ('  ["j"]', ["j"]),
    ],
)
def test_list_fields_from_commas_or_json(raw, want):
    assert load({"CODERAI_GATEWAY_ORIGINS": raw}).origins == want


def test_list_items_are_converted_to_the_item_type():
    assert load({"CODERAI_GATEWAY_PORTS": "1, 2,3"}).ports == [1, 2, 3]
    assert load({"CODERAI_GATEWAY_PORTS": "[4, 5]"}).ports == [4, 5]


def test_dict_fields_from_json():
    assert load({"CODERAI_GATEWAY_LABELS": '{"a": "1"}'}).labels == {"a": "1"}


@pytest.mark.parametrize("raw", ["[1,", "{nope"])
def test_bad_json_names_the_variable(raw):
    var = "CODERAI_GATEWAY_LABELS" if raw.startswith("{") else "CODERAI_GATEWAY_ORIGINS"
    with pytest.raises(SettingsError) as ei:
        load({var: raw})
    assert str(ei.value).startswith(f"{var}: ")


@pytest.mark.parametrize(
    "raw, want",
    [("true", True), ("True", True), ("TRUE", True), ("1", True), ("false", False), ("False", False), ("0", False)],
)
def test_bool_strings_msgspec_accepts(raw, want):
    assert load({"CODERAI_GATEWAY_DEBUG": raw}).debug is want


@pytest.mark.parametrize("raw", ["yes", "no", "on", "off", "2", ""])
def test_other_bool_strings_are_rejected_naming_the_variable(raw):
    with pytest.raises(SettingsError) as ei:
        load({"CODERAI_GATEWAY_DEBUG": raw})
    assert "CODERAI_GATEWAY_DEBUG" in str(ei.value)


def test_numbers_parse_from_strings():
    s = load({"CODERAI_GATEWAY_PORT": "8081", "CODERAI_GATEWAY_RATIO": "0.75"})
    assert (s.port, s.ratio) == (8081, 0.75)


@pytest.mark.parametrize("raw", ["abc", "8.5", "", "80 80"])
def test_a_bad_int_names_the_variable(raw):
    with pytest.raises(SettingsError) as ei:
        load({"CODERAI_GATEWAY_PORT": raw})
    assert "CODERAI_GATEWAY_PORT" in str(ei.value)
    assert "int" in str(ei.value)


@pytest.mark.parametrize("source", ["shared", "toml"])
def test_a_bad_value_names_where_it_came_from(tmp_path, source):
    if source == "shared":
        env, where = {"CODERAI_PORT": "abc"}, "CODERAI_PORT: "
    else:
        cfg = toml(tmp_path, '[gateway]\nport = "abc"\n')
        env, where = {"CODERAI_CONFIG": cfg}, f"{cfg} [gateway] port: "
    with pytest.raises(SettingsError) as ei:
        load(env)
    assert str(ei.value).startswith(where)


def test_a_bad_override_is_a_settings_error():
    with pytest.raises(SettingsError) as ei:
        load({}, port="not-a-port")
    assert "port" in str(ei.value)


def test_an_unknown_override_is_a_settings_error():
    with pytest.raises(SettingsError) as ei:
        load({}, bogus=1)
    assert "bogus" in str(ei.value)


def test_a_missing_required_field_is_a_settings_error():
    with pytest.raises(SettingsError) as ei:
        load({}, cls=Needy)
    assert "required_thing" in str(ei.value)
    assert load({"CODERAI_GATEWAY_REQUIRED_THING": "x"}, cls=Needy).required_thing == "x"


def test_a_missing_config_file_names_coderai_config(tmp_path):
    path = str(tmp_path / "absent.toml")
    with pytest.raises(SettingsError) as ei:
        load({"CODERAI_CONFIG": path})
    assert str(ei.value).startswith(f"CODERAI_CONFIG={path}: ")


def test_bad_toml_names_coderai_config(tmp_path):
    cfg = toml(tmp_path, "[gateway\nport = ")
    with pytest.raises(SettingsError) as ei:
        load({"CODERAI_CONFIG": cfg})
    assert str(ei.value).startswith(f"CODERAI_CONFIG={cfg}: ")


def test_an_empty_config_var_means_no_file():
    assert load({"CODERAI_CONFIG": ""}) == GwSettings()


def test_settings_are_frozen():
    s = load({})
    with pytest.raises(AttributeError):
        s.port = 1


def test_describe_masks_secrets_that_are_set():
    s = load({}, api_token="t0k", client_secret="s3c", db_password="pw", admin_key_hash="h", host="h1")
    d = describe(s)
    assert (d["api_token"], d["client_secret"], d["db_password"], d["admin_key_hash"]) == ("***", "***", "***", "***")
    assert d["host"] == "h1" and d["port"] == 8000 and d["nats_url"] == ""
    assert set(d) == set(GwSettings.__struct_fields__)
    assert s.api_token == "t0k"  # describe() does not touch the settings themselves


def test_describe_leaves_empty_secrets_visible_as_empty():
    d = describe(load({}))
    assert (d["api_token"], d["client_secret"], d["db_password"]) == ("", "", "")


def test_describe_works_on_plain_structs():
    class Other(msgspec.Struct):
        password: str = "p"
        name: str = "n"

    assert describe(Other()) == {"password": "***", "name": "n"}


def test_describe_masks_every_password_of_a_url_over_several_hosts():
    """A Sentinel URL (one password over several hosts) and a NATS URL listing every head (a password on each):
    the start-up line shows none of them, and a service does not crash building it."""
    from coderai.runtime.logging import redact

    class S(CommonSettings, frozen=True, kw_only=True):
        redis_url: str = ""

    secrets = ("pass-one", "pass-two", "redis-pass", "sentinel-pass")  # redact() takes secrets of 6 or more
    s = S(
        nats_url=f"nats://service:{secrets[0]}@h1:4222,nats://service:{secrets[1]}@h2:4222",
        redis_url=f"redis+sentinel://:{secrets[2]}@a:26379,b:26379/coderai?sentinel_password={secrets[3]}",
    )
    d = describe(s)
    assert d["nats_url"] == "nats://service:***@h1:4222,nats://service:***@h2:4222"
    assert d["redis_url"] == "redis+sentinel://:***@a:26379,b:26379/coderai?sentinel_password=***"
    assert all(redact(f"x {secret} y") == "x *** y" for secret in secrets)


# --- secrets from files: CODERAI_..._FILE -------------------------------------------------------------------------


def secret_file(tmp_path, text: str, name: str = "secret") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_a_secret_comes_from_the_file_its_file_variable_names(tmp_path):
    """As Docker's and systemd's secrets are handed over: the value is not in the environment (which `docker
    inspect` prints), only the file's path; the line end an editor or `echo` leaves is not part of it."""
    path = secret_file(tmp_path, "t0ken-from-a-file\n")
    s = load({"CODERAI_CLUSTER_TOKEN_FILE": path, "CODERAI_GATEWAY_API_TOKEN_FILE": path})
    assert s.cluster_token == "t0ken-from-a-file" and s.api_token == "t0ken-from-a-file"
    assert describe(s)["cluster_token"] == "***"


def test_a_url_may_come_from_a_file_and_its_password_stays_masked(tmp_path):
    path = secret_file(tmp_path, "nats://svc:s3cret-pass@head:4222\n")
    s = load({"CODERAI_NATS_URL_FILE": path})
    assert s.nats_url == "nats://svc:s3cret-pass@head:4222"
    assert "s3cret-pass" not in describe(s)["nats_url"]


def test_a_file_variable_keeps_its_place_in_the_order(tmp_path):
    """The service's own name beats the shared one, value or file alike."""
    shared, own = secret_file(tmp_path, "shared", "a"), secret_file(tmp_path, "own", "b")
    assert load({"CODERAI_CLUSTER_TOKEN_FILE": shared, "CODERAI_GATEWAY_CLUSTER_TOKEN": "direct"}).cluster_token == (
        "direct"
    )
    assert load({"CODERAI_CLUSTER_TOKEN": "direct", "CODERAI_GATEWAY_CLUSTER_TOKEN_FILE": own}).cluster_token == "own"
    assert load({"CODERAI_CLUSTER_TOKEN_FILE": shared}, service="router").cluster_token == "shared"


def test_a_value_and_its_file_both_set_is_an_error(tmp_path):
    with pytest.raises(SettingsError, match="CODERAI_CLUSTER_TOKEN and CODERAI_CLUSTER_TOKEN_FILE are both set"):
        load({"CODERAI_CLUSTER_TOKEN": "x" * 20, "CODERAI_CLUSTER_TOKEN_FILE": secret_file(tmp_path, "y" * 20)})


def test_an_empty_file_variable_is_as_if_unset(tmp_path):
    """compose hands `${RUNPOD_API_KEY_FILE:+/run/secrets/...}` over as "" when no file is given: the setting keeps
    its default (and its plain variable still counts), it is not a read of the current folder."""
    assert load({"CODERAI_DB_PASSWORD_FILE": ""}).db_password == ""
    assert load({"CODERAI_DB_PASSWORD_FILE": "", "CODERAI_DB_PASSWORD": "pw"}).db_password == "pw"


@pytest.mark.parametrize("what", ["missing", "empty", "a folder"])
def test_an_unreadable_or_empty_file_names_its_variable_never_a_value(tmp_path, what):
    path = {"missing": str(tmp_path / "absent"), "empty": secret_file(tmp_path, "\n"), "a folder": str(tmp_path)}[what]
    with pytest.raises(SettingsError) as ei:
        load({"CODERAI_DB_PASSWORD_FILE": path})
    assert str(ei.value).startswith(f"CODERAI_DB_PASSWORD_FILE={path}: ")


def test_only_secrets_and_urls_come_from_files(tmp_path):
    """A port, a host or a path setting is given as itself: `CODERAI_HOST_FILE` is not a variable, and a field that
    is a path already (`nats_password_file`) is not read through another file."""
    from coderai.runtime.settings import file_settable

    path = secret_file(tmp_path, "10.0.0.1")
    assert load({"CODERAI_HOST_FILE": path}).host == "127.0.0.1"
    assert load({"CODERAI_NATS_PASSWORD_FILE": path}).nats_password_file == path  # the field itself
    assert not file_settable(GwSettings, "port") and not file_settable(GwSettings, "nats_password_file")
    assert file_settable(GwSettings, "db_password") and file_settable(GwSettings, "nats_url")


def test_coderai_up_reads_its_token_from_the_file_too(tmp_path, monkeypatch, capsys):
    """`coderai up` and `coderai heads invite` read the token outside a settings struct: the same two ways."""
    from coderai.stack.plan import parse_args

    monkeypatch.delenv("CODERAI_CLUSTER_TOKEN", raising=False)
    monkeypatch.setenv("CODERAI_CLUSTER_TOKEN_FILE", secret_file(tmp_path, "a-token-from-its-file\n"))
    assert parse_args([]).cluster_token == "a-token-from-its-file"
    assert parse_args(["--cluster-token", "the-flag-wins"]).cluster_token == "the-flag-wins"
    monkeypatch.setenv("CODERAI_CLUSTER_TOKEN", "and-one-in-the-environment")
    with pytest.raises(SystemExit) as ei:
        parse_args([])
    assert ei.value.code == 2 and "both set" in capsys.readouterr().err
    monkeypatch.delenv("CODERAI_CLUSTER_TOKEN_FILE")
    assert parse_args([]).cluster_token == "and-one-in-the-environment"


def test_coderai_up_hands_its_children_no_token_file_and_its_own_values_win(monkeypatch):
    """`coderai up` gives each child what it needs itself; a token file in up's environment goes to no child (the
    token is the scheduler's alone), and a value up sets wins over a file of the same variable from outside,
    which the child would otherwise refuse to choose between."""
    from coderai.stack.children import SECRET_ENV, given_wins

    env = {
        "CODERAI_CLUSTER_TOKEN": "given-to-the-scheduler",
        "CODERAI_CLUSTER_TOKEN_FILE": "/run/secrets/token",
        "CODERAI_GATEWAY_REDIS_URL_FILE": "/run/secrets/redis",
        "CODERAI_SCHEDULER_MODELS_FILE": "/etc/models.toml",  # a path setting, not a value's file
    }
    assert given_wins(env) == {
        "CODERAI_CLUSTER_TOKEN": "given-to-the-scheduler",
        "CODERAI_GATEWAY_REDIS_URL_FILE": "/run/secrets/redis",
        "CODERAI_SCHEDULER_MODELS_FILE": "/etc/models.toml",
    }
    assert "CODERAI_CLUSTER_TOKEN" in SECRET_ENV


def test_no_child_of_coderai_up_inherits_the_token_or_its_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from coderai.stack.children import common_env

    monkeypatch.setenv("CODERAI_CLUSTER_TOKEN_FILE", "/run/secrets/token")
    monkeypatch.setenv("CODERAI_POD_BROKER_RUNPOD_API_KEY_FILE", "/run/secrets/runpod")
    monkeypatch.setenv("CODERAI_LOG_LEVEL", "DEBUG")  # what is not a secret is handed on
    plan = SimpleNamespace(data=tmp_path, metrics_port=9464, worker_id="n1", tls=None, me=None, redis_password="pw")
    servers = SimpleNamespace(
        redis_url=lambda pw: f"redis://:{pw}@127.0.0.1:6379/0",
        started_nats=SimpleNamespace(url="nats://127.0.0.1:4222"),
    )
    env = common_env(plan, servers)  # type: ignore[arg-type]  # stand-ins with what it reads
    assert "CODERAI_CLUSTER_TOKEN_FILE" not in env and "CODERAI_POD_BROKER_RUNPOD_API_KEY_FILE" not in env
    assert env["CODERAI_LOG_LEVEL"] == "DEBUG"
