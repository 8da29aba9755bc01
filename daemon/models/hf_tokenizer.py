"""Build and save GPT-2 style byte-level BPE and SentencePiece tokenizers without network access.

Used by the tiny test models and by the GGUF converter: both end as a Hugging Face tokenizer
directory (tokenizer.json, tokenizer_config.json, chat template) that `mlx_lm.load` reads.
`build_spm_tokenizer` rebuilds a SentencePiece vocabulary as llama.cpp's "llama" tokenizer
runs it: spaces as "▁" (one prefixed to each stretch of text when `add_space_prefix`), the
adjacent pair whose merge is the highest-scoring piece merged first, characters outside the
vocabulary as their UTF-8 bytes (`<0x..>` pieces); Hugging Face's BPE with byte fallback and
merges ranked by the merged piece's score does exactly that.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

SPM_SPACE = "\u2581"  # "▁"
# SentencePiece piece types as GGUF's tokenizer.ggml.token_type stores them (llama.cpp).
SPM_NORMAL, SPM_UNKNOWN, SPM_CONTROL, SPM_USER_DEFINED, SPM_UNUSED, SPM_BYTE = 1, 2, 3, 4, 5, 6

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The GPT-2 split pattern (llama.cpp's "gpt2"/"default" pre-tokenizer).
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, [chr(c) for c in chars], strict=True))


def byte_alphabet() -> list[str]:
    """The 256 byte symbols in byte order."""
    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def build_pre_tokenizer(digits_individual: bool = False) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if not digits_individual:
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def build_bpe_tokenizer(
    vocab: dict[str, int],
    merges: Sequence[tuple[str, str]],
    special_tokens: Sequence[str],
    digits_individual: bool = False,
    split_regex: str | None = None,
    added_tokens: Sequence[str] = (),
    ignore_merges: bool = False,
) -> Tokenizer:
    """A byte-level BPE tokenizer; special and added tokens must already be in `vocab`.

    `split_regex` replaces the GPT-2 split pattern (e.g. Llama 3's); `added_tokens` are
    matched whole before BPE like special tokens but are not skipped when decoding.
    """
    bpe = models.BPE(
        vocab=vocab,
        merges=list(merges),
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=ignore_merges,
    )
    tok = Tokenizer(bpe)
    if split_regex is None:
        tok.pre_tokenizer = build_pre_tokenizer(digits_individual)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    if added_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return tok


def add_bos_processor(
    tok: Tokenizer, bos_token: str, bos_id: int, eos: tuple[str, int] | None = None
) -> None:
    """Prepend BOS to every encoding (models whose GGUF says add_bos_token); append `eos`
    (token, id) too when given (add_eos_token)."""
    tail = f" {eos[0]}:0" if eos else ""
    tail_b = f" {eos[0]}:1" if eos else ""
    specials = [(bos_token, bos_id)] + ([eos] if eos and eos[0] != bos_token else [])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0{tail}",
        pair=f"{bos_token}:0 $A:0{tail} {bos_token}:1 $B:1{tail_b}",
        special_tokens=specials,
    )


def spm_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal piece into two pieces of the vocabulary, ranked
    by the merged piece's score (highest first; then by id), as llama.cpp merges them."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (SPM_NORMAL, SPM_UNUSED)}
    ranked = []
    for piece, index in vocab.items():
        if types[index] != SPM_NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[index]), index, vocab[left], (left, right)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def build_spm_tokenizer(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    add_space_prefix: bool = True,
    unk_token: str | None = None,
) -> Tokenizer:
    """A tokenizers.Tokenizer that encodes as llama.cpp's SentencePiece ("llama") tokenizer."""
    vocab: dict[str, int] = {}
    for index, piece in enumerate(tokens):
        vocab.setdefault(piece, index)
    bpe = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, types),
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=any(t == SPM_BYTE for t in types),
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", SPM_SPACE)
    if add_space_prefix:
        # before the Replace: "always" puts "▁" in front of each stretch between specials,
        # as llama.cpp adds its space after each special token
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPM_SPACE), normalizers.Replace(" ", SPM_SPACE)]
        )
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty in (SPM_CONTROL, SPM_UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == SPM_USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def save_hf_tokenizer(
    tok: Tokenizer,
    out_dir: Path,
    *,
    eos_token: str,
    bos_token: str | None = None,
    unk_token: str | None = None,
    pad_token: str | None = None,
    chat_template: str | None = None,
    model_max_length: int = 8192,
) -> None:
    """Write tokenizer.json, tokenizer_config.json (and the chat template) into `out_dir`."""
    # transformers warns loudly about missing PyTorch; tokenizers alone do not need it.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        bos_token=bos_token,
        unk_token=unk_token,
        pad_token=pad_token,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
