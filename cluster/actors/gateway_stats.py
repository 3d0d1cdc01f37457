"""Each gateway replica's routing numbers, published for `status`: decisions by reason, lookup latency.

Every gateway replica writes its own key (store/keys.py: mlxf:gateway:<id>,
expiring), every `period_s`, from a background task; status sums them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Optional

import msgpack

from cluster.store.keys import gateway_key

log = logging.getLogger(__name__)


class GatewayStats:
    def __init__(self, client, router, period_s: float = 2.0):
        self.client = client
        self.router = router
        self.period_s = period_s
        self.id = f"{socket.gethostname().split('.')[0]}-{os.getpid()}"
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        if self.client is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._publish_forever())

    async def _publish_forever(self) -> None:
        while True:
            try:
                payload = {"gateway": self.id, **self.router.stats()}
                await self.client.set(gateway_key(self.id), msgpack.packb(payload), px=int(self.period_s * 3000))
            except Exception as e:  # status shows less; routing is unaffected
                log.debug("could not publish gateway stats: %s", e)
            await asyncio.sleep(self.period_s)
