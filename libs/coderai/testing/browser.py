"""The cluster page in Debian's headless Chromium, for tests: start the browser, sign in, read the page.

Selenium drives `/usr/bin/chromium` through `/usr/bin/chromedriver` (Debian's `chromium` and `chromium-driver`);
an explicit driver path means Selenium Manager is never asked to find or download anything.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The probe's flags (env notes): without the background-networking ones Chromium keeps dialling out on a closed network.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1440,1000",
]
DEADLINE_S = 60


def missing() -> str:
    """Why the browser cannot start here, or '' when it can."""
    gone = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if not gone:
        return ""
    return (
        f"{' and '.join(gone)} missing: the cluster page tests need Debian's chromium and chromium-driver "
        "(apt-get install chromium chromium-driver, or scripts/setup llama,dev)"
    )


@contextlib.contextmanager
def chromium(profile_dir: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile_dir}")
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, what: str, predicate: Callable[[Any], Any], deadline_s: float = DEADLINE_S) -> Any:
    """WebDriverWait with a deadline; the page re-renders every 2 s, so a stale element just means retry."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, deadline_s, ignored_exceptions=(StaleElementReferenceException,)).until(
        predicate, f"the cluster page to show {what} within {deadline_s} s"
    )


def open_signed_out(driver, http_url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{http_url}/ui")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{http_url}/ui")
    wait(driver, "the sign-in form", lambda d: d.find_element(By.ID, "key").is_displayed())


def sign_in(driver, key: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, "key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.ID, "signin-button").click()


def js(driver, script: str) -> Any:
    """Read the page in one script call: atomic with respect to its 2-second re-render."""
    return driver.execute_script(script)


def text(driver, selector: str) -> str:
    return js(driver, f"return document.querySelector({selector!r})?.textContent || ''")


def full_page_png(driver) -> bytes:
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 6000), "scale": 1}
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    return base64.b64decode(shot["data"])
