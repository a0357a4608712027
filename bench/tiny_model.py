"""A random-weight llama-architecture model in GGUF, for a real engine with nothing to
download: llama.cpp's server runs it at the speed of a model of its size.

    python -m bench.tiny_model OUT.gguf [--layers 10 --hidden 1024 --ff 2816 --vocab 8192]

Written with ``gguf`` (llama.cpp's own writer): an SPM vocabulary (``<unk>``, ``<s>``,
``</s>``, the 256 byte tokens, then lower-case word pieces of one to three letters, so a
prompt is about as many tokens as a real vocabulary makes it), f16 weights drawn from
a seeded generator, f32 norms. The server sends nothing for a token that leaves
incomplete UTF-8, and a special token may end the stream; so the model never picks a
byte or special token: hidden dimension 0 of the residual stream is a constant (every
embedding has 1 there and no layer writes to it), and the output weights turn that
dimension into a logit of about -1000 for those tokens and 0 for the word pieces. Every
generated token is then one non-empty text chunk, and the stream runs to ``max_tokens``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TinyModel", "ensure_model", "write_tiny_model"]

_SPECIAL = ("<unk>", "<s>", "</s>")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True, slots=True)
class TinyModel:
    """The shape of the model. The default is about 145 M parameters."""

    layers: int = 10
    hidden: int = 1024
    ff: int = 2816
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 8192
    context: int = 16384
    seed: int = 0

    @property
    def parameters(self) -> int:
        per_layer = 2 * self.hidden * self.hidden  # q, output
        per_layer += 2 * self.hidden * (self.hidden // self.heads * self.kv_heads)  # k, v
        per_layer += 3 * self.hidden * self.ff + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


def _pieces(count: int) -> list[str]:
    """``count`` word pieces, shortest first: ``▁``, then letters and letter pairs with
    and without the word-start mark, then marked triples; English text tokenizes into
    about one piece per three characters, as a real vocabulary makes it."""
    pieces = ["\u2581"]
    for size in (1, 2, 3):
        words = [""]
        for _ in range(size):
            words = [w + c for w in words for c in _LETTERS]
        starts = ("\u2581",) if size == 3 else ("\u2581", "")
        pieces += [start + w for w in words for start in starts]
        if len(pieces) >= count:
            break
    if len(pieces) < count:
        raise ValueError(f"at most {len(pieces)} word pieces")
    return pieces[:count]


def write_tiny_model(path: Path, shape: TinyModel = TinyModel()) -> Path:
    """Write the model to ``path`` (replaced if present); returns ``path``."""
    import gguf
    import numpy as np

    if shape.vocab <= len(_SPECIAL) + 256 or shape.hidden % shape.heads:
        raise ValueError("vocab must exceed the 259 special and byte tokens; heads | hidden")
    rng = np.random.default_rng(shape.seed)
    h, kv = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    tokens = [*_SPECIAL, *(f"<0x{b:02X}>" for b in range(256))]
    tokens += _pieces(shape.vocab - len(tokens))
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (shape.vocab - len(types))
    suppressed = len(_SPECIAL) + 256

    def weights(rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float16)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("headroom-tiny-random")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(h)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(h // shape.heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    # SPM merges the highest-scoring pairs first: longer pieces score higher
    writer.add_token_scores([0.0] * suppressed + [float(len(t)) for t in tokens[suppressed:]])
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    embed = weights(shape.vocab, h)
    embed[:, 0] = 1.0  # the constant dimension
    writer.add_tensor("token_embd.weight", embed)
    for i in range(shape.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weights(h, h))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weights(kv, h))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weights(kv, h))
        out = weights(h, h)
        out[0, :] = 0.0  # nothing is added to the constant dimension
        writer.add_tensor(f"blk.{i}.attn_output.weight", out)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(shape.ff, h))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(shape.ff, h))
        down = weights(h, shape.ff)
        down[0, :] = 0.0
        writer.add_tensor(f"blk.{i}.ffn_down.weight", down)
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    output = weights(shape.vocab, h, scale=0.5)
    output[:, 0] = 0.0
    output[:suppressed, :] = 0.0
    output[:suppressed, 0] = -1000.0
    writer.add_tensor("output.weight", output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


#: Bumped whenever the file a shape gives changes (the cached copies are then rewritten).
_FORMAT = 2


def ensure_model(cache: Path, shape: TinyModel = TinyModel()) -> Path:
    """The model for ``shape`` in the directory ``cache``, written first if absent."""
    path = cache / (f"tiny-{shape.layers}x{shape.hidden}x{shape.ff}-h{shape.heads}"
                    f"-{shape.kv_heads}-v{shape.vocab}-s{shape.seed}-f{_FORMAT}.gguf")  # fmt: skip
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        write_tiny_model(path.with_suffix(".tmp"), shape)
        path.with_suffix(".tmp").replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    defaults = TinyModel()
    for name in ("layers", "hidden", "ff", "heads", "kv_heads", "vocab", "context", "seed"):
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name)
        )
    args = parser.parse_args(argv)
    shape = TinyModel(**{k: v for k, v in vars(args).items() if k != "out"})
    write_tiny_model(args.out, shape)
    print(f"{args.out}: {shape.parameters / 1e6:.1f} M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
