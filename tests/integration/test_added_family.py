"""Adding an engine family is its declaration and its engine, nothing else: a family from outside the package,
named in `CODERAI_FAMILIES` (contracts/families.py), is listed, placed, started and served by an unchanged stack,
its params checked by its own table. Real services over a real, secured NATS; the OpenAI SDK as the client."""

from __future__ import annotations

import os
import textwrap

import httpx
import openai
import pytest

from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

DECLARATION = """
from coderai.contracts.families import FamilySpec
from coderai.contracts.params import P

FAMILY = FamilySpec("shout", "shout_engine:ShoutEngine", "shout_engine", ("chat",), device="cpu",
                    params={"suffix": P("str", size=8)})
"""

ENGINE = '''
from coderai.contracts import Choice, Usage
from coderai.engine_worker.engines.base import Engine


class ShoutEngine(Engine):
    """Answers a chat with its last user message in capitals and its `suffix`."""

    family = "shout"
    blocking = False

    def load(self):
        self.suffix = str(self.config.params.get("suffix") or "!")

    def chat(self, job, cancel, emit):
        text = str(job.messages[-1]["content"]).upper() + self.suffix
        usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        if emit is not None:
            emit({"role": "assistant"}, None, None)
            emit({"content": text}, None, None)
            emit(None, None, "stop")
            return [], usage
        return [Choice(index=0, message={"role": "assistant", "content": text}, finish_reason="stop")], usage
'''


def test_a_family_declared_outside_the_package_is_listed_placed_started_and_served(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "shout_family.py").write_text(textwrap.dedent(DECLARATION))
    (plugins / "shout_engine.py").write_text(textwrap.dedent(ENGINE))
    env = {
        "CODERAI_FAMILIES": "shout_family",
        "CODERAI_WORKER_FAMILIES": "shout",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH", "")])),
    }
    models = [{"name": "loud", "engine": "shout", "path": "-", "params": {"suffix": "!!"}}]
    with running_stack(tmp_path / "stack", models, extra_env=env, gateway_args=("--no-auth",)) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
        assert "loud" in [m.id for m in client.models.list()]  # listed
        nodes = httpx.get(f"{stack.http_url}/admin/nodes", timeout=10).json()["nodes"]
        engines = [e for n in nodes for e in n["heartbeat"].get("engines", []) if e["model"] == "loud"]
        print(f"the added family's engines: {engines}")
        assert [e["state"] for e in engines] == ["ready"]  # placed on the worker and started there
        answer = client.chat.completions.create(model="loud", messages=[{"role": "user", "content": "hello"}])
        assert answer.choices[0].message.content == "HELLO!!"  # served, with its own param
        stream = client.chat.completions.create(
            model="loud", messages=[{"role": "user", "content": "again"}], stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "AGAIN!!"
        # its params are checked by its own table, as a built-in family's are: one it does not take is refused
        bad = httpx.post(
            f"{stack.http_url}/admin/models",
            timeout=10,
            json={"name": "louder", "engine": "shout", "path": "-", "params": {"volume": 11}},
        )
        print(f"a param the family does not take: {bad.status_code} {bad.text}")
        assert bad.status_code == 400 and "volume" in bad.text
