from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.core.tee import MAX_BUFFER, Tee, Usage
from tests.helpers.sse_streams import DONE, content_event, sse_event, streams

SSE = "text/event-stream"


TIMINGS = {"prompt_n": 1, "prompt_ms": 3.2, "cache_n": 66, "predicted_n": 8, "predicted_ms": 40.0}
USAGE = {
    "prompt_tokens": 67,
    "completion_tokens": 8,
    "total_tokens": 75,
    "prompt_tokens_details": {"cached_tokens": 66},
}
LAST_CONTENT = sse_event(
    {"choices": [{"delta": {"content": "end"}, "finish_reason": "stop"}], "timings": TIMINGS}
)
USAGE_CHUNK = sse_event({"choices": [], "usage": USAGE})


def _usage_of(chunks: list[bytes], content_type: str = SSE) -> Usage:
    tee = Tee(content_type)
    for chunk in chunks:
        tee.feed(chunk)
    return tee.usage()


def test_timings_alone_give_prompt_as_evaluated_plus_cached_tokens():
    stream = content_event("hi ") + LAST_CONTENT + DONE

    assert _usage_of([stream]) == Usage(prompt_tokens=67, cached_tokens=66, completion_tokens=8)


def test_usage_alone_gives_its_own_counts():
    usage = {**USAGE, "prompt_tokens": 70, "prompt_tokens_details": {"cached_tokens": 12}}
    stream = content_event("hi ") + sse_event({"choices": [], "usage": usage}) + DONE

    assert _usage_of([stream]) == Usage(prompt_tokens=70, cached_tokens=12, completion_tokens=8)


