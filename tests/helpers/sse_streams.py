"""Server-sent events as hosts send them, and a Hypothesis strategy of whole streams (content,
timings, usage; LF or CRLF) for the tests of the tee and the relay."""

from __future__ import annotations

import json

from hypothesis import strategies as st


def sse_event(document: object) -> bytes:
    return b"data: " + json.dumps(document, ensure_ascii=False).encode() + b"\n\n"


def content_event(text: str) -> bytes:
    return sse_event({"object": "chat.completion.chunk", "choices": [{"delta": {"content": text}}]})


DONE = b"data: [DONE]\n\n"


_texts = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12
) | st.sampled_from(["\u2028", "\r", "\n", '"usage"', "data: ", "\r\n"])


_counts = st.integers(min_value=0, max_value=10_000)


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    events = [content_event(text) for text in draw(st.lists(_texts, max_size=6))]
    if draw(st.booleans()):
        timings = {
            "prompt_n": draw(_counts),
            "cache_n": draw(_counts),
            "predicted_n": draw(_counts),
        }
        events.append(sse_event({"choices": [], "timings": timings}))
    if draw(st.booleans()):
        usage = {
            "prompt_tokens": draw(_counts),
            "completion_tokens": draw(_counts),
            "prompt_tokens_details": {"cached_tokens": draw(_counts)},
        }
        events.append(sse_event({"choices": [], "usage": usage}))
    events.append(DONE)
    stream = b"".join(events)
    if draw(st.booleans()):
        stream = stream.replace(b"\n", b"\r\n")
    return stream
