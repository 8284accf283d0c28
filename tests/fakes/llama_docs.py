"""The fake llama-server's answers that are plain documents: prompts read from request bodies,
its tokenizer, embeddings, reranking, chat template, `/props`, `/slots`, `/metrics` and model
lists. Pure functions; shapes follow llama-server's `server-context.cpp` and
`server-common.cpp`.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tests.fakes.llama_formats import BUILD_INFO, GENERATION_PARAMS, N_CTX, piece_id

BOS_ID, EOS_ID = 1, 2
BOS, EOS = "<s>", "</s>"
N_EMBD = 8
# What /props shows as the model's template: llama-server's ChatML fallback, which
# apply_template below renders.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_PIECES = re.compile(r"\s*\S+|\s+")


class BadRequest(ValueError):
    """A request body llama-server refuses with 400 invalid_request_error."""


class ServerFailure(RuntimeError):
    """A request body on which llama-server fails with 500 server_error."""


# Prompts. The words of a prompt are its tokens for usage and the simulated KV cache.


def _content_text(content: object) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
    return []


def _messages_text(messages: object) -> list[str]:
    parts: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict):
            parts.extend(_content_text(message.get("content")))
    return parts


def _prompt_parts(prompt: object) -> list[str]:
    if isinstance(prompt, list):
        return [part for part in prompt if isinstance(part, str)]
    return [prompt] if isinstance(prompt, str) else []


def prompt_text(kind: str, body: Mapping[str, Any]) -> str:
    """The text a generation request asks the model to continue, for each endpoint family."""
    if kind in ("text", "native"):
        return " ".join(_prompt_parts(body.get("prompt")))
    if kind == "infill":
        extra = body.get("input_extra")
        parts = [
            chunk["text"]
            for chunk in (extra if isinstance(extra, list) else [])
            if isinstance(chunk, dict) and isinstance(chunk.get("text"), str)
        ]
        for key in ("input_prefix", "input_suffix", "prompt"):
            parts.extend(_prompt_parts(body.get(key)))
        return " ".join(parts)
    if kind == "responses":
        parts = _prompt_parts(body.get("instructions"))
        source = body.get("input")
        if isinstance(source, str):
            parts.append(source)
        else:
            parts.extend(_messages_text(source))
        return " ".join(parts)
    parts = []
    if kind == "anthropic":
        parts.extend(_content_text(body.get("system")))
    parts.extend(_messages_text(body.get("messages")))
    return " ".join(parts)


def check_generation_body(kind: str, body: Mapping[str, Any]) -> None:
    """Raise BadRequest (400) or ServerFailure (500) where llama-server refuses the body
    before generating."""
    if kind == "anthropic" and "messages" not in body:
        raise ServerFailure("'messages' is required")
    if kind == "responses" and "input" in body and not isinstance(body["input"], str | list):
        raise BadRequest("'input' must be a string or array of objects")
    if kind == "infill":
        if "prompt" in body and not isinstance(body["prompt"], str):
            raise BadRequest('"prompt" must be a string')
        for key in ("input_prefix", "input_suffix"):
            if key not in body:
                raise BadRequest(f'"{key}" is required')
        if "input_extra" in body and not isinstance(body["input_extra"], list):
            raise BadRequest(
                '"input_extra" must be an array of {"filename": string, "text": string}'
            )


def words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def max_tokens(body: Mapping[str, Any], default: int) -> int:
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return default


def chat_messages(kind: str, body: Mapping[str, Any]) -> list[dict[str, str]]:
    """The conversation as role/content pairs, for /apply-template."""
    messages: list[dict[str, str]] = []
    if kind == "anthropic" and body.get("system") is not None:
        messages.append({"role": "system", "content": "".join(_content_text(body["system"]))})
    source = body.get("messages")
    for message in source if isinstance(source, list) else []:
        if isinstance(message, dict):
            role = message.get("role")
            content = "".join(_content_text(message.get("content")))
            messages.append({"role": role if isinstance(role, str) else "user", "content": content})
    return messages


def apply_template(messages: Iterable[Mapping[str, str]]) -> str:
    """The ChatML rendering of a conversation, ending with the assistant's turn."""
    turns = "".join(
        f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n" for message in messages
    )
    return turns + "<|im_start|>assistant\n"


# The tokenizer: one token per word with the whitespace before it, so that detokenizing gives
# the text back. Ids are the same in every run; the vocabulary remembers pieces it has seen,
# for /detokenize.


