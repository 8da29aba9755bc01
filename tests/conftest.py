"""Shared fixtures: tiny random-weight models, an isolated MLXCEL_HOME, the real default model.

Every test gets one kind (docs/testing.md): the folder its file is in, tests/unit,
tests/integration, tests/e2e or tests/packaging. Tests that need the real default model
(`mlxcel-daemon models pull`) run when it is present and are skipped with a reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlxcel.daemon.models.registry import DEFAULT_MODEL, local_model_dir

PULL_HINT = "mlxcel-daemon models pull"


def _find_default_model() -> Path | None:
    # Looked up once at import, before any test points MLXCEL_HOME at a temp folder.
    override = os.environ.get("MLXCEL_TEST_MODEL_DIR")
    if override:
        path = Path(override)
        return path if (path / "config.json").is_file() else None
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        return local_model_dir(DEFAULT_MODEL)


DEFAULT_MODEL_DIR = _find_default_model()

# Daemons started by tests keep the prompt cache in RAM only (a test of the disk tier turns it
# on): one test's entries must not become another's hits, nor its writes load the machine.
os.environ.setdefault("MLXCEL_PROMPT_CACHE_DISK_BYTES", "0")
E2E_SKIP_REASON = f"default model {DEFAULT_MODEL!r} is not pulled (run `{PULL_HINT}`)"


KINDS = ("unit", "integration", "e2e", "packaging")
# The order files run in (scripts/test.sh keeps it on its two workers with
# --no-loadscope-reorder): the long subprocess-heavy kinds first, the many short unit files
# last, so neither worker is left with a long file while the other has nothing to do.
RUN_ORDER = ("e2e", "packaging", "integration", "unit")
# Within its kind, a file much longer than the rest goes first (the console's snapshots, ~25 s,
# were the last file of a run, with the other worker done).
RUN_FIRST = frozenset({"unit/test_tui_render.py"})
TESTS = Path(__file__).resolve().parent
TINY_FIXTURES = frozenset(
    {"tiny", "tiny_solo", "tiny_model_dir", "tiny_nobatch_model_dir", "slow_model_dir"}
)
# The fixtures a kind may not use: a model makes a test integration, the real one e2e.
FORBIDDEN_FIXTURES = {
    "unit": TINY_FIXTURES | {"default_model_dir"},
    "integration": frozenset({"default_model_dir"}),
}


def kind_of(item: pytest.Item) -> str:
    """A test's kind: the folder below tests/ its file is in (docs/testing.md)."""
    parts = Path(item.path).resolve().relative_to(TESTS).parts
    if len(parts) < 2 or parts[0] not in KINDS:
        raise pytest.UsageError(f"{item.nodeid}: a test file belongs in tests/<kind>/ ({KINDS})")
    return parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason=E2E_SKIP_REASON)
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        kind = kind_of(item)
        for other in KINDS:
            if other != kind and item.get_closest_marker(other) is not None:
                raise pytest.UsageError(
                    f"{item.nodeid} is marked {other} but lives in tests/{kind}/: move it"
                )
        misplaced = FORBIDDEN_FIXTURES.get(kind, frozenset()) & set(item.fixturenames)
        if misplaced:
            raise pytest.UsageError(
                f"{item.nodeid} uses {sorted(misplaced)}: it is not a {kind} test, move it"
            )
        item.add_marker(kind)
        if DEFAULT_MODEL_DIR is None and "default_model_dir" in item.fixturenames:
            item.add_marker(skip)
    items.sort(key=_run_rank)  # stable: a file's tests stay together and in order


def _run_rank(item: pytest.Item) -> tuple[int, bool]:
    parts = Path(item.path).resolve().relative_to(TESTS).parts
    kind = RUN_ORDER.index(parts[0]) if parts and parts[0] in RUN_ORDER else len(RUN_ORDER)
    return kind, "/".join(parts) not in RUN_FIRST


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight llama model directory (plain KV caches: can batch)."""
    from mlxcel.daemon.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_nobatch_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight lfm2 model (hybrid ArraysCache + KVCache: mlx-lm cannot batch it)."""
    from mlxcel.daemon.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "lfm2", "lfm2", seed=0)


@pytest.fixture(scope="session")
def slow_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random llama big enough (~42M parameters) that a decode step takes milliseconds, not
    microseconds: a stream is still running when a test acts on it, and a load takes a moment,
    on a quiet machine as on a loaded one (the 2-layer tiny model finishes 1,900 tokens in ~4 s)."""
    from daemon_helpers import random_llama

    sizes = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6}
    return random_llama(tmp_path_factory, "slow", num_attention_heads=12, **sizes)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Any:
    """The tiny llama loaded (`LoadedModel`), once per test module."""
    from mlxcel.daemon.models import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def tiny_solo(tiny_nobatch_model_dir: Path) -> Any:
    """The tiny lfm2 (cannot batch) loaded, once per test module."""
    from mlxcel.daemon.models import load_model

    return load_model(str(tiny_nobatch_model_dir))


@pytest.fixture(scope="session")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight BERT encoder (bge-style, cls pooling): an embedding model."""
    from encoder_fixtures import make_encoder_dir

    return make_encoder_dir(tmp_path_factory.mktemp("enc") / "bge-tiny", "bert", pooling="cls")


@pytest.fixture(scope="session")
def tokenizer_meta(tiny_model_dir: Path) -> dict[str, Any]:
    """The tiny llama's tokenizer as GGUF `tokenizer.*` metadata, for GGUF files built in tests."""
    from tiny_gguf import gguf_metadata

    return {k: v for k, v in gguf_metadata(tiny_model_dir).items() if k.startswith("tokenizer.")}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh folder with a short path for Unix sockets: pytest's own temp dir on macOS
    (/private/var/folders/...) pushes a socket path past the 103-byte limit."""
    from mlxcel.shared.paths import short_socket_dir

    folder = Path(tempfile.mkdtemp(prefix="mlxcel-t-", dir=short_socket_dir().parent))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def mlxcel_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh MLXCEL_HOME: config, data, logs and runtime files all go below it."""
    home = tmp_path / "mlxcel-home"
    home.mkdir()
    monkeypatch.setenv("MLXCEL_HOME", str(home))
    yield home


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2 directory; skips the test when it has not been pulled."""
    if DEFAULT_MODEL_DIR is None:
        pytest.skip(E2E_SKIP_REASON)
    return DEFAULT_MODEL_DIR


# The prefill chunk of the shared SmolLM2 daemon: a client that drops is noticed within one.
SMOLLM2_CHUNK = 128


@pytest.fixture(scope="session")
def smollm2_daemon(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One real `mlxcel-daemon` subprocess on SmolLM2 (`--parallel 4`, 128-token prefill
    chunks) for every e2e file that only sends it requests: a test that uses it changes no
    setting, and reads the engine's counters as differences, never as totals."""
    from daemon_helpers import running_daemon

    home = tmp_path_factory.mktemp("smollm2-shared")
    flags = ("--parallel", "4", "--prefill-chunk-size", str(SMOLLM2_CHUNK))
    with running_daemon(home, default_model_dir, *flags) as daemon:
        yield daemon
