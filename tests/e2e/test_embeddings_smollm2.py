"""Embeddings (docs/api.md, "Embeddings") from the real SmolLM2 through an in-process daemon and
the official `openai` SDK: mean-pooled last hidden states that order sentences by meaning. The
endpoints on the tiny model are tests/integration/test_embeddings.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from daemon_helpers import embedded_daemon, openai_client


def test_smollm2_mean_pooled_states_order_three_sentences(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> None:
    """SmolLM2 is a chat model, not an embedding model; its mean-pooled last hidden states
    still put two sentences about cats nearer each other than a cat and finance."""
    cat1 = "The cat curled up on the warm windowsill and purred."
    cat2 = "My kitten loves to sleep in the sun by the window."
    money = "The central bank raised interest rates to curb inflation."
    with embedded_daemon(tmp_path_factory, default_model_dir) as d:
        out = openai_client(d).embeddings.create(
            model=default_model_dir.name, input=[cat1, cat2, money]
        )
        v = np.array([e.embedding for e in out.data], dtype=np.float32)
        np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
        sim = v @ v.T
        print(
            f"sim(cat1, cat2) {sim[0, 1]:.4f}  sim(cat1, money) {sim[0, 2]:.4f}  "
            f"sim(cat2, money) {sim[1, 2]:.4f}"
        )
        assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[1, 2]
