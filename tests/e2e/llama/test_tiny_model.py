"""The tiny model llama-server runs in these tests: its shape, and its borrowed tokenizer.

These need no llama-server binary: they run everywhere, on a vocab file made here.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tests.e2e.llama.tiny_model import N_EMBD, N_LAYER, main, write_tiny_model

TOKENS = ["<unk>", "<s>", "</s>", *(f"tok{i}" for i in range(97))]


def vocab_file(path: Path, tokens: list[str] = TOKENS) -> Path:
    """A vocab-only GGUF like llama.cpp's models/ggml-vocab-*.gguf: tokenizer keys, no tensors."""
    writer = gguf.GGUFWriter(path, "llama")
    if tokens:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_model_has_two_64_wide_layers_and_the_vocab_files_tokenizer(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf", vocab_file(tmp_path / "vocab.gguf"))

    reader = gguf.GGUFReader(model)
    fields = reader.fields
    tensors = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.block_count"].contents() == N_LAYER == 2
    assert fields["llama.embedding_length"].contents() == N_EMBD == 64
    assert fields["tokenizer.ggml.tokens"].contents() == TOKENS
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 1
    assert "<|im_start|>" in fields["tokenizer.chat_template"].contents()
    assert tensors["token_embd.weight"] == [64, len(TOKENS)]
    assert {f"blk.{i}.attn_q.weight" for i in range(2)} <= set(tensors)
    assert "blk.2.attn_q.weight" not in tensors


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_weights(tmp_path):
    vocab = vocab_file(tmp_path / "vocab.gguf")

    one = write_tiny_model(tmp_path / "a.gguf", vocab, seed=1).read_bytes()
    again = write_tiny_model(tmp_path / "b.gguf", vocab, seed=1).read_bytes()
    other = write_tiny_model(tmp_path / "c.gguf", vocab, seed=2).read_bytes()

    assert one == again and one != other and len(one) == len(other)


def test_a_file_without_a_tokenizer_is_refused_with_a_clear_error(tmp_path):
    vocab = vocab_file(tmp_path / "empty.gguf", tokens=[])

    with pytest.raises(ValueError, match="has no tokenizer.ggml.tokens: not a vocab GGUF"):
        write_tiny_model(tmp_path / "tiny.gguf", vocab)


def test_the_command_says_what_to_run_when_no_vocab_is_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CROSSBAR_LLAMA_CACHE", str(tmp_path / "empty-cache"))

    assert main([str(tmp_path / "tiny.gguf")]) == 2

    assert "run `make llama-server`" in capsys.readouterr().err
    assert not (tmp_path / "tiny.gguf").exists()
