"""llama-server's endpoints: each one's class, and who may reach it. One table, `ENDPOINTS`.

Every path llama-server serves passes through a route. The table gives each path its class for
reads (GET, HEAD) and for writes (POST, DELETE), and each class has one rule for who may reach
it:

- *generate*: runs a model (completion, chat, infill, responses, Anthropic messages,
  embeddings, rerank). It takes a slot of the model its body names (or the route's default)
  and, where the body names a conversation, a lease. A client.
- *inspect*: reads the model without running it (tokenize, detokenize, apply-template, token
  counts). No slot; a usable host serving the model. A client.
- *host state*: the host's health and settings, read only and harmless (`/health`,
  `GET /props`, a router's model events `/models/sse`). No body read; a usable host of the
  route. A client; the health check anyone, key or none, as llama-server answers it without
  its API key (a load balancer's probe carries no key).
- *host control*: exposes or changes a host's state for every user (`/slots` shows other
  users' prompts; `POST /props`, `POST /lora-adapters`, a slot's save, restore and erase
  (`POST /slots/<id>`), stopping a resumable stream (`DELETE /v1/stream`), model load and
  unload, and a router's `POST /models` (download) and `DELETE /models` change what every
  user gets; a resumable stream (`GET /v1/stream`, `POST /v1/streams/lookup`) replays a
  generation to whoever names its conversation, another user's too; `/cors-proxy` makes the
  host fetch any URL). An operator only, unless the route opens it (the route setting the
  endpoint's `opened_by` names).
- *models*: the model list: the models the route serves, as its hosts describe them
  (`routing.proxy.model_list`). A client.

"A client" is anyone while client keys are not in use, else a request with a valid key. One
host's own endpoints (`/<route>/hosts/<host>/...`: host state and host control) are always an
operator's. The gateway applies the rules (`routing.proxy.access`); this module only says which
applies. Any path not in the table is refused (404), and so are path tricks (empty, `.` or `..`
segments), which match no entry. Pure.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ENDPOINTS", "READS", "SLOT", "Endpoint", "Kind", "Opener", "endpoint_of"]

READS = frozenset({"GET", "HEAD"})  # the methods that use an entry's first column


class Kind(enum.Enum):
    """An endpoint's class."""

    GENERATE = "generate"
    INSPECT = "inspect"
    HOST_STATE = "host state"
    HOST_CONTROL = "host control"
    MODELS = "models"


class Opener(enum.Enum):
    """The route setting that opens a host control to clients (its value is the setting)."""

    HOST_CONTROLS = "open_host_controls"
    MODEL_MANAGEMENT = "manage_models"


@dataclass(slots=True, frozen=True)
class Endpoint:
    """What the gateway does with one endpoint, and who may reach it.

    `names_model`: the body names the model, so the gateway reads it and asks a host serving
    that model. `keyless`: anyone may ask it, whatever key they send or not, and it counts
    against no key's limits. `opened_by` and `why` are a host control's: the route setting that
    opens it to clients, and what a client could do with it (said when one is refused).
    """

    kind: Kind
    names_model: bool = False
    keyless: bool = False
    opened_by: Opener | None = None
    why: str = ""

    @property
    def operators_only(self) -> bool:
        """Only an operator may reach it, unless the route opens it."""
        return self.kind is Kind.HOST_CONTROL

    @property
    def about_the_host(self) -> bool:
        """An operator may ask one named host for it (`/hosts/<host>/...`)."""
        return self.kind in (Kind.HOST_STATE, Kind.HOST_CONTROL) and not self.names_model


