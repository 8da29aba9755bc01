"""A BERT-family encoder in MLX: BERT, RoBERTa and XLM-RoBERTa (docs/models.md, "Embedding
models").

Embeddings (word + position + token type, then LayerNorm), N post-LN transformer layers
(bidirectional self-attention with a padding mask, a GELU feed-forward), as Hugging Face's
`BertModel` / `XLMRobertaModel` compute them. The module and parameter names are the HF ones
(`embeddings.word_embeddings.weight`, `encoder.layer.0.attention.self.query.weight`, ...), so a
checkpoint's weights load by name once their `bert.` / `roberta.` prefix is dropped.

Positions: BERT counts from 0; RoBERTa and XLM-RoBERTa from `pad_token_id + 1` (HF's
`create_position_ids_from_input_ids`), so their usable length is `max_position_embeddings`
less `pad_token_id + 1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

ACTIVATIONS = {
    "gelu": nn.gelu,  # exact (erf), HF's "gelu"
    "gelu_new": nn.gelu_approx,  # tanh approximation
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_python": nn.gelu,
    "relu": nn.relu,
    "silu": nn.silu,
    "swish": nn.silu,
}
MASKED = -1e9  # the additive score of a padded key (exp underflows to 0 in float32)


@dataclass(frozen=True)
class EncoderArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    hidden_act: str = "gelu"
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @property
    def position_offset(self) -> int:
        """The position id of the first token (RoBERTa: after the padding index)."""
        return self.pad_token_id + 1 if self.model_type in ("roberta", "xlm-roberta") else 0

    @property
    def max_tokens(self) -> int:
        """The most tokens one input may have."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        """From an HF config.json; a `ValueError` names what is missing or unsupported."""
        required = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        )
        values: dict[str, Any] = {}
        for key in required:
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json has no valid {key!r}")
            values[key] = value
        act = str(config.get("hidden_act", "gelu"))
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (known: {sorted(ACTIVATIONS)})")
        positions = str(config.get("position_embedding_type") or "absolute")
        if positions != "absolute":
            raise ValueError(f"position_embedding_type {positions!r} is not supported (absolute)")
        if values["hidden_size"] % values["num_attention_heads"]:
            raise ValueError("hidden_size is not a multiple of num_attention_heads")
        model_type = str(config.get("model_type") or "bert")
        pad = config.get("pad_token_id")
        args = cls(
            model_type=model_type,
            hidden_act=act,
            type_vocab_size=max(int(config.get("type_vocab_size") or 1), 1),
            layer_norm_eps=float(config.get("layer_norm_eps") or 1e-12),
            pad_token_id=int(pad) if isinstance(pad, int) and pad >= 0 else 0,
            **values,
        )
        if args.max_tokens < 1:
            raise ValueError("max_position_embeddings leaves no room for a token")
        return args


class BertEmbeddings(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, ids: mx.array, positions: mx.array, types: mx.array) -> mx.array:
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(types))


class BertSelfAttention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.query = nn.Linear(args.hidden_size, args.hidden_size)
        self.key = nn.Linear(args.hidden_size, args.hidden_size)
        self.value = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, width = x.shape
        heads, dim = self.num_heads, width // self.num_heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(batch, length, heads, dim).transpose(0, 2, 1, 3)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, width)


class BertSelfOutput(nn.Module):
    def __init__(self, args: EncoderArgs, in_dims: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_dims, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.self = BertSelfAttention(args)  # HF's name: attention.self.query
        self.output = BertSelfOutput(args, args.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self._act = ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self._act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.attention = BertAttention(args)
        self.intermediate = BertIntermediate(args)
        self.output = BertSelfOutput(args, args.intermediate_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertLayers(nn.Module):
    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.layer = [BertLayer(args) for _ in range(args.num_hidden_layers)]


class BertEncoder(nn.Module):
    """The encoder stack (no pooler, no MLM head: neither enters a sentence embedding)."""

    is_encoder = True  # the daemon's marker of an embedding-only model

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = BertEmbeddings(args)
        self.encoder = BertLayers(args)

    def __call__(self, ids: mx.array, lengths: mx.array) -> mx.array:
        """The last hidden states (batch, length, hidden) of right-padded `ids`, row i real for
        its first `lengths[i]` tokens: no token attends to a padded position, so a row's real
        states are those it has alone."""
        batch, length = ids.shape
        steps = mx.arange(length)
        keep = steps[None, :] < lengths[:, None]  # (batch, length)
        positions = mx.broadcast_to(steps + self.args.position_offset, (batch, length))
        types = mx.zeros((batch, length), dtype=mx.int32)
        x = self.embeddings(ids, positions, types)
        mask = mx.where(keep, 0.0, MASKED).astype(x.dtype)[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def make_cache(self) -> list[Any]:
        return []  # an encoder keeps no KV between calls
