"""The tiny random-weight models: loadable by mlx-lm, deterministic, with the right caches."""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlxcel.daemon.models.tiny import FAMILIES, make_tiny_model


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_llama_loads_and_chats(tiny_model_dir: Path) -> None:
    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_ids == {eos}
    assert model.args.vocab_size == len(tokenizer.get_vocab())
    assert all(type(c) is KVCache for c in make_prompt_cache(model))
    out = mlx_lm.generate(model, tokenizer, ids, max_tokens=8)
    greedy: list[int] = []  # argmax of the full forward, token by token
    for _ in range(8):
        token = int(mx.argmax(model(mx.array([ids + greedy]))[0, -1]).item())
        if token == eos:
            break
        greedy.append(token)
    assert greedy and out == tokenizer.decode(greedy)


def test_tiny_nobatch_has_mixed_caches(tiny_nobatch_model_dir: Path) -> None:
    model, _ = mlx_lm.load(str(tiny_nobatch_model_dir))
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    assert kinds == {"ArraysCache", "KVCache"}


def test_tiny_model_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = make_tiny_model(tmp_path / "again", "llama", seed=0)
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)
    assert _digest(again) == _digest(tiny_model_dir)
    assert _digest(other) != _digest(tiny_model_dir)
    assert (again / "tokenizer.json").read_bytes() == (
        tiny_model_dir / "tokenizer.json"
    ).read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads(tmp_path: Path, family: str) -> None:
    path = make_tiny_model(tmp_path / family, family, num_hidden_layers=2)
    model, _ = mlx_lm.load(str(path))
    assert model.model_type == family


def test_unknown_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny family"):
        make_tiny_model(tmp_path / "x", "nope")
