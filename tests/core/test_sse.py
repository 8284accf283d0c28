"""The SSE frames the gateway writes into a stream itself (`routing.core.sse`)."""

from __future__ import annotations

import json

from routing.core.errors import QueueTimeout, answer_for
from routing.core.sse import comment, error_event


def test_an_error_event_is_one_data_line_with_the_error_in_openais_shape() -> None:
    answer = answer_for(QueueTimeout("queue timeout: no slot for m within 5 s"))

    event = error_event(answer)

    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # one line, then the blank line that ends the event
    assert json.loads(event.removeprefix(b"data: ")) == {
        "error": {"message": answer.message, "type": answer.type, "code": answer.code}
    }


def test_a_status_comment_is_a_frame_every_sse_parser_drops() -> None:
    assert comment("queued 2") == b": crossbar-status: queued 2\n\n"