def test_usage_wins_over_timings_when_both_are_sent():
    timings = {"prompt_n": 5, "cache_n": 3, "predicted_n": 2}
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    stream = (
        sse_event({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": timings})
        + sse_event({"choices": [], "usage": usage})
        + DONE
    )

    assert _usage_of([stream]) == Usage(prompt_tokens=9, cached_tokens=1, completion_tokens=4)


def test_missing_usage_fields_fall_back_to_timings_one_by_one():
    usage = {"completion_tokens": 8}
    stream = LAST_CONTENT + sse_event({"choices": [], "usage": usage}) + DONE

    assert _usage_of([stream]) == Usage(prompt_tokens=67, cached_tokens=66, completion_tokens=8)


def test_a_stream_without_usage_or_timings_counts_nothing():
    stream = b": keep-alive\n\n" + content_event("a") + content_event("b") + DONE

    assert _usage_of([stream]) == Usage(None, None, None)


def test_null_usage_on_content_chunks_does_not_erase_the_final_usage():
    null_usage = sse_event({"choices": [{"delta": {"content": "x"}}], "usage": None})
    stream = null_usage + USAGE_CHUNK + null_usage + DONE

    assert _usage_of([stream]).prompt_tokens == 67


def test_the_last_usage_seen_is_the_one_counted():
    first = sse_event({"usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    second = sse_event({"usage": {"prompt_tokens": 2, "completion_tokens": 3}})

    assert _usage_of([first + second]) == Usage(2, None, 3)


def test_a_data_line_split_at_every_byte_position_still_counts():
    stream = content_event("hello ") + LAST_CONTENT + USAGE_CHUNK + DONE
    whole = _usage_of([stream])

    for cut in range(len(stream) + 1):
        assert _usage_of([stream[:cut], stream[cut:]]) == whole, cut


def test_a_stream_fed_one_byte_at_a_time_still_counts():
    stream = LAST_CONTENT + USAGE_CHUNK + DONE

    chunks = [stream[i : i + 1] for i in range(len(stream))]

    assert _usage_of(chunks) == Usage(67, 66, 8)


def test_crlf_line_endings_and_data_without_a_space_are_read():
    body = json.dumps({"choices": [], "usage": USAGE}).encode()
    stream = b"data:" + body + b"\r\n\r\n" + b"data: [DONE]\r\n\r\n"

    assert _usage_of([stream]) == Usage(67, 66, 8)


def test_line_separator_characters_in_content_do_not_split_lines():
    # U+2028 and U+2029 are line breaks to str.splitlines, not to SSE.
    timings_event = json.dumps(
        {"choices": [{"delta": {"content": "a\u2028b\u2029c"}}], "timings": TIMINGS},
        ensure_ascii=False,
    )
    stream = b"data: " + timings_event.encode() + b"\n\n" + DONE

    assert "\u2028".encode() in stream
    assert _usage_of([stream]) == Usage(67, 66, 8)


def test_invalid_json_comments_and_done_are_skipped_silently():
    stream = (
        b': comment with "usage"\n\n'
        + b'data: {"usage": {"prompt_tokens": 3\n\n'
        + b'data: ["usage", "timings"]\n\n'
        + b'event: {"usage": {"prompt_tokens": 4}}\n\n'
        + USAGE_CHUNK
        + DONE
    )

    assert _usage_of([stream]) == Usage(67, 66, 8)


def test_nonsense_counts_are_unknown_not_zero():
    usage = {"prompt_tokens": -1, "completion_tokens": True, "prompt_tokens_details": [1]}
    timings = {"prompt_n": "5", "cache_n": 2.0, "predicted_n": None}
    stream = sse_event({"timings": timings}) + sse_event({"usage": usage})

    assert _usage_of([stream]) == Usage(None, None, None)


def test_prompt_is_unknown_when_timings_lack_the_cached_part():
    stream = sse_event({"timings": {"prompt_n": 5, "predicted_n": 2}})

    assert _usage_of([stream]) == Usage(prompt_tokens=None, cached_tokens=None, completion_tokens=2)


def test_a_json_body_with_usage_is_counted():
    body = json.dumps(
        {"object": "chat.completion", "choices": [], "usage": USAGE, "timings": TIMINGS}
    ).encode()

    chunks = [body[:10], body[10:50], body[50:]]

    assert _usage_of(chunks, "application/json; charset=utf-8") == Usage(67, 66, 8)


def test_a_json_body_with_only_timings_is_counted():
    body = json.dumps({"object": "text_completion", "timings": TIMINGS}).encode()

    assert _usage_of([body], "application/json") == Usage(67, 66, 8)


def test_a_json_body_over_one_mebibyte_records_no_tokens():
    padding = "x" * MAX_BUFFER
    body = json.dumps({"choices": [{"text": padding}], "usage": USAGE}).encode()

    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)]

    assert _usage_of(chunks, "application/json") == Usage(None, None, None)


def test_an_sse_line_over_one_mebibyte_is_dropped_and_the_next_lines_still_count():
    long_line = (
        b'data: {"usage": {"prompt_tokens": 1}, "pad": "' + b"x" * 2 * MAX_BUFFER + b'"}\n\n'
    )
    chunks = [long_line[i : i + 4096] for i in range(0, len(long_line), 4096)]

    assert _usage_of([*chunks, USAGE_CHUNK]) == Usage(67, 66, 8)
    assert _usage_of(chunks) == Usage(None, None, None)


def test_a_json_body_past_one_mebibyte_stays_uncounted_however_many_chunks_follow():
    body = json.dumps({"choices": [{"text": "x" * MAX_BUFFER}], "usage": USAGE}).encode()
    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)]

    assert _usage_of([*chunks, b" ", b" "], "application/json") == Usage(None, None, None)


@pytest.mark.parametrize("ends", ["mid-chunk", "at a chunk's end"])
def test_the_lines_after_an_over_long_sse_line_count_in_the_chunk_that_ends_it(ends: str):
    long_line = b'data: {"pad": "' + b"x" * (MAX_BUFFER + 10)
    chunks = [long_line[i : i + 4096] for i in range(0, len(long_line), 4096)]
    rest = b"\n" + USAGE_CHUNK + DONE + b'data: {"an incomplete line'
    if ends == "mid-chunk":
        chunks.append(b'"}' + rest)
    else:
        chunks[-1] += b'"}'
        chunks.append(rest)

    assert _usage_of(chunks) == Usage(67, 66, 8)


def test_a_zero_the_host_reports_is_recorded_as_zero_not_unknown():
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 0}}

    assert _usage_of([sse_event({"choices": [], "usage": usage})]) == Usage(67, 0, 8)


