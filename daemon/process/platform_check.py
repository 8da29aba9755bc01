"""Is the installed MLX stack one the daemon can run on? One line when it is not.

Checked at start, before anything imports mlx-lm's internals: the versions are at least the
tested floors, exactly one MLX backend package is installed on Linux (mlx-cpu and mlx-cuda-*
all ship `mlx/lib/libmlx.so`: with two, the last one installed wins and removing either
deletes the library), and the APIs the engine uses exist. Package metadata is read without
importing mlx, so a broken install is named, not a traceback.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from importlib import metadata

from mlxcel.daemon.mlx_lm_compat import MLX_LM_FLOOR

# The versions the test suite runs on (docs/platforms.md); pyproject.toml's floors are these.
# mlx-lm's whole tested range (its ceiling too) is in daemon/mlx_lm_compat.py.
MIN_VERSIONS = {"mlx": (0, 32, 4), "mlx-lm": MLX_LM_FLOOR}
LINUX_BACKENDS = ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")
# (module, attribute) the engine needs; a missing one names the package to upgrade.
REQUIRED_APIS = (
    ("mlx.core", "new_thread_local_stream"),
    ("mlx.core", "device_info"),
    ("mlx_lm.generate", "PromptProcessingBatch"),
    ("mlx_lm.generate", "GenerationBatch"),
    ("mlx_lm.generate", "StopSequences"),
)
INSTALL_HINT = "pip install 'mlxcel[cpu]' (or 'mlxcel[cuda]' on a CUDA machine)"
NO_BACKEND = "no MLX backend package is installed"

VersionOf = Callable[[str], str | None]


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        match = re.match(r"\d+", piece)
        parts.append(int(match.group()) if match else 0)
    return tuple(parts)


def linux_backends(version_of: VersionOf = installed_version) -> list[str]:
    """The MLX backend packages installed (Linux wheels; macOS's mlx carries Metal)."""
    return [dist for dist in LINUX_BACKENDS if version_of(dist) is not None]


def check_packages(
    version_of: VersionOf = installed_version, platform: str = sys.platform
) -> str | None:
    """A one-line problem with the installed packages, or None (no mlx import)."""
    for dist, floor in MIN_VERSIONS.items():
        version = version_of(dist)
        wanted = ".".join(map(str, floor))
        if version is None:
            return f"{dist} is not installed: {INSTALL_HINT}"
        if _parse(version) < floor:
            return f"{dist} {version} is too old (need >= {wanted}): pip install -U '{dist}'"
    if platform.startswith("linux"):
        backends = linux_backends(version_of)
        if not backends:
            return f"{NO_BACKEND}: {INSTALL_HINT}"
        if len(backends) > 1:
            return (
                f"several MLX backends are installed ({', '.join(backends)}); they overwrite "
                "each other's libmlx.so: pip uninstall them all, then install one "
                f"({INSTALL_HINT})"
            )
    return None


def check_apis(apis: tuple[tuple[str, str], ...] = REQUIRED_APIS) -> str | None:
    """A one-line problem naming the first missing MLX / mlx-lm API, or None."""
    for module_name, attribute in apis:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # a broken native library raises anything
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"cannot import {module_name} ({first}): {INSTALL_HINT}"
        if not hasattr(module, attribute):
            dist = "mlx-lm" if module_name.startswith("mlx_lm") else "mlx"
            floor = ".".join(map(str, MIN_VERSIONS[dist]))
            return (
                f"{module_name}.{attribute} is missing: {dist} "
                f"{installed_version(dist) or '?'} is not the tested {floor} or newer"
            )
    return None


def _mlx_imports() -> bool:
    try:
        importlib.import_module("mlx.core")
    except Exception:
        return False
    return True


def check_runtime(version_of: VersionOf = installed_version) -> str | None:
    """Packages first (no import), then the APIs; None when the daemon can run. An MLX built
    from source has no backend package but imports: that is fine."""
    problem = check_packages(version_of)
    if problem is not None and problem.startswith(NO_BACKEND) and _mlx_imports():
        problem = None
    return problem or check_apis()
