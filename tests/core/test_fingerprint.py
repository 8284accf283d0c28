from __future__ import annotations

import json
import string

from hypothesis import given
from hypothesis import strategies as st

from routing.core.fingerprint import fingerprint

SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def chat(*messages: object, **extra: object) -> dict[str, object]:
    return {"model": "qwen", "messages": list(messages), **extra}


def user(content: object) -> dict[str, object]:
    return {"role": "user", "content": content}


def assistant(text: str) -> dict[str, object]:
    return {"role": "assistant", "content": text}


def is_sha256_hex(value: str) -> bool:
    return len(value) == 64 and set(value) <= set(string.hexdigits.lower())


def test_every_turn_of_a_conversation_has_the_fingerprint_of_the_first() -> None:
    opening = [SYSTEM, user("Name a prime.")]
    first = chat(*opening)
    second = chat(*opening, assistant("7"), user("Another?"))
    third = chat(*opening, assistant("7"), user("Another?"), assistant("11"), user("Sum them."))

    assert is_sha256_hex(fingerprint("POST", first, None))
    assert fingerprint("POST", first, None) == fingerprint("POST", second, None)
    assert fingerprint("POST", second, None) == fingerprint("POST", third, None)


def test_conversations_sharing_only_a_system_prompt_differ() -> None:
    primes = chat(SYSTEM, user("Name a prime."))
    colours = chat(SYSTEM, user("Name a colour."))

    assert fingerprint("POST", primes, None) != fingerprint("POST", colours, None)


def test_other_request_fields_do_not_change_the_fingerprint() -> None:
    plain = chat(SYSTEM, user("Hi"))
    tuned = chat(SYSTEM, user("Hi"), temperature=0.2, stream=True, model="other")

    assert fingerprint("POST", plain, None) == fingerprint("POST", tuned, None)


def test_key_order_and_whitespace_of_the_request_do_not_matter() -> None:
    compact = (
        '{"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}'
    )
    spread = """
        {
          "messages": [
            {"content": "Be brief.",   "role": "system"},
            {"content": "Hi", "role": "user"}
          ],
          "model": "qwen"
        }
    """

    assert fingerprint("POST", json.loads(compact), None) == fingerprint(
        "POST", json.loads(spread), None
    )


def test_content_parts_are_part_of_the_fingerprint() -> None:
    def look_at(url: str) -> dict[str, object]:
        return chat(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        )

    cat = fingerprint("POST", look_at("data:image/png;base64,Y2F0"), None)
    dog = fingerprint("POST", look_at("data:image/png;base64,ZG9n"), None)

    assert is_sha256_hex(cat)
    assert cat != dog
    reparsed = json.loads(json.dumps(look_at("data:image/png;base64,Y2F0"), sort_keys=True))
    assert cat == fingerprint("POST", reparsed, None)


def test_completion_prompt_is_named_by_its_first_2048_characters() -> None:
    head = "x" * 2_048

    same_head = fingerprint("POST", {"prompt": head + "one ending"}, None)
    other_ending = fingerprint("POST", {"prompt": head + "another ending"}, None)
    other_head = fingerprint("POST", {"prompt": "y" + head[1:] + "one ending"}, None)

    assert is_sha256_hex(same_head)
    assert same_head == other_ending
    assert same_head != other_head


def test_completion_prompt_given_as_a_list_is_named_by_its_first_string() -> None:
    listed = fingerprint("POST", {"prompt": ["Once upon a time", "ignored"]}, None)

    assert listed == fingerprint("POST", {"prompt": "Once upon a time"}, None)
    assert fingerprint("POST", {"prompt": []}, None) == ""
    assert fingerprint("POST", {"prompt": ""}, None) == ""


def test_get_and_head_requests_have_no_fingerprint() -> None:
    body = chat(user("Hi"))

    for method in ("GET", "HEAD", "get", "head"):
        assert fingerprint(method, body, "session-1") == ""


def test_session_header_wins_over_the_body() -> None:
    one = fingerprint("POST", chat(user("Hi")), "session-1")
    other_body = fingerprint("POST", {"prompt": "something else"}, "session-1")
    other_session = fingerprint("POST", chat(user("Hi")), "session-2")

    assert one == other_body
    assert one != other_session
    assert one != fingerprint("POST", chat(user("Hi")), None)


def test_session_value_is_hashed_never_returned() -> None:
    session = "a" * 64

    named = fingerprint("POST", None, session)

    assert is_sha256_hex(named)
    assert named != session


def test_empty_session_header_falls_back_to_the_body() -> None:
    assert fingerprint("POST", {"prompt": "Hi"}, "") == fingerprint("POST", {"prompt": "Hi"}, None)


def test_session_prompt_and_chat_with_the_same_text_do_not_collide() -> None:
    text = "same words"
    by_session = fingerprint("POST", None, text)
    by_prompt = fingerprint("POST", {"prompt": text}, None)
    by_chat = fingerprint("POST", {"messages": text}, None)  # not a list: no chat fingerprint

    assert by_session != by_prompt
    assert by_chat == ""
    assert by_prompt != fingerprint("POST", {"messages": [text]}, None)


def test_conversation_without_a_user_message_is_named_by_all_its_messages() -> None:
    system_only = fingerprint("POST", chat(SYSTEM), None)

    assert is_sha256_hex(system_only)
    assert system_only != fingerprint("POST", chat(SYSTEM, assistant("Hello")), None)


