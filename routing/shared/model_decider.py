"""Which gateway process decides fleet model placement, and what the others tell it.

With shared state every process builds the model actor (routing/models_actor), but only one
decides and acts at a time: the holder of the lease `<prefix>models:decider`, a key holding
its process id, taken with `SET NX PX` and renewed by its holder every tick in one
compare-and-set script (a process never renews nor deletes another's lease). A holder that
dies stops renewing; the key expires `ttl` seconds (a few health intervals) after its last
renewal, and the next process to claim it decides from then on. A process counts itself the
holder only until `ttl` after it *sent* its last successful claim, before Redis's own expiry:
cut off from Redis, it stops deciding by itself before another may take over. While Redis
cannot be reached no process decides, and that is logged once.

The processes talk over one pub/sub channel, `<prefix>models`, in JSON:

- `wanted`: a process's requests waiting for a model loaded nowhere, as a count, sent when it
  changes and again every tick while not zero (pub/sub drops messages while a connection is
  down, and a new holder has heard nothing before it took the lease). The decider counts
  them as waiting for `ttl` after it heard them, so a dead process's demand fades.
- `loaded`: the decider saw a load end; a process with requests waiting for that model reads
  that host once, at once, and its waiters go on when its own reading shows the model loaded.
- `failed`: the decider's load failed; the waiters of every process hear the host's words.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Protocol

from routing.shared.state import UNREACHABLE, Shared, StateUnavailable
from routing.shared.tasks import Tasks

__all__ = ["DeciderLease", "Heard", "ModelDecider"]

log = logging.getLogger("crossbar.models")


class DeciderLease:
    """The lease `<prefix>models:decider`. Use it on one event loop."""

    def __init__(self, shared: Shared, ttl: float) -> None:
        self.proc = shared.proc
        self.ttl = ttl
        self._loop = asyncio.get_running_loop()
        self._until = 0.0  # loop time up to which this process holds it, as far as it knows
        self._claim = shared.script(_CLAIM)
        self._release = shared.script(_RELEASE)

    def holds(self) -> bool:
        """Whether this process holds the lease now."""
        return self._loop.time() < self._until

    async def claim(self) -> bool:
        """Take the lease when nobody holds it, or renew it when this process does; whether
        this process holds it now. Never raises: Redis away is `False` once the lease's time
        since the last claim that went through is up."""
        sent = self._loop.time()
        try:
            won = await self._claim(self.proc, int(self.ttl * 1000))
        except StateUnavailable:
            return self.holds()
        self._until = sent + self.ttl if won else 0.0
        return bool(won)

    async def release(self) -> None:
        """Give the lease up when this process holds it (a stopping process: another takes
        it at once rather than after `ttl`). Never raises."""
        self._until = 0.0
        try:
            await self._release(self.proc)
        except StateUnavailable:
            pass  # it expires by itself


class Heard(Protocol):
    """What the model actor hears from the other processes."""

    def elected(self) -> None: ...
    def wanted(self) -> None: ...
    def loaded(self, host: str, model: str) -> None: ...
    def failed(self, host: str, model: str, message: str) -> None: ...


class ModelDecider:
    """This process's part in deciding: the lease, claimed every tick, and the channel.
    Use it on one event loop."""

    def __init__(self, shared: Shared, ttl: float) -> None:
        self._shared = shared
        self._heard: Heard | None = None
        self.lease = DeciderLease(shared, ttl)
        self._channel = f"{shared.prefix}models"
        self._mine: dict[str, int] = {}  # this process's requests waiting for a load, by model
        self._elsewhere: dict[tuple[str, str], tuple[int, float]] = {}  # (proc, model): n, at
        self._tasks = Tasks()
        self._running: list[asyncio.Task[None]] = []
        self._stopping = False
        self._said_away = False

    def deciding(self) -> bool:
        """Whether this process decides now (it holds the lease)."""
        return self.lease.holds()

    def reachable(self) -> bool:
        """Whether Redis answered last: else no process decides, and nothing waits for one."""
        return self._shared.available

    async def start(self, heard: Heard) -> None:
        """Claim the lease now, then every tick, and listen on the channel, telling `heard`
        what comes in. Never raises."""
        if not self._running:
            self._heard = heard
            await self._claim()
            self._running = [
                asyncio.create_task(self._claim_forever(), name="crossbar-model-decider"),
                asyncio.create_task(self._listen_forever(), name="crossbar-model-channel"),
            ]

    async def aclose(self) -> None:
        self._stopping = True
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        await self._tasks.aclose()
        if self.lease.holds():
            await self.lease.release()

    def waiting_elsewhere(self, model: str) -> int:
        """The requests other processes said lately are waiting for `model` to load."""
        since = asyncio.get_running_loop().time() - self.lease.ttl
        return sum(n for (_, m), (n, at) in self._elsewhere.items() if m == model and at > since)

    def want(self, model: str, waiting: int) -> None:
        """This process's requests waiting for `model` to load are `waiting` now."""
        if waiting:
            self._mine[model] = waiting
        else:
            self._mine.pop(model, None)
        self._publish({"wanted": model, "waiting": waiting})

    def tell_loaded(self, host: str, model: str) -> None:
        self._publish({"loaded": model, "host": host})

    def tell_failed(self, host: str, model: str, message: str) -> None:
        """The load of `model` failed: every process's waiters hear it, so the demand heard
        for it is spent (a waiter that stays counted would ask for another load)."""
        for key in [key for key in self._elsewhere if key[1] == model]:
            del self._elsewhere[key]
        self._publish({"failed": model, "host": host, "message": message})

    # -- the lease, every tick --------------------------------------------------------------

    async def _claim_forever(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self._shared.tick)
            await self._claim()
            for model, waiting in list(self._mine.items()):
                self._publish({"wanted": model, "waiting": waiting})

    async def _claim(self) -> None:
        held = self.lease.holds()
        holds = await self.lease.claim()
        if holds and not held:
            log.info("model placement: this process decides (proc=%s)", self.lease.proc)
            if self._heard is not None:
                self._heard.elected()
        elif held and not holds:
            log.warning("model placement: this process decides no more (proc=%s)", self.lease.proc)
        if not self._shared.available and not self._said_away:
            self._said_away = True
            log.warning(
                "model placement: no process decides while Redis at %s cannot be reached;"
                " requests for a model loaded nowhere are refused as not loaded",
                self._shared.where,
            )
        elif self._shared.available:
            self._said_away = False

    # -- the channel ------------------------------------------------------------------------

    def _publish(self, message: dict[str, Any]) -> None:
        text = json.dumps({**message, "proc": self.lease.proc})
        self._tasks.spawn(self._send(text))

    async def _send(self, text: str) -> None:
        try:
            await self._shared.redis.publish(self._channel, text)
        except UNREACHABLE as exc:
            self._shared.mark_down(exc)  # the tick sends a count again; a loaded/failed is lost

    async def _listen_forever(self) -> None:
        while not self._stopping:
            pubsub = self._shared.redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                while not self._stopping:
                    message = await pubsub.get_message(timeout=None)
                    if message is not None and message["type"] == "message":
                        self._heard_message(json.loads(message["data"]))
            except UNREACHABLE as exc:
                self._shared.mark_down(exc)
                await asyncio.sleep(self._shared.tick)
            finally:
                try:
                    await pubsub.aclose()
                except UNREACHABLE:
                    pass

    def _heard_message(self, message: dict[str, Any]) -> None:
        proc, heard = str(message.get("proc")), self._heard
        if proc == self.lease.proc or heard is None:
            return
        if "wanted" in message:
            now = asyncio.get_running_loop().time()
            self._elsewhere[proc, message["wanted"]] = (int(message["waiting"]), now)
            for key, (_, at) in list(self._elsewhere.items()):
                if at <= now - self.lease.ttl:
                    del self._elsewhere[key]
            if self.deciding():
                heard.wanted()
        elif "loaded" in message:
            heard.loaded(message["host"], message["loaded"])
        elif "failed" in message:
            heard.failed(message["host"], message["failed"], message["message"])


# ARGV: prefix, proc, ttl in ms. 1 when `proc` holds the lease now (taken or renewed).
_CLAIM = """
local key = ARGV[1] .. 'models:decider'
if redis.call('SET', key, ARGV[2], 'NX', 'PX', ARGV[3]) then return 1 end
if redis.call('GET', key) == ARGV[2] then
  redis.call('PEXPIRE', key, ARGV[3])
  return 1
end
return 0
"""

# ARGV: prefix, proc. Deletes the lease only when `proc` holds it.
_RELEASE = """
local key = ARGV[1] .. 'models:decider'
if redis.call('GET', key) == ARGV[2] then redis.call('DEL', key) end
return 0
"""
