"""What a generation looks like on the wire, per endpoint family, streamed and whole.

The fake "model" writes `tok0 tok1 ...` and stops by itself after `max_tokens` tokens (an
end-of-generation, not a length cut), so every family reports a natural stop: `stop` for
OpenAI, `eos` for the native API, `end_turn` for Anthropic, `completed` for Responses.

The shapes follow llama-server's `server-task.cpp`: the native `/completion` and `/infill`
stream one `data:` event per token and a final one with `stop: true` and `timings`, without
`[DONE]`; Responses and Anthropic streams are named events (`event: ...`) and also end
without `[DONE]`. OpenAI chat and text streams keep the fake's historical layout: the last
token rides in the final event with `finish_reason` and `timings`, then optional usage, then
`data: [DONE]`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from tests.fakes.llama_wire import sse, sse_event

_TOKEN = "@@TOKEN@@"
BUILD_INFO = "fake"
N_CTX = 4096
# Sampling parameters as llama-server reports them (in /props, /slots and native answers).
GENERATION_PARAMS: dict[str, Any] = {
    "n_predict": -1,
    "seed": 4294967295,
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "max_tokens": -1,
    "n_keep": 0,
    "stream": True,
    "n_probs": 0,
    "samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
    "timings_per_token": False,
    "lora": [],
}


@dataclass(slots=True)
class Generation:
    """One generation request as the fake understood it.

    `kind` is one of "chat", "text" (OpenAI), "native" (`/completion`), "infill",
    "responses", "anthropic". `prompt_n` prompt tokens were evaluated, `cache_n` came from
    the cache; `prompt` is the prompt text, `id_slot` the slot it runs in; `prompt_token_ms`
    what the timings say each evaluated prompt token took.
    """

    kind: str
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    prompt_n: int
    cache_n: int
    prompt: str = ""
    id_slot: int = 0
    prompt_token_ms: float = 0.1

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_n + self.cache_n


def token_text(i: int) -> str:
    return f"tok{i} "


def text_of(first: int, end: int) -> str:
    return "".join(token_text(i) for i in range(first, end))


def piece_id(piece: str) -> int:
    """A token id for a piece of text: the same in every run, 31 bits like llama_token."""
    return zlib.crc32(piece.encode()) & 0x7FFFFFFF


def timings(generation: Generation, predicted_n: int, predicted_ms: float) -> dict[str, Any]:
    prompt_ms = generation.prompt_n * generation.prompt_token_ms
    return {
        "cache_n": generation.cache_n,
        "prompt_n": generation.prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / generation.prompt_n if generation.prompt_n else 0.0,
        "prompt_per_second": 1000 * generation.prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else 0.0,
    }


def openai_usage(generation: Generation, completion_tokens: int) -> dict[str, Any]:
    return {
        "completion_tokens": completion_tokens,
        "prompt_tokens": generation.prompt_tokens,
        "total_tokens": generation.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": generation.cache_n},
    }


class Format:
    """The bytes of one generation: `token(i, n)` for each of its n tokens, then `end`.

    `whole` is the non-streamed answer. Each instance serves one request.
    """

    def __init__(self, generation: Generation, number: int, created: int) -> None:
        self.generation = generation
        self.number = number
        self.created = created

    def token(self, i: int, n: int) -> bytes:
        raise NotImplementedError

    def end(self, n: int, elapsed_ms: float) -> bytes:
        raise NotImplementedError

    def whole(self, n: int, elapsed_ms: float) -> dict[str, Any]:
        raise NotImplementedError


class OpenAIFormat(Format):
    """`/v1/chat/completions` (kind "chat") and `/v1/completions` (kind "text")."""

    def __init__(self, generation: Generation, number: int, created: int) -> None:
        super().__init__(generation, number, created)
        prefix = "chatcmpl" if generation.kind == "chat" else "cmpl"
        self.id = f"{prefix}-fake{number}"
        # The bytes around a token's text, so each token costs one concatenation.
        event = sse(self._document(_TOKEN))
        before, _, after = event.partition(_TOKEN.encode())
        self._before, self._after = before, after

    def _document(self, text: str, *, whole: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop" if whole else None}
        if self.generation.kind == "text":
            choice |= {"text": text, "logprobs": None}
            obj = "text_completion"
        elif whole:
            choice["message"] = {"role": "assistant", "content": text}
            obj = "chat.completion"
        else:
            choice["delta"] = {"content": text}
            obj = "chat.completion.chunk"
        return {
            "choices": [choice],
            "created": self.created,
            "id": self.id,
            "model": self.generation.model,
            "system_fingerprint": BUILD_INFO,
            "object": obj,
        }

    def token(self, i: int, n: int) -> bytes:
        if i == n - 1:
            return b""  # the last token goes out with the final event
        return self._before + token_text(i).encode() + self._after

    def end(self, n: int, elapsed_ms: float) -> bytes:
        last = self._document(text_of(max(n - 1, 0), n))
        last["choices"][0]["finish_reason"] = "stop"
        last["timings"] = timings(self.generation, n, elapsed_ms)
        out = sse(last)
        if self.generation.include_usage:
            final = self._document("")
            final["choices"] = []
            final["usage"] = openai_usage(self.generation, n)
            out += sse(final)
        return out + b"data: [DONE]\n\n"

    def whole(self, n: int, elapsed_ms: float) -> dict[str, Any]:
        document = self._document(text_of(0, n), whole=True)
        document["usage"] = openai_usage(self.generation, n)
        document["timings"] = timings(self.generation, n, elapsed_ms)
        return document


class NativeFormat(Format):
    """llama-server's own `/completion` (also `/completions`) and `/infill`."""

    def _final(self, content: str, n: int, elapsed_ms: float) -> dict[str, Any]:
        g = self.generation
        return {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": g.id_slot,
            "stop": True,
            "model": g.model,
            "tokens_predicted": n,
            "tokens_evaluated": g.prompt_tokens,
            "generation_settings": {**GENERATION_PARAMS, "n_predict": g.max_tokens},
            "prompt": g.prompt,
            "has_new_line": False,
            "truncated": False,
            "stop_type": "eos",
            "stopping_word": "",
            "tokens_cached": g.cache_n,
            "timings": timings(g, n, elapsed_ms),
        }

    def token(self, i: int, n: int) -> bytes:
        text = token_text(i)
        return sse(
            {
                "index": 0,
                "content": text,
                "tokens": [piece_id(text)],
                "stop": False,
                "id_slot": self.generation.id_slot,
                "tokens_predicted": i + 1,
                "tokens_evaluated": self.generation.prompt_tokens,
            }
        )

    def end(self, n: int, elapsed_ms: float) -> bytes:
        return sse(self._final("", n, elapsed_ms))

    def whole(self, n: int, elapsed_ms: float) -> dict[str, Any]:
        return self._final(text_of(0, n), n, elapsed_ms)


