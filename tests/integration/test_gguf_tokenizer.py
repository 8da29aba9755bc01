"""SentencePiece ("llama") GGUF vocabularies become tokenizers that encode as SentencePiece does.

A tiny BPE SentencePiece model is trained (tests/spm_gguf.py: the `sentencepiece` package,
byte fallback, identity normalization, spaces kept, as Llama 2 / Mistral / Gemma models are),
its pieces, scores and piece types written into a GGUF as llama.cpp's converter writes them;
the daemon's tokenizer must give SentencePiece's own ids for Unicode-heavy text (emoji and CJK
outside the vocabulary: bytes), decode them back, stream them back through mlx-lm's
detokenizer, and keep the file's BOS/EOS and chat template (docs/models.md).
"""

from __future__ import annotations

from pathlib import Path

import mlx_lm
import pytest
import sentencepiece as spm
from gguf import GGMLQuantizationType as Q
from gguf_builders import arch_keys, tensor_names, write_gguf
from mlxcel.daemon.models import convert_gguf, load_model
from spm_gguf import spm_gguf, train

TEXTS = [
    "Hello world! Café 東京 😀 naïve\n\n  two  spaces\tтекст ½ end ",
    " leading space and trailing  ",
    "日本語のテキスト、絵文字🎉🇫🇷 and accents: àéîõü ÀÉÎÕÜ ñ ç ß",
    "line one\nline two\r\nline three\n",
    "x",
]


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def spm_case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[spm.SentencePieceProcessor, Path]:
    sp = train(add_dummy_prefix=request.param)
    path = spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", sp, request.param)
    return sp, path


def test_encoding_equals_sentencepiece_and_round_trips(
    spm_case: tuple[spm.SentencePieceProcessor, Path],
) -> None:
    sp, path = spm_case
    tokenizer = load_model(str(path)).tokenizer
    for text in TEXTS:
        expected = sp.encode(text)
        assert any(sp.is_byte(i) for i in sp.encode("😀")), "emoji should be byte pieces"
        ids = tokenizer.encode(text)
        assert ids == [sp.bos_id(), *expected], text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert sp.decode(expected) == text
        detok = tokenizer.detokenizer
        detok.reset()
        for token in expected:
            detok.add_token(token)
        detok.finalize()
        assert detok.text == text, (text, detok.text)


def test_user_defined_pieces_are_whole_and_the_template_bos_eos_hold(
    spm_case: tuple[spm.SentencePieceProcessor, Path],
) -> None:
    sp, path = spm_case
    loaded = load_model(str(path))
    tokenizer = loaded.tokenizer
    turn = sp.piece_to_id("<start_of_turn>")
    # llama.cpp splits the text at user-defined pieces and encodes each stretch on its own
    # (with its space prefix); SentencePiece would put a lone "▁" before the piece instead.
    assert tokenizer.encode("<start_of_turn>user\nHi") == [
        sp.bos_id(),
        turn,
        *sp.encode("user\nHi"),
    ]
    # generation stops at EOS and at the end-of-turn token, as llama.cpp's does
    assert tokenizer.eos_token_ids == {sp.eos_id(), sp.piece_to_id("<end_of_turn>")}
    messages = [{"role": "user", "content": "Hi 😀"}, {"role": "assistant", "content": "Yo"}]
    ids = tokenizer.apply_chat_template(messages)
    assert ids[0] == sp.bos_id() and ids.count(sp.bos_id()) == 1  # the template's BOS only
    assert ids[-1] == sp.eos_id()
    assert tokenizer.decode(ids, skip_special_tokens=True).endswith("Yo")


def test_the_converted_directory_tokenizes_the_same_in_stock_mlx_lm(
    spm_case: tuple[spm.SentencePieceProcessor, Path], tmp_path: Path
) -> None:
    sp, path = spm_case
    out = convert_gguf(path, tmp_path / "dir")
    _, tokenizer = mlx_lm.load(str(out))
    for text in TEXTS:
        assert tokenizer.encode(text) == [sp.bos_id(), *sp.encode(text)], text
    assert type(tokenizer.detokenizer).__name__ == "SPMStreamingDetokenizer"
    assert tokenizer.eos_token_ids == {sp.eos_id(), sp.piece_to_id("<end_of_turn>")}


# Qwen2's tokenizer.json pre-tokenizer, as the Qwen2/2.5/3 repos ship it.
QWEN2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {
            "type": "Split",
            "pattern": {
                "Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
                "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
            },
            "behavior": "Isolated",
            "invert": False,
        },
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
    ],
}


def test_a_qwen2_pre_tokenizer_splits_as_qwen2s_tokenizer_json(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    import json

    from tiny_gguf import gguf_metadata
    from tokenizers import Tokenizer

    tok_meta = {
        k: v for k, v in gguf_metadata(tiny_model_dir).items() if k.startswith("tokenizer.")
    }
    # a merge of two digits (and one across a space and a digit): Qwen2 splits digits apart
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    tokens = list(tok_meta["tokenizer.ggml.tokens"])
    for left, right in (("1", "2"), ("Ġ", "1")):
        spec["model"]["vocab"][left + right] = len(tokens)
        tokens.append(left + right)
        spec["model"]["merges"].append([left, right])
        tok_meta["tokenizer.ggml.merges"] = [*tok_meta["tokenizer.ggml.merges"], f"{left} {right}"]
    tok_meta["tokenizer.ggml.tokens"] = tokens
    tok_meta["tokenizer.ggml.token_type"] = [*tok_meta["tokenizer.ggml.token_type"], 1, 1]
    meta = {**arch_keys("qwen2", len(tokens)), **tok_meta, "tokenizer.ggml.pre": "qwen2"}
    names = tensor_names("qwen2", tied=True, bias=True)
    path = write_gguf(tmp_path / "qwen2.gguf", "qwen2", meta, names, lambda _n: Q.Q8_0)
    gpt2 = Tokenizer.from_str(json.dumps(spec))
    spec["pre_tokenizer"] = QWEN2_PRE_TOKENIZER
    reference = Tokenizer.from_str(json.dumps(spec))
    tokenizer = load_model(str(path)).tokenizer
    text = "In 2024 the fox's 12345 apples\n\n\tweren't   there!! 東京"
    assert reference.encode(text).ids != gpt2.encode(text).ids  # the split matters here
    assert tokenizer.encode(text) == reference.encode(text).ids
    assert tokenizer.decode(tokenizer.encode(text)) == text
