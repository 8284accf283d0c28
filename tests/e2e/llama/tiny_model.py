"""Writes a tiny llama GGUF (2 layers, 64 wide, random weights) that llama-server loads.

The tokenizer (llama's SentencePiece vocab, 32,000 tokens) comes from a vocab-only GGUF of
llama.cpp's models/ directory, so prompts tokenize as they would for a real llama; the weights
are noise, so the text is gibberish, but every endpoint answers in milliseconds on one thread.

    .venv/bin/python -m tests.e2e.llama.tiny_model OUT.gguf [--vocab PATH] [--seed N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.e2e.llama.locate import NOT_BUILT, vocab_path

try:
    import gguf
    import numpy as np
except ImportError as exc:  # reported by write_tiny_model, not as a traceback at import
    gguf = None  # type: ignore[assignment]  # None: the module is missing
    _MISSING = f"the tiny model needs the gguf package ({exc}): " + (
        ".venv/bin/pip install -r requirements-dev.txt"
    )

N_LAYER = 2
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2  # grouped-query attention, as most served models have
N_FF = 128
N_CTX_TRAIN = 4096
NAME = "crossbar-tiny"

# ChatML: llama.cpp recognises it by name and renders it with or without --jinja, so
# /v1/chat/completions, /apply-template and /v1/messages all have a template to use.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class MissingDependency(RuntimeError):
    """The gguf package (requirements-dev.txt) is not installed."""


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab: Path) -> int:
    """Copies every tokenizer.* key of the vocab file; returns the vocabulary's size."""
    reader = gguf.GGUFReader(vocab)
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    if not n_vocab:
        raise ValueError(f"{vocab} has no tokenizer.ggml.tokens: not a vocab GGUF")
    return n_vocab


def write_tiny_model(out: Path, vocab: Path, seed: int = 0) -> Path:
    """Writes the model to `out` and returns it; the same seed gives the same bytes.

    Raises MissingDependency without the gguf package, ValueError for a file with no vocab.
    """
    if gguf is None:
        raise MissingDependency(_MISSING)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(NAME)
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = _copy_tokenizer(writer, vocab)
    writer.add_vocab_size(n_vocab)
    writer.add_chat_template(CHAT_TEMPLATE)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    ones = np.ones(N_EMBD, dtype=np.float32)
    head_dim = N_EMBD // N_HEAD
    # numpy shapes are (rows, cols) = GGUF's (ne1, ne0); no output.weight: llama ties it to
    # token_embd, which halves the file.
    writer.add_tensor("token_embd.weight", weight(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", ones)
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(N_HEAD_KV * head_dim, N_EMBD))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(N_EMBD, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(N_FF, N_EMBD))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(N_EMBD, N_FF))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--vocab", type=Path, help="a vocab-only GGUF (default: the cache's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    vocab = args.vocab or vocab_path()
    if vocab is None or not vocab.is_file():
        print(f"tiny_model: no vocab file ({vocab or 'none cached'}); {NOT_BUILT}", file=sys.stderr)
        return 2
    try:
        write_tiny_model(args.out, vocab, args.seed)
    except (MissingDependency, ValueError) as exc:
        print(f"tiny_model: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