class Vocabulary:
    """Token ids for pieces of text, and the pieces of ids seen so far."""

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {BOS_ID: BOS, EOS_ID: EOS}

    def tokenize(self, text: str, *, add_special: bool = False) -> list[tuple[int, str]]:
        tokens = [(BOS_ID, BOS)] if add_special else []
        for piece in _PIECES.findall(text):
            token = piece_id(piece)
            self._pieces.setdefault(token, piece)
            tokens.append((token, piece))
        return tokens

    def tokenize_mixed(self, content: object, *, add_special: bool) -> list[tuple[int, str]]:
        """Like llama-server's tokenize_mixed: a string, or a list of strings and token ids."""
        if isinstance(content, str):
            return self.tokenize(content, add_special=add_special)
        if not isinstance(content, list):
            raise BadRequest('"content" must be a string or an array of strings and tokens')
        tokens = [(BOS_ID, BOS)] if add_special else []
        for part in content:
            if isinstance(part, str):
                tokens.extend(self.tokenize(part))
            elif isinstance(part, int) and not isinstance(part, bool):
                tokens.append((part, self._pieces.get(part, "")))
            else:
                raise BadRequest('"content" must be a string or an array of strings and tokens')
        return tokens

    def detokenize(self, tokens: object) -> str:
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise BadRequest('"tokens" must be an array of integers')
        return "".join(self._pieces.get(token, "") for token in tokens)


def tokenize_answer(vocabulary: Vocabulary, body: Mapping[str, Any]) -> dict[str, Any]:
    if "content" not in body:
        return {"tokens": []}
    tokens = vocabulary.tokenize_mixed(body["content"], add_special=body.get("add_special") is True)
    if body.get("with_pieces") is True:
        return {"tokens": [{"id": token, "piece": piece} for token, piece in tokens]}
    return {"tokens": [token for token, _ in tokens]}


# Embeddings and reranking.


def _prompts(source: object) -> list[str]:
    """The inputs of an embeddings request: one string, strings, or token id lists."""
    if isinstance(source, str):
        return [source]
    if isinstance(source, list):
        if source and all(isinstance(t, int) for t in source):
            return [" ".join(map(str, source))]
        prompts = []
        for item in source:
            if isinstance(item, str):
                prompts.append(item)
            elif isinstance(item, list) and all(isinstance(t, int) for t in item):
                prompts.append(" ".join(map(str, item)))
            else:
                raise BadRequest('"input" must be a string or an array of strings or tokens')
        return prompts
    raise BadRequest('"input" must be a string or an array of strings or tokens')


def embedding(text: str, normalize: int = 2) -> list[float]:
    """A deterministic vector for a text, normalized as llama-server's `embd_normalize` says."""
    digest = hashlib.sha256(text.encode()).digest()
    vector = [(byte - 127.5) / 127.5 for byte in digest[:N_EMBD]]
    if normalize == -1:
        return vector
    if normalize == 0:
        scale = max(abs(x) for x in vector) / 32760.0
    elif normalize == 2:
        scale = sum(x * x for x in vector) ** 0.5
    else:
        scale = sum(abs(x) ** normalize for x in vector) ** (1.0 / normalize)
    return [x / scale for x in vector] if scale else vector


@dataclass(frozen=True, slots=True)
class EmbeddingsAsk:
    prompts: list[str]
    oai: bool  # OpenAI's list shape, or llama-server's own
    base64: bool
    normalize: int


def embeddings_ask(body: Mapping[str, Any], oai: bool) -> EmbeddingsAsk:
    if "input" in body:
        source = body["input"]
    elif "content" in body:
        source, oai = body["content"], False  # "content" is not OpenAI's: the native answer
    else:
        raise BadRequest('"input" or "content" must be provided')
    use_base64 = False
    if "encoding_format" in body:
        if body["encoding_format"] == "base64":
            use_base64 = True
        elif body["encoding_format"] != "float":
            raise BadRequest(
                "The format to return the embeddings in. Can be either float or base64"
            )
    prompts = _prompts(source)
    if not prompts or any(not words(p) for p in prompts):
        raise BadRequest("Input content cannot be empty")
    normalize = body.get("embd_normalize", 2)
    if not isinstance(normalize, int) or isinstance(normalize, bool):
        raise BadRequest('"embd_normalize" must be an integer')
    return EmbeddingsAsk(prompts, oai, use_base64, normalize)


def embeddings_answer(ask: EmbeddingsAsk, model: str) -> object:
    vectors = [embedding(p, ask.normalize) for p in ask.prompts]
    if not ask.oai:
        return [{"index": i, "embedding": [v]} for i, v in enumerate(vectors)]
    data: list[dict[str, Any]] = []
    for i, vector in enumerate(vectors):
        if ask.base64:
            packed = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append(
                {
                    "embedding": packed,
                    "index": i,
                    "object": "embedding",
                    "encoding_format": "base64",
                }
            )
        else:
            data.append({"embedding": vector, "index": i, "object": "embedding"})
    n = sum(len(words(p)) for p in ask.prompts)
    return {
        "model": model,
        "object": "list",
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "data": data,
    }


