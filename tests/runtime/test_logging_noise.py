"""Log lines nobody can act on are not written: asyncio's warning each time a TLS connection to NATS closes
(nats-py's protocol returns True from `eof_received`, which asyncio says has no effect under TLS) came twice per
service at every reconnect and stop. Any other asyncio warning still is. In a process of its own, configured as
a service configures itself."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging
from coderai.runtime.logging import setup_logging
setup_logging("gateway", fmt="json")
setup_logging("gateway", fmt="json")  # twice: one filter still
log = logging.getLogger("asyncio")
log.warning("returning true from eof_received() has no effect when using ssl")
log.warning("Task was destroyed but it is pending!")
print(len(log.filters))
"""


def test_the_tls_eof_warning_is_dropped_and_other_asyncio_warnings_are_kept():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert [(x["logger"], x["msg"]) for x in lines] == [("asyncio", "Task was destroyed but it is pending!")]
    assert out.stdout.strip() == "1"
