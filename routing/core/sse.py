"""The few SSE frames the gateway writes into a stream itself.

Only comments (which every SSE parser drops) while a request waits, and one `data:` error event
in OpenAI's shape when the stream cannot go on: never a `data:` line that looks like the model's.
"""

from __future__ import annotations

import json

from routing.core.errors import Answer


def comment(text: str) -> bytes:
    """`: crossbar-status: <text>`, a frame clients that do not know it ignore."""
    return f": crossbar-status: {text}\n\n".encode()


def error_event(answer: Answer) -> bytes:
    """One `data:` event carrying the error, as OpenAI's streaming API reports one."""
    return b"data: " + json.dumps(answer.body()).encode() + b"\n\n"
