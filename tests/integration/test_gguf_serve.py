"""A converted K-quant GGUF with a SentencePiece vocabulary, served by the whole daemon.

The file mixes Q4_K, Q5_K and Q6_K as a Q4_K_M file does and carries a SentencePiece
vocabulary and chat template (tests/spm_gguf.py's trained model). The daemon (in-process,
HTTP, the official `openai` client) serves its converted directory; a greedy answer must be
the tokens stock mlx-lm picks on the file's weights dequantized by `gguf.quants`, decoded by
SentencePiece itself, with the same log-probabilities (docs/models.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from daemon_helpers import embedded_daemon, openai_client
from gguf import GGMLQuantizationType as Q
from gguf_builders import llama_config, reference_model
from mlxcel.daemon.models import convert_gguf, load_model
from spm_gguf import spm_gguf, train

MAX_TOKENS = 10


def _qtype(name: str) -> Q:
    if "ffn_down" in name or name == "output.weight":
        return Q.Q6_K
    return Q.Q5_K if "attn_v" in name else Q.Q4_K


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    sp = train(add_dummy_prefix=True)
    root = tmp_path_factory.mktemp("serve")
    path = spm_gguf(root / "Tiny-Q4_K_M.gguf", sp, True, qtype_of=_qtype)
    return sp, path, convert_gguf(path, root / "converted")


@pytest.fixture(scope="module")
def daemon(
    converted: tuple[Any, Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    with embedded_daemon(tmp_path_factory, converted[2]) as d:
        yield d


def test_a_greedy_chat_answer_is_stock_mlx_lms_on_the_files_weights(
    converted: tuple[Any, Path, Path], daemon: Any, tmp_path: Path
) -> None:
    sp, path, out = converted
    vocab = sp.get_piece_size()
    reference, _ = reference_model(path, "llama", llama_config(vocab), tmp_path / "reference")
    tokenizer = load_model(str(out)).tokenizer
    messages = [{"role": "user", "content": "Café 東京 😀: the quick brown fox?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == sp.bos_id()
    stops = {sp.eos_id(), sp.piece_to_id("<end_of_turn>")}
    answer: list[int] = []
    logprobs: list[float] = []
    for _ in range(MAX_TOKENS):
        logits = np.array(reference(mx.array([ids + answer]))[0, -1].astype(mx.float32))
        token = int(np.argmax(logits))
        if token in stops:
            break
        answer.append(token)
        # log softmax at the argmax: -log(sum(exp(logits - max)))
        logprobs.append(-float(np.log(np.exp(logits - logits.max()).sum())))

    client = openai_client(daemon)
    reply = client.chat.completions.create(
        model=out.name,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
    )
    choice = reply.choices[0]
    assert len(answer) >= 3, answer  # a real answer, not an immediate stop
    assert choice.message.content == sp.decode(answer)
    # each token's log-probability as stock mlx-lm computes it on the file's weights
    served = [t.logprob for t in choice.logprobs.content]
    np.testing.assert_allclose(served, logprobs, atol=1e-3, rtol=0)
    assert choice.finish_reason == ("length" if len(answer) == MAX_TOKENS else "stop")
