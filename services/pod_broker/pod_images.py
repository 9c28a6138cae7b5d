"""Which image a rented pod runs: the model's `pod.image` or the broker's `pod_image`, and, with a trusted key set,
pinned to the digest its signature covers (coderai.image_trust), so the pod pulls exactly what was checked; an
image that does not check is refused. A refusal is remembered for RECHECK_S: a warm floor asks every round, and
the registry is asked less often."""

from __future__ import annotations

import asyncio
import logging
import time

from coderai.contracts import BusError, ModelConfig
from coderai.pod_broker.settings import BrokerSettings
from coderai.runtime.settings import SettingsError

log = logging.getLogger("coderai.pod_broker")

RECHECK_S = 30.0  # an image whose signature was refused is refused again without asking, for this long


def check_trust_settings(settings: BrokerSettings) -> None:
    """A SettingsError, at start, for a pod image key that cannot be used: every pod would be refused."""
    if settings.pod_image_key:
        from coderai.image_trust import Untrusted, check_settings

        try:
            check_settings(settings.pod_image_key, settings.pod_image_sigstore)
        except Untrusted as exc:
            raise SettingsError(f"CODERAI_POD_BROKER_POD_IMAGE_KEY: {exc}") from None


class PodImages:
    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        self._refused: dict[str, tuple[str, float]] = {}  # image -> (why its signature was refused, when)

    async def for_model(self, m: ModelConfig) -> str:
        """The image a pod for `m` runs (see the module docstring); BusError no_engine when it is refused."""
        s = self.settings
        image = m.pod.image or s.pod_image
        if not s.pod_image_key:
            return image
        from coderai.image_trust import Trust, Untrusted, verify

        why, when = self._refused.get(image, ("", 0.0))
        if not why or time.monotonic() - when >= RECHECK_S:
            try:
                pinned = await asyncio.to_thread(
                    verify, image, Trust(s.pod_image_key, s.pod_image_sigstore, s.pod_image_registry_url)
                )
            except Untrusted as exc:
                if why != str(exc):
                    log.error("no pod runs %s: %s", image, exc)
                why = str(exc)
                self._refused[image] = (why, time.monotonic())
            else:
                self._refused.pop(image, None)
                return pinned
        raise BusError("no_engine", f"cannot rent a pod for {m.name!r}: its image is refused: {why}")
