"""bench/tiny_model.py writes a llama GGUF whose sampled tokens are always word pieces;
bench/llama_engine.py's build flags keep the cache portable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.llama_engine import build_flags
from bench.tiny_model import TinyModel, write_tiny_model

gguf = pytest.importorskip("gguf")

SMALL = TinyModel(layers=2, hidden=64, ff=128, heads=4, kv_heads=2, vocab=400, context=256)


def test_the_model_reads_back_with_its_shape_and_vocabulary(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_tiny_model(tmp_path / "m.gguf", SMALL))
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert int(fields["llama.block_count"].parts[-1][0]) == 2
    assert int(fields["llama.embedding_length"].parts[-1][0]) == 64
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 9 * 2
    params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert params == SMALL.parameters
    types = fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    assert kinds[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert kinds[3:259] == [gguf.TokenType.BYTE] * 256
    assert set(kinds[259:]) == {gguf.TokenType.NORMAL}


def test_only_word_pieces_can_be_sampled(tmp_path: Path) -> None:
    """Dimension 0 of the residual stream is 1 in every embedding and no layer writes to
    it, so after the final norm it is positive; the output weights make it a logit of
    -1000 x that for the byte and special tokens and leave the word pieces free."""
    reader = gguf.GGUFReader(write_tiny_model(tmp_path / "m.gguf", SMALL))
    t = {x.name: np.asarray(x.data, dtype=np.float32) for x in reader.tensors}
    assert np.all(t["token_embd.weight"][:, 0] == 1.0)
    for i in range(SMALL.layers):
        assert not t[f"blk.{i}.attn_output.weight"][0].any()
        assert not t[f"blk.{i}.ffn_down.weight"][0].any()
    output = t["output.weight"]
    assert np.all(output[:259, 0] == -1000.0) and not output[:259, 1:].any()
    assert not output[259:, 0].any() and output[259:, 1:].any()
    # a final hidden state with dimension 0 positive: the suppressed logits are far below
    hidden = np.random.default_rng(1).standard_normal(SMALL.hidden).astype(np.float32)
    hidden[0] = 1.0
    logits = output @ hidden
    assert logits[:259].max() < logits[259:].min() - 900


def test_the_build_is_portable_and_names_its_instruction_sets() -> None:
    level, flags = build_flags()
    assert "-DGGML_NATIVE=OFF" in flags and "-DLLAMA_USE_PREBUILT_UI=OFF" in flags
    assert "-DLLAMA_OPENSSL=OFF" in flags and "-DBUILD_SHARED_LIBS=OFF" in flags
    if level.startswith("x86_64-"):
        on = {f.split("=")[0][len("-DGGML_"):].lower() for f in flags if f.endswith("=ON")
              and f.startswith("-DGGML_")}  # fmt: skip
        assert level == "x86_64-" + ("-".join(i for i in ("avx", "avx2", "fma", "f16c", "bmi2")
                                              if i in on) or "baseline")  # fmt: skip
