"""Token log-probabilities in OpenAI's shapes: chat (`content` entries with token, bytes,
logprob, top_logprobs) and text completions (tokens, token_logprobs, top_logprobs,
text_offset)."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from mlxcel.daemon.models.hf_tokenizer import bytes_to_unicode
from mlxcel.daemon.server.generation import TokenLogprob

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback
_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


class TokenText:
    """A token id's exact bytes and its text, cached per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        try:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # a wrapper without it: the decoded text is close enough
            piece = None
        if isinstance(piece, str):
            m = _BYTE_TOKEN.match(piece)
            if m:
                return bytes([int(m.group(1), 16)])
            if piece and all(c in _UNICODE_TO_BYTE for c in piece):  # byte-level BPE
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self._tokenizer.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.text(token_id),
            "logprob": logprob,
            "bytes": list(self.bytes_of(token_id)),
        }


def chat_logprobs(
    tokens: TokenText, entries: list[TokenLogprob], top_n: int
) -> dict[str, Any] | None:
    """The chat `logprobs` object of a choice (or a chunk's share of one)."""
    content = []
    for e in entries:
        item = tokens.entry(e.token_id, e.logprob)
        item["top_logprobs"] = [tokens.entry(t, lp) for t, lp in e.top[:top_n]]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokens: TokenText, entries: list[TokenLogprob], top_n: int, offset: int = 0
) -> dict[str, Any]:
    """The text-completion `logprobs` object; `offset` is where this text starts."""
    out: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for e in entries:
        text = tokens.text(e.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({tokens.text(t): lp for t, lp in e.top[:top_n]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out
