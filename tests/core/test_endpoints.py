"""Which llama-server paths the gateway serves, and as what kind (`routing.core.endpoints`)."""

from __future__ import annotations

import pytest

from routing.core.endpoints import Kind, kind_of


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/chat/completions", Kind.GENERATE),
        ("/chat/completions", Kind.GENERATE),
        ("/v1/embeddings", Kind.GENERATE),
        ("/v1/models", Kind.MODELS),
        ("/models", Kind.MODELS),
    ],
)
def test_openai_paths_are_served_with_and_without_v1(path: str, kind: Kind) -> None:
    assert kind_of(path) is kind


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/v1/messages", Kind.GENERATE),
        ("/v1/messages/count_tokens", Kind.INSPECT),
        ("/v1/responses/input_tokens", Kind.INSPECT),
    ],
)
def test_anthropic_and_token_count_paths_are_served_only_under_v1(path: str, kind: Kind) -> None:
    assert kind_of(path) is kind
    assert kind_of(path.removeprefix("/v1")) is None


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/completion", Kind.GENERATE),
        ("/infill", Kind.GENERATE),
        ("/tokenize", Kind.INSPECT),
        ("/health", Kind.HOST),
        ("/slots", Kind.HOST),
        ("/models/load", Kind.MANAGE),
    ],
)
def test_native_paths_are_served_only_without_v1(path: str, kind: Kind) -> None:
    assert kind_of(path) is kind
    assert kind_of("/v1" + path) is None


def test_a_path_served_both_natively_and_under_v1_has_one_kind() -> None:
    assert kind_of("/chat/completions/input_tokens") is Kind.INSPECT
    assert kind_of("/v1/chat/completions/input_tokens") is Kind.INSPECT


@pytest.mark.parametrize(
    "path",
    [
        "",
        "v1/chat/completions",  # no leading slash
        "xhealth",
        "/hosts/gpu1/health",  # the operator's per-host paths are the gateway's own
        "/v1/../health",
        "/v1//chat/completions",
        "/v1/",
        "/v2/chat/completions",
    ],
)
def test_anything_else_is_not_served(path: str) -> None:
    assert kind_of(path) is None
