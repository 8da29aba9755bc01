"""NomicBERT (`model_type` "nomic_bert": nomic-embed-text v1 / v1.5) in MLX (docs/models.md,
"Embedding models"), as nomic's own modeling file (`modeling_hf_nomic_bert.py`) computes it.

How it differs from BERT (model.py): no position embeddings but rotary ones on q and k
(GPT-NeoX style, the two halves rotated; `rotary_emb_fraction` of each head, base
`rotary_emb_base`); one fused `Wqkv` projection; a gated feed-forward (`fc11` x act(`fc12`),
then `fc2`; act SiLU for "swiglu", GELU for "geglu", sigmoid for "glu") or a plain one
(`fc1`, `fc2`) for the GELU activations; GPT-2 config names (`n_embd`, `n_head`, `n_layer`,
`n_inner`); post-norm blocks (`norm1`, `norm2`) after `emb_ln`; biases only where the config
asks. Dynamic NTK rotary scaling (`rotary_scaling_factor`) changes the frequencies only past
`max_trained_positions` tokens, so with it the context is that many tokens and the scaling
never applies; without it, `n_positions`. Pre-norm blocks and `rotary_emb_scale_base` are
refused. Parameter names are the checkpoint's (`emb_ln.weight`,
`encoder.layers.0.attn.Wqkv.weight`, `encoder.layers.0.mlp.fc11.weight`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlxcel.daemon.models.encoder import config_int as _int
from mlxcel.daemon.models.encoder import nomic_context
from mlxcel.daemon.models.encoder.model import MASKED

GATED = {"swiglu": nn.silu, "geglu": nn.gelu, "glu": mx.sigmoid}
PLAIN = {"gelu": nn.gelu, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx}


@dataclass(frozen=True)
class NomicArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_tokens: int
    activation: str
    rotary_dim: int
    rotary_base: float
    type_vocab_size: int
    layer_norm_eps: float
    qkv_bias: bool
    fc1_bias: bool
    fc2_bias: bool
    model_type: str = "nomic_bert"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NomicArgs:
        hidden = _int(config, "n_embd", "hidden_size")
        heads = _int(config, "n_head", "num_attention_heads")
        layers = _int(config, "n_layer", "num_hidden_layers")
        vocab = _int(config, "vocab_size")
        context = nomic_context(config)
        for name, value in (
            ("n_embd", hidden),
            ("n_head", heads),
            ("n_layer", layers),
            ("vocab_size", vocab),
            ("n_positions", context),
        ):
            if value is None:
                raise ValueError(f"config.json has no valid {name!r}")
        assert hidden and heads and layers and vocab and context
        if hidden % heads:
            raise ValueError("n_embd is not a multiple of n_head")
        act = str(config.get("activation_function") or "swiglu")
        if act not in GATED and act not in PLAIN:
            raise ValueError(
                f"activation_function {act!r} is not supported (known: {sorted([*GATED, *PLAIN])})"
            )
        if config.get("prenorm"):
            raise ValueError("pre-norm NomicBERT blocks are not supported")
        if config.get("rotary_emb_scale_base") is not None:
            raise ValueError("rotary_emb_scale_base is not supported")
        if config.get("rotary_emb_interleaved"):
            raise ValueError("interleaved rotary embeddings are not supported")
        fraction = float(config.get("rotary_emb_fraction", 1.0) or 0.0)
        head_dim = hidden // heads
        rotary = int(head_dim * fraction)
        if rotary <= 0 or rotary % 2:
            raise ValueError("NomicBERT without rotary embeddings is not supported")
        multiple = _int(config, "pad_vocab_size_multiple") or 1
        vocab += (-vocab) % multiple  # the checkpoint's rows: padded as nomic's model pads them
        inner = _int(config, "n_inner", "intermediate_size")
        if inner is None:  # nomic's defaults
            inner = int(8 * hidden / 3) if act in GATED else 4 * hidden
            if act in GATED:
                inner = (inner + 255) // 256 * 256
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=inner,
            max_tokens=context,
            activation=act,
            rotary_dim=rotary,
            rotary_base=float(config.get("rotary_emb_base") or 10000.0),
            type_vocab_size=max(int(config.get("type_vocab_size") or 0), 0),
            layer_norm_eps=float(config.get("layer_norm_epsilon") or 1e-12),
            qkv_bias=bool(config.get("qkv_proj_bias", True)),
            fc1_bias=bool(config.get("mlp_fc1_bias", True)),
            fc2_bias=bool(config.get("mlp_fc2_bias", True)),
        )


class NomicEmbeddings(nn.Module):
    def __init__(self, args: NomicArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        if args.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)

    def __call__(self, ids: mx.array) -> mx.array:
        x = self.word_embeddings(ids)
        if "token_type_embeddings" in self:
            x = x + self.token_type_embeddings.weight[0]  # every token is of type 0
        return x


class NomicAttention(nn.Module):
    def __init__(self, args: NomicArgs) -> None:
        super().__init__()
        width = args.hidden_size
        self.num_heads = args.num_attention_heads
        self.Wqkv = nn.Linear(width, 3 * width, bias=args.qkv_bias)
        self.out_proj = nn.Linear(width, width, bias=args.qkv_bias)
        self._rotary_dim = args.rotary_dim

    def __call__(self, x: mx.array, mask: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        batch, length, width = x.shape
        heads, dim = self.num_heads, width // self.num_heads
        qkv = self.Wqkv(x).reshape(batch, length, 3, heads, dim)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        q, k = _rotate(q, cos, sin, self._rotary_dim), _rotate(k, cos, sin, self._rotary_dim)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, width))


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, rotary_dim: int) -> mx.array:
    """GPT-NeoX rotary embedding on the first `rotary_dim` features of (b, h, s, d)."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    x1, x2 = rot[..., :half], rot[..., half:]
    turned = mx.concatenate([-x2, x1], axis=-1)
    rot = rot * cos + turned * sin
    return mx.concatenate([rot, rest], axis=-1) if rest.shape[-1] else rot