class ResponsesFormat(Format):
    """OpenAI's Responses API, `/v1/responses`."""

    def __init__(self, generation: Generation, number: int, created: int) -> None:
        super().__init__(generation, number, created)
        self.id = f"resp_fake{number}"
        self.message_id = f"msg_fake{number}"

    def _usage(self, n: int) -> dict[str, int]:
        prompt = self.generation.prompt_tokens
        return {"input_tokens": prompt, "output_tokens": n, "total_tokens": prompt + n}

    def _message(self, text: str) -> dict[str, Any]:
        return {
            "type": "message",
            "status": "completed",
            "id": self.message_id,
            "content": [_output_text(text)],
            "role": "assistant",
        }

    def token(self, i: int, n: int) -> bytes:
        out = b""
        if i == 0:
            started = {"id": self.id, "object": "response", "status": "in_progress"}
            out += sse_event("response.created", {"type": "response.created", "response": started})
            out += sse_event(
                "response.in_progress", {"type": "response.in_progress", "response": started}
            )
            item = {
                "content": [],
                "id": self.message_id,
                "role": "assistant",
                "status": "in_progress",
                "type": "message",
            }
            out += sse_event(
                "response.output_item.added", {"type": "response.output_item.added", "item": item}
            )
            out += sse_event(
                "response.content_part.added",
                {
                    "type": "response.content_part.added",
                    "item_id": self.message_id,
                    "part": {"type": "output_text", "text": ""},
                },
            )
        return out + sse_event(
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "item_id": self.message_id,
                "delta": token_text(i),
            },
        )

    def end(self, n: int, elapsed_ms: float) -> bytes:
        text = text_of(0, n)
        out = b""
        output: list[dict[str, Any]] = []
        if text:
            out += sse_event(
                "response.output_text.done",
                {"type": "response.output_text.done", "item_id": self.message_id, "text": text},
            )
            out += sse_event(
                "response.content_part.done",
                {
                    "type": "response.content_part.done",
                    "item_id": self.message_id,
                    "part": _output_text(text),
                },
            )
            message = self._message(text)
            out += sse_event(
                "response.output_item.done",
                {"type": "response.output_item.done", "item": message},
            )
            output.append(message)
        response = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "completed",
            "model": self.generation.model,
            "output": output,
            "usage": self._usage(n),
        }
        return out + sse_event(
            "response.completed", {"type": "response.completed", "response": response}
        )

    def whole(self, n: int, elapsed_ms: float) -> dict[str, Any]:
        text = text_of(0, n)
        output = []
        if text:
            output.append(
                {
                    "content": [_output_text(text)],
                    "id": self.message_id,
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                }
            )
        return {
            "completed_at": self.created,
            "created_at": self.created,
            "id": self.id,
            "model": self.generation.model,
            "object": "response",
            "output": output,
            "status": "completed",
            "usage": self._usage(n),
        }


class AnthropicFormat(Format):
    """Anthropic's Messages API, `/v1/messages`."""

    def __init__(self, generation: Generation, number: int, created: int) -> None:
        super().__init__(generation, number, created)
        self.id = f"chatcmpl-fake{number}"  # llama-server reuses its chat completion ids

    def token(self, i: int, n: int) -> bytes:
        out = b""
        if i == 0:
            message: dict[str, Any] = {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": self.generation.model,
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": self.generation.prompt_tokens, "output_tokens": 0},
            }
            out += sse_event("message_start", {"type": "message_start", "message": message})
            out += sse_event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            )
        return out + sse_event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": token_text(i)},
            },
        )

    def end(self, n: int, elapsed_ms: float) -> bytes:
        out = b""
        if n:
            out += sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        out += sse_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": n},
            },
        )
        return out + sse_event("message_stop", {"type": "message_stop"})

    def whole(self, n: int, elapsed_ms: float) -> dict[str, Any]:
        text = text_of(0, n)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}] if text else [],
            "model": self.generation.model,
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": self.generation.prompt_tokens, "output_tokens": n},
        }


FORMATS: dict[str, type[Format]] = {
    "chat": OpenAIFormat,
    "text": OpenAIFormat,
    "native": NativeFormat,
    "infill": NativeFormat,
    "responses": ResponsesFormat,
    "anthropic": AnthropicFormat,
}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
