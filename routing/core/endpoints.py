"""llama-server's endpoints, as the gateway treats each one.

Every path llama-server serves passes through a route; what the gateway does with it depends on
its kind:

- `GENERATE`: the request runs a model (completion, chat, infill, responses, Anthropic messages,
  embeddings, rerank). It takes a slot of the model its body names (or the route's default) and,
  where the body names a conversation, a lease.
- `INSPECT`: the request reads the model without running it (tokenize, detokenize,
  apply-template, token counts). No slot; it goes to a usable host serving the model.
- `HOST`: about the host itself (health, props, slots, metrics, LoRA adapters). No body is
  read; it goes to a usable host of the route (or, per host, to the one an operator names).
- `MODELS`: the model list, answered by the gateway from its configuration: what a client may
  send, over every host of the route.
- `MANAGE`: loading and unloading models on a router-mode host (`/models/load`,
  `/models/unload`): an operator's action, open to clients only where the route says so.

Any other path is refused (404), and so are path tricks (empty, `.` or `..` segments). Pure.
"""

from __future__ import annotations

import enum

__all__ = ["Kind", "kind_of"]


class Kind(enum.Enum):
    GENERATE = "generate"
    INSPECT = "inspect"
    HOST = "host"
    MODELS = "models"
    MANAGE = "manage"


_OPENAI = {
    "chat/completions": Kind.GENERATE,
    "completions": Kind.GENERATE,
    "embeddings": Kind.GENERATE,
    "responses": Kind.GENERATE,
    "rerank": Kind.GENERATE,
    "reranking": Kind.GENERATE,
    "models": Kind.MODELS,
}
_V1_ONLY = {
    "messages": Kind.GENERATE,
    "messages/count_tokens": Kind.INSPECT,
    "chat/completions/input_tokens": Kind.INSPECT,
    "responses/input_tokens": Kind.INSPECT,
}
_NATIVE = {
    "completion": Kind.GENERATE,
    "infill": Kind.GENERATE,
    "embedding": Kind.GENERATE,
    "chat/completions/input_tokens": Kind.INSPECT,
    "tokenize": Kind.INSPECT,
    "detokenize": Kind.INSPECT,
    "apply-template": Kind.INSPECT,
    "health": Kind.HOST,
    "props": Kind.HOST,
    "slots": Kind.HOST,
    "metrics": Kind.HOST,
    "lora-adapters": Kind.HOST,
    "models/load": Kind.MANAGE,
    "models/unload": Kind.MANAGE,
}


def kind_of(path: str) -> Kind | None:
    """The kind of an upstream path such as `/v1/chat/completions`; None when not served."""
    if not path.startswith("/") or path.startswith("/hosts/"):
        return None
    rest = path[1:]
    if rest.startswith("v1/"):
        tail = rest[3:]
        return _OPENAI.get(tail) or _V1_ONLY.get(tail)
    return _OPENAI.get(rest) or _NATIVE.get(rest)