def test_odd_bodies_have_no_fingerprint() -> None:
    odd_bodies: list[object] = [
        None,
        "a string body",
        ["messages"],
        {},
        {"messages": []},
        {"messages": None, "prompt": None},
        {"messages": "not a list"},
        {"prompt": 42},
    ]

    for body in odd_bodies:
        assert fingerprint("POST", body, None) == ""


def test_messages_that_are_not_objects_are_hashed_as_they_are() -> None:
    odd = fingerprint("POST", {"messages": [1, "two", None, user("Hi"), "after"]}, None)

    assert is_sha256_hex(odd)
    assert odd == fingerprint("POST", {"messages": [1, "two", None, user("Hi")]}, None)


def test_bodies_that_are_not_json_have_no_chat_fingerprint() -> None:
    loop: list[object] = []
    loop.append(loop)

    assert fingerprint("POST", {"messages": [{"role": "user", "content": {1, 2}}]}, None) == ""
    assert fingerprint("POST", {"messages": [loop]}, None) == ""
    assert fingerprint("POST", {"messages": [{1: "a", "b": 2}], "prompt": "p"}, None) == (
        fingerprint("POST", {"prompt": "p"}, None)
    )


def test_lone_surrogates_from_json_escapes_are_hashed() -> None:
    body = json.loads(
        '{"prompt": "broken \\ud800 text", "messages": [{"role": "user", "content": "\\udfff"}]}'
    )

    assert is_sha256_hex(fingerprint("POST", body, None))
    assert is_sha256_hex(fingerprint("POST", {"prompt": body["prompt"]}, None))
    assert is_sha256_hex(fingerprint("POST", None, "\ud800"))


json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
roles = st.sampled_from(["system", "assistant", "tool", "developer"])
opening_messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": st.text(max_size=30)}), max_size=3
)


@given(
    opening=opening_messages,
    first_question=json_values,
    later=st.lists(json_values | st.fixed_dictionaries({"role": st.just("user")}), max_size=5),
)
def test_messages_after_the_first_user_message_never_change_the_fingerprint(
    opening: list[object], first_question: object, later: list[object]
) -> None:
    head = [*opening, {"role": "user", "content": first_question}]

    before = fingerprint("POST", {"messages": head}, None)
    after = fingerprint("POST", {"messages": [*head, *later]}, None)

    assert before == after
    assert is_sha256_hex(before)


@given(
    method=st.sampled_from(["POST", "GET", "PUT", "post"]) | st.text(max_size=6),
    body=json_values | st.dictionaries(st.sampled_from(["messages", "prompt"]), json_values),
    session=st.none() | st.text(max_size=10),
)
def test_arbitrary_json_input_never_raises(method: str, body: object, session: str | None) -> None:
    named = fingerprint(method, body, session)

    assert named == "" or is_sha256_hex(named)


@given(body=st.dictionaries(st.sampled_from(["messages", "prompt", "model"]), json_values))
def test_reformatting_the_json_never_changes_the_fingerprint(body: dict[str, object]) -> None:
    spread = json.loads(json.dumps(body, indent=3, sort_keys=True))

    assert fingerprint("POST", body, None) == fingerprint("POST", spread, None)


@given(opening=opening_messages, first=json_values, second=json_values)
def test_conversations_whose_first_questions_differ_never_share_a_fingerprint(
    opening: list[object], first: object, second: object
) -> None:
    def named(question: object) -> str:
        return fingerprint("POST", {"messages": [*opening, user(question)]}, None)

    assert (named(first) == named(second)) == (
        json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    )


def test_a_prompt_of_token_ids_is_named_by_its_first_tokens() -> None:
    tokens = fingerprint("POST", {"prompt": [1, 2, 3]}, None)

    assert tokens != ""
    assert tokens == fingerprint("POST", {"prompt": [[1, 2, 3], [4]]}, None)
    assert tokens != fingerprint("POST", {"prompt": "1,2,3"}, None)
    long = list(range(3000))
    assert fingerprint("POST", {"prompt": long}, None) == fingerprint(
        "POST", {"prompt": [*long[:2048], 7, 7]}, None
    )


def test_prompts_of_different_token_ids_have_different_fingerprints() -> None:
    assert fingerprint("POST", {"prompt": [1, 2, 3]}, None) != fingerprint(
        "POST", {"prompt": [4, 5, 6]}, None
    )


def test_an_anthropic_conversation_keeps_its_name_and_its_system_prompt_tells_it_apart() -> None:
    first = {"system": "Be terse.", "messages": [user("Hi")]}
    later = {"system": "Be terse.", "messages": [user("Hi"), assistant("Hello"), user("More")]}
    other = {"system": "Be verbose.", "messages": [user("Hi")]}

    assert fingerprint("POST", first, None) == fingerprint("POST", later, None)
    assert fingerprint("POST", first, None) != fingerprint("POST", other, None)


def test_a_responses_conversation_is_named_by_its_instructions_and_first_input() -> None:
    first = {"instructions": "Be terse.", "input": [user("Hi")]}
    later = {"instructions": "Be terse.", "input": [user("Hi"), assistant("Hello"), user("More")]}
    text = {"instructions": "Be terse.", "input": "Hi"}

    assert fingerprint("POST", first, None) == fingerprint("POST", later, None)
    assert fingerprint("POST", text, None) != ""
    assert fingerprint("POST", text, None) != fingerprint("POST", {"input": "Hi"}, None)
