"""Pod-broker lifecycle. This release owns the `coderai_pods` bucket and answers status; renting, watching and
reaping RunPod pods under price caps and budgets is the pod-broker issue's work and lands on this shell."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from coderai.contracts import decode
from coderai.contracts.pods import BrokerStatus, BrokerStatusRequest, PodInfo
from coderai.contracts.subjects import CMD_BROKER_STATUS
from coderai.contracts.topology import PODS
from coderai.pod_broker.settings import BrokerSettings
from coderai.runtime.bus import Bus

log = logging.getLogger("coderai.pod_broker")


class Broker:
    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings

    async def start(self, stack: contextlib.AsyncExitStack, stop: asyncio.Event) -> None:
        self.bus = await Bus.connect_as(self.settings, "pod-broker")
        stack.push_async_callback(self.bus.close)
        self.kv = await self.bus.kv(PODS)
        sub = await self.bus.serve(CMD_BROKER_STATUS, self._status, queue="pod-broker")
        stack.push_async_callback(sub.unsubscribe)
        if not self.settings.runpod_api_key:
            log.info("no RunPod API key: models will not escalate to pods")

    async def _status(self, _req: BrokerStatusRequest, _m: Any) -> BrokerStatus:
        pods = []
        try:
            keys = await self.kv.keys()
        except Exception:  # noqa: BLE001 - nats-py raises NoKeysError on an empty bucket
            keys = []
        for key in keys:
            entry = await self.kv.get(key)
            pods.append(decode(entry.value, PodInfo))
        return BrokerStatus(configured=bool(self.settings.runpod_api_key), pods=pods)


def make(settings: BrokerSettings):
    return Broker(settings).start