def test_other_content_types_count_nothing():
    body = json.dumps({"usage": USAGE}).encode()

    tee = Tee("text/plain")
    tee.feed(body)

    assert tee.streamed is False
    assert tee.usage() == Usage(None, None, None)


def test_content_type_is_matched_without_regard_to_case():
    assert Tee("Text/Event-Stream; charset=utf-8").streamed is True
    assert Tee("application/json").streamed is False
    assert _usage_of([json.dumps({"usage": USAGE}).encode()], "Application/JSON") == Usage(
        67, 66, 8
    )


def test_usage_may_be_asked_more_than_once():
    tee = Tee(SSE)
    tee.feed(LAST_CONTENT)
    tee.feed(USAGE_CHUNK)

    assert tee.usage() == tee.usage() == Usage(67, 66, 8)


@given(stream=streams(), data=st.data())
def test_any_split_into_chunks_passes_the_same_bytes_and_counts_the_same(
    stream: bytes, data: st.DataObject
):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]

    tee = Tee(SSE)
    sent = []
    for chunk in chunks:
        tee.feed(chunk)
        sent.append(chunk)

    assert b"".join(sent) == stream
    assert tee.usage() == _usage_of([stream])


def _named(event: str, document: object) -> bytes:
    return f"event: {event}\n".encode() + sse_event(document)


def test_an_anthropic_stream_counts_its_cached_input_as_part_of_the_prompt():
    stream = (
        _named("message_start", {"type": "message_start", "message": {
            "usage": {"input_tokens": 4, "cache_read_input_tokens": 60, "output_tokens": 0}
        }})
        + _named("content_block_delta", {"type": "content_block_delta", "delta": {"text": "hi"}})
        + _named("message_delta", {"type": "message_delta", "usage": {"output_tokens": 9}})
        + _named("message_stop", {"type": "message_stop"})
    )  # fmt: skip

    assert _usage_of([stream]) == Usage(prompt_tokens=64, cached_tokens=60, completion_tokens=9)


def test_an_anthropic_answer_counts_its_usage():
    body = json.dumps(
        {"type": "message", "usage": {
            "input_tokens": 3, "cache_read_input_tokens": 7, "output_tokens": 5
        }}
    ).encode()  # fmt: skip

    assert _usage_of([body], "application/json") == Usage(10, 7, 5)


def test_a_responses_stream_counts_the_usage_of_its_completed_response():
    completed = {"type": "response.completed", "response": {"usage": {
        "input_tokens": 70, "input_tokens_details": {"cached_tokens": 64}, "output_tokens": 6
    }}}  # fmt: skip
    stream = (
        _named("response.created", {"type": "response.created", "response": {"usage": None}})
        + _named("response.output_text.delta", {"type": "response.output_text.delta"})
        + _named("response.completed", completed)
    )

    assert _usage_of([stream]) == Usage(prompt_tokens=70, cached_tokens=64, completion_tokens=6)


@pytest.mark.parametrize(
    "usage",
    [
        {"input_tokens": 9, "cache_read_input_tokens": None, "output_tokens": 2},  # Anthropic
        {"input_tokens": 9, "input_tokens_details": None, "output_tokens": 2},  # Responses
    ],
)
def test_input_tokens_with_a_null_cache_count_give_the_prompt_and_no_cached_count(
    usage: dict[str, object],
):
    assert _usage_of([sse_event({"usage": usage})]) == Usage(9, None, 2)


def test_the_hosts_prompt_time_is_read_from_its_timings():
    stream = content_event("hi ") + LAST_CONTENT + USAGE_CHUNK + DONE
    tee = Tee(SSE)
    tee.feed(stream)

    assert tee.prompt_ms() == 3.2
    body = Tee("application/json")
    body.feed(json.dumps({"usage": USAGE, "timings": TIMINGS}).encode())
    assert body.prompt_ms() == 3.2


@pytest.mark.parametrize("value", [None, -1, "3.2", True, float("nan"), float("inf")])
def test_a_prompt_time_that_is_no_duration_is_unknown(value: object):
    tee = Tee(SSE)
    tee.feed(sse_event({"timings": {**TIMINGS, "prompt_ms": value}}))

    assert tee.prompt_ms() is None
    assert Tee(SSE).prompt_ms() is None  # no timings at all
