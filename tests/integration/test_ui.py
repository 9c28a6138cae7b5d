"""The cluster page (`/ui`) in Debian's headless Chromium against a live stack with two workers: sign in with an
admin key, see both nodes, open a node's log tail, watch it refresh by itself; a wrong key stays on the form."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from coderai.runtime.embedded import NatsServer
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The probe's flags (env notes): without the background-networking ones Chromium keeps dialling out on a closed network.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1440,1000"]
DEADLINE_S = 60


@pytest.fixture(scope="module")
def ui_stack(tmp_path_factory, redis_server, tiny_gguf, keys_file, admin_key):
    """Two workers that both serve `tiny`; `ghost` fits no node (it names one that never joins)."""
    root = tmp_path_factory.mktemp("ui-stack")
    nats = NatsServer(root / "nats").start()
    models = write_models_file(root / "models.toml", [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},
        {"name": "ghost", "engine": "llama", "path": str(tiny_gguf), "nodes": ["nowhere"],
         "pod": {"burst": "when_no_fit", "max_hourly_usd": 2.0, "budget_usd": 20.0}},
    ])
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


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"{' and '.join(missing)} missing: the cluster page test needs Debian's chromium and "
                    "chromium-driver (apt-get install chromium chromium-driver, or scripts/setup llama,dev)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    # An explicit driver path means Selenium Manager is never asked to find (or download) anything.
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, what: str, predicate):
    """WebDriverWait with the test's deadline; the page re-renders every 2 s, so a stale element just means retry."""
    return WebDriverWait(driver, DEADLINE_S, ignored_exceptions=(StaleElementReferenceException,)) \
        .until(predicate, f"the cluster page to show {what} within {DEADLINE_S} s")


def _open_signed_out(driver, stack: Stack) -> None:
    driver.get(f"{stack.http_url}/ui")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{stack.http_url}/ui")
    _wait(driver, "the sign-in form", lambda d: d.find_element(By.ID, "key").is_displayed())


def _sign_in(driver, key: str) -> None:
    field = driver.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "signin-button").click()


def _js(driver, script: str):
    """Read the page in one script call: atomic with respect to its 2-second re-render."""
    return driver.execute_script(script)


def _text(driver, selector: str) -> str:
    return _js(driver, f"return document.querySelector({selector!r})?.textContent || ''")


def _node_ids(driver) -> set[str]:
    return set(_js(driver, "return [...document.querySelectorAll('#nodes .node .node-id')].map(e => e.textContent)"))


def _served(driver) -> int:
    text = _js(driver, "const v = document.querySelector('#stat-served .value'); return v ? v.textContent : ''")
    return int(text.replace(",", "")) if text.replace(",", "").isdigit() else -1


def _click_node(driver, node_id: str) -> bool:
    driver.find_element(By.CSS_SELECTOR, f'#nodes .node[data-node="{node_id}"]').click()
    return True


def _full_page_png(driver) -> bytes:
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 6000), "scale": 1}
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
    return base64.b64decode(shot["data"])


def test_sign_in_shows_both_nodes_and_a_nodes_log_tail(browser, ui_stack, admin_key, artifacts):
    _open_signed_out(browser, ui_stack)
    assert not browser.find_element(By.ID, "dash").is_displayed()  # nothing shows before signing in
    _sign_in(browser, admin_key)

    _wait(browser, "nodes w1 and w2", lambda d: _node_ids(d) >= {"w1", "w2"})
    _wait(browser, "tiny ready on w1", lambda d: "ready" in _text(d, '#nodes .node[data-node="w1"] table'))
    _wait(browser, "ghost listed as unplaced", lambda d: "unplaced" in _text(d, '#models tr[data-model="ghost"]'))
    _wait(browser, "the pods panel", lambda d: "No RunPod API key" in _text(d, "#pods") and "No pods rented" in _text(d, "#pods"))
    _wait(browser, "ghost's pod spend and budget", lambda d: "$20.00 / day" in _text(d, '#spend tr[data-model="ghost"]'))

    # It refreshes by itself: a request made behind its back shows up in the served count.
    before = _served(browser)
    assert before >= 0  # the tile is there
    r = httpx.post(f"{ui_stack.base_url}/chat/completions", headers={"Authorization": f"Bearer {admin_key}"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    _wait(browser, "the served count go up without a reload", lambda d: _served(d) > before)

    _wait(browser, "node w1 clicked", lambda d: _click_node(d, "w1"))
    _wait(browser, "w1's log lines", lambda d: d.find_element(By.ID, "logs-title").text == "Log tail · w1"
                                     and len(d.find_elements(By.CSS_SELECTOR, "#logs .log-line")) > 0)
    assert browser.find_element(By.ID, "logs").text.strip()

    shot = artifacts / "ui.png"
    shot.write_bytes(_full_page_png(browser))
    assert shot.stat().st_size > 10_000
    print(f"cluster page screenshot: {shot}")


def test_a_wrong_key_shows_an_error_and_stays_on_the_form(browser, ui_stack, user_key, artifacts):
    _open_signed_out(browser, ui_stack)
    error = lambda d: d.find_element(By.ID, "signin-error")  # noqa: E731

    _sign_in(browser, "sk-not-a-real-key-0000")
    _wait(browser, "the wrong-key error", lambda d: error(d).is_displayed() and "not accepted" in error(d).text)
    shot = artifacts / "ui-wrong-key.png"
    shot.write_bytes(_full_page_png(browser))
    print(f"wrong-key screenshot: {shot}")
    assert browser.find_element(By.ID, "key").is_displayed()
    assert not browser.find_element(By.ID, "dash").is_displayed()
    assert _js(browser, "return sessionStorage.length") == 0  # a refused key is not kept

    _sign_in(browser, user_key)  # a real key without the admin scope
    _wait(browser, "the missing-scope error", lambda d: error(d).is_displayed() and "admin scope" in error(d).text)
    assert not browser.find_element(By.ID, "dash").is_displayed()