def rerank_answer(body: Mapping[str, Any], model: str) -> object:
    """Jina's shape (`documents`, `relevance_score`), or TEI's when the body has `texts`.

    A document's score is the share of the query's words it contains.
    """
    tei = "texts" in body
    query = body.get("query")
    if "query" not in body:
        raise BadRequest('"query" must be provided')
    if not isinstance(query, str):
        raise BadRequest('"query" must be a string')
    documents = body.get("documents", body.get("texts"))
    if (
        not isinstance(documents, list)
        or not documents
        or not all(isinstance(d, str) for d in documents)
    ):
        raise BadRequest('"documents" must be a non-empty string array')
    top_n = body.get("top_n", len(documents))
    if not isinstance(top_n, int) or isinstance(top_n, bool):
        raise BadRequest('"top_n" must be an integer')
    asked = {w.lower() for w in words(query)}
    label = "score" if tei else "relevance_score"
    results = []
    n_tokens = 0
    for index, document in enumerate(documents):
        have = {w.lower() for w in words(document)}
        score = len(asked & have) / len(asked) if asked else 0.0
        n_tokens += len(words(query)) + len(words(document))
        result: dict[str, Any] = {"index": index, label: score}
        if tei and body.get("return_text") is True:
            result["text"] = document
        results.append(result)
    results.sort(key=lambda r: r[label], reverse=True)
    results = results[: max(top_n, 0)]
    if tei:
        return results
    return {
        "model": body.get("model", model),
        "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "results": results,
    }


# Server documents.


def props(
    *,
    model: str,
    total_slots: int,
    endpoint_slots: bool,
    endpoint_props: bool,
    endpoint_metrics: bool,
) -> dict[str, Any]:
    return {
        "default_generation_settings": {
            "params": GENERATION_PARAMS,
            "n_ctx": N_CTX,
            "model": model,
        },
        "total_slots": total_slots,
        "model_alias": model,
        "model_ftype": "Q4_K - Medium",
        "model_path": f"/models/{model or 'model'}.gguf",
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media__>",
        "endpoint_slots": endpoint_slots,
        "endpoint_props": endpoint_props,
        "endpoint_metrics": endpoint_metrics,
        "ui": False,
        "ui_settings": {},
        "chat_template": CHATML_TEMPLATE,
        "chat_template_caps": {},
        "bos_token": BOS,
        "eos_token": EOS,
        "build_info": BUILD_INFO,
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    }


def router_props(models_max: int, autoload: bool) -> dict[str, Any]:
    """The router's own /props (no `?model=`), with the dummy fields llama-server puts in."""
    return {
        "role": "router",
        "max_instances": models_max,
        "models_autoload": autoload,
        "model_alias": "llama-server",
        "model_path": "none",
        "default_generation_settings": {"params": {}, "n_ctx": 0},
        "ui_settings": {},
        "build_info": BUILD_INFO,
        "cors_proxy_enabled": False,
    }


@dataclass(frozen=True, slots=True)
class SlotView:
    """A slot as /slots shows it: `task` is the id of the request it runs, or None if idle."""

    id: int
    task: int | None
    n_decoded: int


def slots(views: Iterable[SlotView]) -> list[dict[str, Any]]:
    return [
        {
            "id": view.id,
            "id_task": view.task if view.task is not None else -1,
            "n_ctx": N_CTX,
            "speculative": False,
            "is_processing": view.task is not None,
            "params": GENERATION_PARAMS,
            "next_token": {
                "has_next_token": view.task is not None,
                "has_new_line": False,
                "n_remain": -1,
                "n_decoded": view.n_decoded,
            },
        }
        for view in views
    ]


@dataclass(slots=True)
class Counters:
    """What llama-server counts for /metrics, per model instance."""

    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    predicted_tokens: int = 0
    predicted_ms: float = 0.0
    n_decode: int = 0
    n_busy_slots: int = 0
    n_tokens_max: int = 0

    def add(self, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> None:
        self.prompt_tokens += prompt_n
        self.prompt_ms += prompt_ms
        self.predicted_tokens += predicted_n
        self.predicted_ms += predicted_ms
        # One decode for the prompt, one per generated token.
        self.n_decode += 1 + predicted_n
        self.n_busy_slots += 1 + predicted_n
        self.n_tokens_max = max(self.n_tokens_max, prompt_n + predicted_n)


_METRICS = (
    # name, type, help
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed."),
    ("prompt_seconds_total", "counter", "Prompt process time in seconds."),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed."),
    ("tokens_predicted_seconds_total", "counter", "Predict process time in seconds."),
    ("n_decode_total", "counter", "Total Number of llama_decode() calls."),
    ("n_tokens_max", "counter", "High watermark of the context size observed."),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call."),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s."),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s."),
    ("requests_processing", "gauge", "Number of requests processing."),
    ("requests_deferred", "gauge", "Number of requests deferred."),
)


