"""A tiny SentencePiece vocabulary in a GGUF, as llama.cpp's converter writes one.

`train` trains a BPE SentencePiece model on a small corpus (byte fallback, identity
normalization, spaces kept, as Llama 2 / Mistral / Gemma models are); `spm_gguf` writes its
pieces, scores and piece types into a tiny llama GGUF (tests/gguf_builders.py) with BOS/EOS,
Gemma's end-of-turn token and a chat template. Used by tests/integration/test_gguf_tokenizer.py
and test_gguf_serve.py.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sentencepiece as spm
from gguf import GGMLQuantizationType as Q
from gguf_builders import arch_keys, tensor_names, write_gguf

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé über straße. Ça va? Très bien, merci.",
    "東京は日本の首都です。大阪も大きい都市です。",
    "Hello world! How are you today?\n  Indented line\tand a tab.",
    "print('hello')  # code with  double  spaces and 12345 digits",
    "<start_of_turn>user\nHi there<end_of_turn>",
]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


def train(add_dummy_prefix: bool) -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 30),
        model_writer=model,
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        character_coverage=0.995,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        minloglevel=2,
        num_threads=1,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def piece_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    """llama.cpp's convert_hf_to_gguf.py `SentencePieceTokenTypes` for piece `i`."""
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_unused(i):
        return 5
    if sp.is_byte(i):
        return 6
    if sp.id_to_piece(i) in ("<start_of_turn>", "<end_of_turn>"):
        return 4  # user defined
    return 1


def spm_gguf(
    path: Path,
    sp: spm.SentencePieceProcessor,
    add_space_prefix: bool,
    qtype_of: Callable[[str], Q] = lambda _n: Q.Q8_0,
) -> Path:
    n = sp.get_piece_size()
    meta: dict[str, Any] = {
        **arch_keys("llama", n),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
        "tokenizer.ggml.token_type": [piece_type(sp, i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.eot_token_id": sp.piece_to_id("<end_of_turn>"),  # as Gemma's files
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
        "tokenizer.chat_template": TEMPLATE,
    }
    return write_gguf(path, "llama", meta, tensor_names("llama"), qtype_of)