GENERATE = Endpoint(Kind.GENERATE, names_model=True)
INSPECT = Endpoint(Kind.INSPECT, names_model=True)
STATE = Endpoint(Kind.HOST_STATE)
HEALTH = Endpoint(Kind.HOST_STATE, keyless=True)
MODELS = Endpoint(Kind.MODELS)
SHOWS = Endpoint(
    Kind.HOST_CONTROL,
    opened_by=Opener.HOST_CONTROLS,
    why="it shows the host's own state, other users' requests included",
)
CHANGES = Endpoint(
    Kind.HOST_CONTROL,
    opened_by=Opener.HOST_CONTROLS,
    why="it changes the host's state for every user",
)
LOADS = Endpoint(
    Kind.HOST_CONTROL,
    names_model=True,
    opened_by=Opener.MODEL_MANAGEMENT,
    why="it loads or unloads a model for every user",
)
REPLAYS = Endpoint(
    Kind.HOST_CONTROL,
    opened_by=Opener.HOST_CONTROLS,
    why="it replays or stops the stream of whichever conversation it names, another user's too",
)
STORES = Endpoint(
    Kind.HOST_CONTROL,
    opened_by=Opener.MODEL_MANAGEMENT,
    why="it downloads a model to the host's disk or deletes one from it, for every user",
)
FETCHES = Endpoint(
    Kind.HOST_CONTROL,
    opened_by=Opener.HOST_CONTROLS,
    why="it would let any client make the host fetch any URL",
)

SLOT = "/slots/<id>"  # the table's one entry for /slots/0, /slots/1, ...
_SLOT_ID = re.compile(r"/slots/[0-9]{1,6}")

# path: (GET and HEAD, POST and DELETE). A generating path asked with GET keeps its class: the
# host answers it (llama-server: 404), as it would answer a client talking to it directly.
ENDPOINTS: Mapping[str, tuple[Endpoint, Endpoint]] = {
    "/v1/chat/completions": (GENERATE, GENERATE),
    "/chat/completions": (GENERATE, GENERATE),
    "/v1/completions": (GENERATE, GENERATE),
    "/completions": (GENERATE, GENERATE),
    "/completion": (GENERATE, GENERATE),
    "/infill": (GENERATE, GENERATE),
    "/v1/responses": (GENERATE, GENERATE),
    "/responses": (GENERATE, GENERATE),
    "/v1/messages": (GENERATE, GENERATE),
    "/v1/embeddings": (GENERATE, GENERATE),
    "/embeddings": (GENERATE, GENERATE),
    "/embedding": (GENERATE, GENERATE),
    "/v1/rerank": (GENERATE, GENERATE),
    "/rerank": (GENERATE, GENERATE),
    "/v1/reranking": (GENERATE, GENERATE),
    "/reranking": (GENERATE, GENERATE),
    "/tokenize": (INSPECT, INSPECT),
    "/detokenize": (INSPECT, INSPECT),
    "/apply-template": (INSPECT, INSPECT),
    "/v1/messages/count_tokens": (INSPECT, INSPECT),
    "/v1/chat/completions/input_tokens": (INSPECT, INSPECT),
    "/chat/completions/input_tokens": (INSPECT, INSPECT),
    "/v1/responses/input_tokens": (INSPECT, INSPECT),
    "/health": (HEALTH, HEALTH),
    "/v1/health": (HEALTH, HEALTH),
    "/props": (STATE, CHANGES),
    "/slots": (SHOWS, SHOWS),
    SLOT: (SHOWS, CHANGES),  # ?action=save, restore or erase: one slot's cache, on the host's disk
    "/metrics": (SHOWS, SHOWS),
    "/lora-adapters": (SHOWS, CHANGES),
    "/models/load": (LOADS, LOADS),
    "/models/unload": (LOADS, LOADS),
    "/cors-proxy": (FETCHES, FETCHES),
    "/v1/stream": (REPLAYS, REPLAYS),  # GET: replay from an offset; DELETE: stop it
    "/v1/streams/lookup": (REPLAYS, REPLAYS),
    "/v1/models": (MODELS, MODELS),
    "/models/sse": (STATE, STATE),  # a router's model events: loads, downloads, as /models
    "/models": (MODELS, STORES),  # a router downloads (POST) and deletes (DELETE) models
}


def endpoint_of(method: str, path: str) -> Endpoint | None:
    """The endpoint a request for an upstream path such as `/v1/chat/completions` reaches;
    None when llama-server serves no such path."""
    entry = ENDPOINTS.get(SLOT if _SLOT_ID.fullmatch(path) else path)
    if entry is None:
        return None
    return entry[0] if method in READS else entry[1]
