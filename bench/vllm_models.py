"""Tiny random-weight models for vLLM, built with transformers from fixed seeds and text.

    VENV/bin/python bench/vllm_models.py {llama,whisper} OUT_DIR

Run with the Python of the engine's virtualenv (:mod:`bench.vllm_engine` does), whose
transformers, tokenizers and torch are the ones vLLM loads the model with; nothing is
fetched from a hub. This file imports nothing from the project.

- ``llama``: ``LlamaForCausalLM`` with 2 layers, hidden size 128, a byte-level BPE
  vocabulary of about 400 tokens trained on a few sentences, ``<s>``/``</s>`` and a chat
  template. Its weights are random, so it picks any token: many are pieces of a UTF-8
  character and stream as empty text. Count its tokens from the engine's fields (usage,
  token ids), not from the text.
- ``whisper``: a ``WhisperForConditionalGeneration`` with one encoder and one decoder
  layer of width 64, 80 mel bins, Whisper's special tokens (``<|endoftext|>``,
  ``<|startoftranscript|>``, a token per language, ``<|transcribe|>``, ``<|translate|>``,
  ``<|notimestamps|>`` ...) on a byte-level BPE like the Llama's, and Whisper's processor
  (feature extractor and tokenizer).
- ``qwen3asr``: Qwen3-ASR for vLLM's ``/v1/realtime`` (architecture
  ``Qwen3ASRRealtimeGeneration``, vLLM's own ``qwen3_asr`` config with a thinker of one
  audio-encoder layer of width 64 and a 2-layer Qwen3 of width 128), a byte-level BPE with
  the chat and audio special tokens (``<|im_start|>``, ``<|audio_start|>``,
  ``<|audio_pad|>`` ...) and transformers' Qwen3-ASR processor. No weights are written:
  vLLM fills them at random (:data:`SERVER_ARGS`, ``--load-format dummy``) from its seed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 0
TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "hello world this is a tiny model speaking",
    "speech tokens stream fast and far across the wire",
    "a gateway admits a session only when the engine keeps up",
] * 50


def _bpe(vocab_size: int, special: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ") if isinstance(m, str) else m) for m in model["merges"]]
    return dict(model["vocab"]), merges


CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def build_llama(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab, merges = _bpe(400, ["<unk>", "<s>", "</s>"])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


def build_whisper(out: Path) -> None:
    import torch
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    special = ["<|endoftext|>", "<|startoftranscript|>",
               *(f"<|{code}|>" for code in LANGUAGES),
               "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>",
               "<|prev|>", "<|nocaptions|>", "<|notimestamps|>"]  # fmt: skip
    vocab, merges = _bpe(len(special) + 400, special)
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": special[1:]})
    features = WhisperFeatureExtractor(feature_size=80)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(out)
    torch.manual_seed(SEED)
    eot, sot = vocab["<|endoftext|>"], vocab["<|startoftranscript|>"]
    config = WhisperConfig(
        vocab_size=len(vocab), num_mel_bins=80, d_model=64, encoder_layers=1,
        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500,
        max_target_positions=448, pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=sot, begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    WhisperForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out)


def build_qwen3asr(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen3_asr import Qwen3ASRFeatureExtractor, Qwen3ASRProcessor

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>",
               "<|audio_end|>", "<|audio_pad|>", "<timestamp>"]  # fmt: skip
    vocab, merges = _bpe(400, special)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"audio_token": "<|audio_pad|>",
                              "audio_bos_token": "<|audio_start|>",
                              "audio_eos_token": "<|audio_end|>"},
    )  # fmt: skip
    features = Qwen3ASRFeatureExtractor(feature_size=128)
    Qwen3ASRProcessor(feature_extractor=features, tokenizer=fast).save_pretrained(out)
    config = {
        "architectures": ["Qwen3ASRRealtimeGeneration"],
        "model_type": "qwen3_asr",
        "support_languages": ["English"],
        "thinker_config": {
            "audio_config": {"num_mel_bins": 128, "encoder_layers": 1,
                             "encoder_attention_heads": 2, "encoder_ffn_dim": 128,
                             "d_model": 64, "output_dim": 128,
                             "downsample_hidden_size": 32, "n_window": 50,
                             "n_window_infer": 800},
            "text_config": {"vocab_size": len(vocab), "hidden_size": 128,
                            "intermediate_size": 256, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "num_key_value_heads": 2,
                            "head_dim": 64, "max_position_embeddings": 4096,
                            "tie_word_embeddings": True},
            "audio_token_id": vocab["<|audio_pad|>"],
            "audio_start_token_id": vocab["<|audio_start|>"],
        },
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")


BUILDERS = {"llama": build_llama, "whisper": build_whisper, "qwen3asr": build_qwen3asr}
#: What a model needs on vLLM's command line beyond the usual.
SERVER_ARGS: dict[str, list[str]] = {"qwen3asr": ["--load-format", "dummy"]}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in BUILDERS:
        print(f"usage: vllm_models.py {{{','.join(BUILDERS)}}} OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    BUILDERS[argv[0]](out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
