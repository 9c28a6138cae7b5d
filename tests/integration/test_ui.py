"""The cluster page (`/ui`) in Debian's headless Chromium against a live stack with two workers: sign in with an
admin key, see both nodes and where each copy runs (device, memory, idle time), open a node's log tail, watch it
refresh by itself; a wrong key stays on the form."""

from __future__ import annotations

import re

import httpx
import pytest
from selenium.webdriver.common.by import By

from coderai.runtime.embedded import NatsServer
from coderai.testing.browser import full_page_png, js, open_signed_out, sign_in, text, wait
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ui_stack(tmp_path_factory, redis_server, tiny_gguf, keys_file, admin_key):
    """Two workers that both serve `tiny`; `ghost` fits no node (it names one that never joins)."""
    root = tmp_path_factory.mktemp("ui-stack")
    models = write_models_file(
        root / "models.toml",
        [
            {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},
            {
                "name": "ghost",
                "engine": "llama",
                "path": str(tiny_gguf),
                "nodes": ["nowhere"],
                "pod": {"burst": "when_no_fit", "max_hourly_usd": 2.0, "budget_usd": 20.0},
            },
        ],
    )
    nats = NatsServer(root / "nats").start()  # last: nothing that can fail runs before the `try` below
    stack = Stack(root, nats.url, redis_server.url)
    try:
        stack.start_core(models)
        stack.start_worker("w1")
        stack.start_worker("w2")
        # a broker without a RunPod key: it answers for the pods panel, and rents nothing
        stack.start("pod-broker", "coderai.pod_broker", env={"CODERAI_POD_BROKER_REDIS_URL": redis_server.url})
        # Redis lets the gateway answer /admin/usage (the metrics service writes the rows there).
        stack.start_gateway("--api-keys-file", str(keys_file), env={"CODERAI_GATEWAY_REDIS_URL": redis_server.url})
        stack.wait_model_ready("tiny", headers={"Authorization": f"Bearer {admin_key}"})
        yield stack
    finally:
        stack.stop()
        nats.stop()


def _node_ids(driver) -> set[str]:
    return set(js(driver, "return [...document.querySelectorAll('#nodes .node .node-id')].map(e => e.textContent)"))


def _served(driver) -> int:
    shown = js(
        driver, "const v = document.querySelector('#stat-served .value'); return v ? v.textContent : ''"
    ).replace(",", "")
    return int(shown) if shown.isdigit() else -1


def _engine_cells(driver, node_id: str, model: str) -> dict[str, str]:
    """The node card's row for `model`, by column heading."""
    return js(
        driver,
        f"""
        const table = document.querySelector('#nodes .node[data-node="{node_id}"] table');
        if (!table) return {{}};
        const heads = [...table.querySelectorAll('thead th')].map(th => th.textContent);
        const row = [...table.querySelectorAll('tbody tr')].find(tr => tr.cells[0].textContent === '{model}');
        return row ? Object.fromEntries(heads.map((h, i) => [h, row.cells[i].textContent])) : {{}};""",
    )


def _click_node(driver, node_id: str) -> bool:
    driver.find_element(By.CSS_SELECTOR, f'#nodes .node[data-node="{node_id}"]').click()
    return True


def test_sign_in_shows_both_nodes_and_a_nodes_log_tail(browser, ui_stack, admin_key, artifacts):
    open_signed_out(browser, ui_stack.http_url)
    assert not browser.find_element(By.ID, "dash").is_displayed()  # nothing shows before signing in
    sign_in(browser, admin_key)

    wait(browser, "nodes w1 and w2", lambda d: _node_ids(d) >= {"w1", "w2"})
    wait(browser, "tiny ready on w1", lambda d: "ready" in text(d, '#nodes .node[data-node="w1"] table'))
    # where the copy is (a node without GPUs: the CPU), what it was placed for, and how long it has been idle
    wait(
        browser,
        "tiny's device, memory and idle time",
        lambda d: re.fullmatch(
            r"cpu \| [\d.]+ (KiB|MiB|GiB) \| (\d+ s|\d+ min|busy)",
            " | ".join(_engine_cells(d, "w1", "tiny").get(k, "") for k in ("Device", "Memory", "Idle")),
        ),
    )
    assert "w1 · ready · cpu" in text(browser, '#models tr[data-model="tiny"]')
    wait(browser, "ghost listed as unplaced", lambda d: "unplaced" in text(d, '#models tr[data-model="ghost"]'))
    wait(
        browser,
        "the pods panel",
        lambda d: "No RunPod API key" in text(d, "#pods") and "No pods rented" in text(d, "#pods"),
    )
    wait(browser, "ghost's pod spend and budget", lambda d: "$20.00 / day" in text(d, '#spend tr[data-model="ghost"]'))

    # It refreshes by itself: a request made behind its back shows up in the served count.
    before = _served(browser)
    assert before >= 0  # the tile is there
    r = httpx.post(
        f"{ui_stack.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {admin_key}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200
    wait(browser, "the served count go up without a reload", lambda d: _served(d) > before)

    wait(browser, "node w1 clicked", lambda d: _click_node(d, "w1"))
    wait(
        browser,
        "w1's log lines",
        lambda d: (
            d.find_element(By.ID, "logs-title").text == "Log tail · w1"
            and len(d.find_elements(By.CSS_SELECTOR, "#logs .log-line")) > 0
        ),
    )
    assert browser.find_element(By.ID, "logs").text.strip()

    shot = artifacts / "ui.png"
    shot.write_bytes(full_page_png(browser))
    assert shot.stat().st_size > 10_000
    print(f"cluster page screenshot: {shot}")


def test_a_wrong_key_shows_an_error_and_stays_on_the_form(browser, ui_stack, user_key, artifacts):
    open_signed_out(browser, ui_stack.http_url)
    error = lambda d: d.find_element(By.ID, "signin-error")

    sign_in(browser, "sk-not-a-real-key-0000")
    wait(browser, "the wrong-key error", lambda d: error(d).is_displayed() and "not accepted" in error(d).text)
    shot = artifacts / "ui-wrong-key.png"
    shot.write_bytes(full_page_png(browser))
    print(f"wrong-key screenshot: {shot}")
    assert browser.find_element(By.ID, "key").is_displayed()
    assert not browser.find_element(By.ID, "dash").is_displayed()
    assert js(browser, "return sessionStorage.length") == 0  # a refused key is not kept

    sign_in(browser, user_key)  # a real key without the admin scope
    wait(browser, "the missing-scope error", lambda d: error(d).is_displayed() and "admin scope" in error(d).text)
    assert not browser.find_element(By.ID, "dash").is_displayed()