class NomicMLP(nn.Module):
    def __init__(self, args: NomicArgs) -> None:
        super().__init__()
        width, inner = args.hidden_size, args.intermediate_size
        self._gated = args.activation in GATED
        self._act = GATED.get(args.activation) or PLAIN[args.activation]
        if self._gated:
            self.fc11 = nn.Linear(width, inner, bias=args.fc1_bias)
            self.fc12 = nn.Linear(width, inner, bias=args.fc1_bias)
        else:
            self.fc1 = nn.Linear(width, inner, bias=args.fc1_bias)
        self.fc2 = nn.Linear(inner, width, bias=args.fc2_bias)

    def __call__(self, x: mx.array) -> mx.array:
        if self._gated:
            return self.fc2(self.fc11(x) * self._act(self.fc12(x)))
        return self.fc2(self._act(self.fc1(x)))


class NomicBlock(nn.Module):
    def __init__(self, args: NomicArgs) -> None:
        super().__init__()
        self.attn = NomicAttention(args)
        self.mlp = NomicMLP(args)
        self.norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        x = self.norm1(self.attn(x, mask, cos, sin) + x)
        return self.norm2(self.mlp(x) + x)


class NomicLayers(nn.Module):
    def __init__(self, args: NomicArgs) -> None:
        super().__init__()
        self.layers = [NomicBlock(args) for _ in range(args.num_hidden_layers)]


class NomicEncoder(nn.Module):
    """The NomicBERT stack; the same call as model.BertEncoder's."""

    is_encoder = True

    def __init__(self, args: NomicArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = NomicEmbeddings(args)
        self.emb_ln = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.encoder = NomicLayers(args)

    def __call__(self, ids: mx.array, lengths: mx.array) -> mx.array:
        _, length = ids.shape
        steps = mx.arange(length)
        keep = steps[None, :] < lengths[:, None]
        x = self.emb_ln(self.embeddings(ids))
        dim = self.args.rotary_dim
        inv_freq = 1.0 / (self.args.rotary_base ** (mx.arange(0, dim, 2).astype(mx.float32) / dim))
        freqs = steps.astype(mx.float32)[:, None] * inv_freq[None, :]  # (s, dim / 2)
        cos = mx.concatenate([mx.cos(freqs)] * 2, axis=-1).astype(x.dtype)
        sin = mx.concatenate([mx.sin(freqs)] * 2, axis=-1).astype(x.dtype)
        mask = mx.where(keep, 0.0, MASKED).astype(x.dtype)[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, mask, cos, sin)
        return x

    def make_cache(self) -> list[Any]:
        return []
