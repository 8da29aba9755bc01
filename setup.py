"""The wheel's build step: the native kernels compiled into the package.

Everything else is in pyproject.toml. `build_py` compiles `daemon/forward/native/` (the few-row
sgemm kernel and the fused ops) into `mlxcel/daemon/forward/native/_built/` with the build
machine's C compiler (`CC`, else cc/gcc/clang), through the same code the daemon's first-run
build uses (`blas.build_package_libraries`, loaded from the source tree: nothing is imported
from an installed mlxcel). No compiler, a compiler error or MLXCEL_NO_NATIVE_BUILD=1 is a
warning, never a failed install: the wheel is then pure Python and the daemon builds the
libraries into its per-user cache at first start (daemon/forward/blas.py explains the order).

A wheel that carries the libraries is tagged `py3-none-<platform>` (they are plain shared
libraries, no Python ABI). Editable installs (scripts/setup.sh) build nothing here: their
sources change, and the per-user cache is keyed by the sources' hash.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1 (pyproject.toml asks for >= 77: not a PEP 517 build)
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

ROOT = Path(__file__).resolve().parent
BUILT = ("mlxcel", "daemon", "forward", "native", "_built")


def _blas() -> ModuleType:
    """daemon/forward/blas.py of this tree (stdlib only), without importing the package."""
    name = "_mlxcel_build_blas"
    spec = importlib.util.spec_from_file_location(name, ROOT / "daemon" / "forward" / "blas.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    """build_py, then the native libraries into the built package (not in editable mode)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib, *BUILT)
        missing = _blas().build_package_libraries(dest)
        for kind, why in missing.items():
            self.warn(
                f"mlxcel: the native {kind} library is not in this wheel ({why}); the daemon "
                "builds it into its per-user cache at first start when a compiler is there"
            )
        if len(missing) < 2:
            print(f"mlxcel: native kernels built into {dest}", file=sys.stderr)


class BdistWheelMaybePlatform(bdist_wheel or object):  # type: ignore[misc]
    """A platform wheel when the build step compiled a library, else a pure one."""

    def run(self) -> None:
        if not self.skip_build:
            self.run_command("build")
        build_lib = self.get_finalized_command("build_py").build_lib
        if any(Path(build_lib, *BUILT).glob("*.so")):
            self.root_is_pure = False
            # The install step then puts the package in platlib, the wheel's root.
            self.distribution.has_ext_modules = lambda: True  # type: ignore[method-assign]
        super().run()

    def get_tag(self) -> tuple[str, str, str]:
        impl, abi, plat = super().get_tag()
        return (impl, abi, plat) if self.root_is_pure else ("py3", "none", plat)


commands: dict[str, type] = {"build_py": BuildPyWithKernels}
if bdist_wheel is not None:
    commands["bdist_wheel"] = BdistWheelMaybePlatform
setup(cmdclass=commands)