def metrics_text(counters: Counters, processing: int) -> str:
    """Prometheus text with llama-server's `llamacpp:` metric names."""
    c = counters
    values: dict[str, float | int] = {
        "prompt_tokens_total": c.prompt_tokens,
        "prompt_seconds_total": c.prompt_ms / 1000,
        "tokens_predicted_total": c.predicted_tokens,
        "tokens_predicted_seconds_total": c.predicted_ms / 1000,
        "n_decode_total": c.n_decode,
        "n_tokens_max": c.n_tokens_max,
        "n_busy_slots_per_decode": c.n_busy_slots / c.n_decode if c.n_decode else 0.0,
        "prompt_tokens_seconds": 1000 * c.prompt_tokens / c.prompt_ms if c.prompt_ms else 0.0,
        "predicted_tokens_seconds": (
            1000 * c.predicted_tokens / c.predicted_ms if c.predicted_ms else 0.0
        ),
        "requests_processing": processing,
        "requests_deferred": 0,
    }
    lines = []
    for name, kind, help_text in _METRICS:
        lines += [
            f"# HELP llamacpp:{name} {help_text}",
            f"# TYPE llamacpp:{name} {kind}",
            f"llamacpp:{name} {values[name]}",
        ]
    return "\n".join(lines) + "\n"


def _model_meta() -> dict[str, Any]:
    return {
        "vocab_type": 2,
        "n_vocab": 2**31 - 1,
        "n_ctx": N_CTX,
        "n_ctx_train": N_CTX,
        "n_embd": N_EMBD,
        "n_params": 1_000_000,
        "size": 1_000_000,
        "ftype": "Q4_K - Medium",
    }


def model_list(models: Iterable[str], created: int, aliases: Iterable[str] = ()) -> dict[str, Any]:
    """A single-model server's /v1/models: OpenAI's `data` and Ollama's `models`. `aliases`:
    the first model's other names (`--alias first,other`), which its entry lists with it."""
    names = list(models)
    others = {name: [name] for name in names}
    if names:
        others[names[0]] = list(dict.fromkeys([names[0], *aliases]))
    return {
        "models": [
            {
                "name": name,
                "model": name,
                "modified_at": "",
                "size": "",
                "digest": "",
                "type": "model",
                "description": "",
                "tags": [""],
                "capabilities": ["completion"],
                "parameters": "",
                "details": {
                    "parent_model": "",
                    "format": "gguf",
                    "family": "",
                    "families": [""],
                    "parameter_size": "",
                    "quantization_level": "",
                },
            }
            for name in names
        ],
        "object": "list",
        "data": [
            {
                "id": name,
                "aliases": others[name],
                "tags": [],
                "object": "model",
                "created": created,
                "owned_by": "llamacpp",
                "meta": _model_meta(),
            }
            for name in names
        ],
    }


@dataclass(frozen=True, slots=True)
class RouterEntry:
    """One model of a router: its name, status ("unloaded", "loading", "loaded") and the exit
    code of its last instance (non-zero: the last load failed)."""

    name: str
    status: str
    exit_code: int = 0


def router_model_list(entries: Iterable[RouterEntry], created: int) -> dict[str, Any]:
    """A router's /models and /v1/models: every model it can load, with its status."""
    data = []
    for entry in entries:
        args = ["llama-server", "--model", f"/models/{entry.name}.gguf", "--alias", entry.name]
        status: dict[str, Any] = {"value": entry.status, "args": args}
        if entry.status == "unloaded" and entry.exit_code != 0:
            status |= {"exit_code": entry.exit_code, "failed": True}
        info: dict[str, Any] = {
            "id": entry.name,
            "aliases": [],
            "tags": [],
            "object": "model",
            "owned_by": "llamacpp",
            "created": created,
            "status": status,
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "source": "models_dir",
            "can_remove": False,
        }
        if entry.status == "loaded":
            info["meta"] = _model_meta()
        data.append(info)
    return {"data": data, "object": "list"}


def lora_adapters(paths: Iterable[str], scales: Mapping[int, float]) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "path": path,
            "scale": scales.get(i, 1.0),
            "task_name": "",
            "prompt_prefix": "",
        }
        for i, path in enumerate(paths)
    ]
