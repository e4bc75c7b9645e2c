"""Build script: metadata lives in pyproject.toml; this file only adds the optional native library.

When cmake and a C++ compiler are on PATH, `pip install .` and `pip install -e .` build
csrc/ with CMakeLists.txt into vllm/_C<EXT_SUFFIX> (loaded with ctypes by vllm/_custom_ops.py).
Without them, or when the build fails, a warning is printed and the install goes on: the package
then uses its numpy fallbacks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension built by CMakeLists.txt; optional, so a failure never stops setup."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[], optional=True)


def find_cxx() -> str | None:
    """Returns the C++ compiler cmake would pick up ($CXX first), or None if there is none."""
    candidates = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    for name in candidates:
        # $CXX may carry flags ("ccache g++"); only its first word must exist.
        if name and shutil.which(name.split()[0]):
            return name
    return None


def warn(message: str) -> None:
    """Prints a build warning to stderr (pip shows it with -v, or when the install fails)."""
    print(
        f"WARNING: vllm native library not built: {message}; using numpy fallbacks.",
        file=sys.stderr,
    )


class CMakeBuild(build_ext):
    """build_ext that runs cmake for CMakeExtension and degrades to a warning on any failure."""

    def run(self) -> None:
        """Builds all extensions; remembers whether results are copied into the source tree."""
        # setuptools clears `inplace` while building and copies afterwards; a failed build must
        # also remove the in-tree copy of an earlier build, or that stale library would be used.
        self.copies_to_source = bool(self.inplace)
        super().run()

    def build_extension(self, ext: Extension) -> None:
        """Builds ext with cmake into its build_ext output path; never raises for CMakeExtension."""
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        try:
            self.run_cmake(ext)
        except Exception as exc:  # noqa: BLE001 - any build failure must leave the install working
            warn(str(exc) or type(exc).__name__)
            self.remove_partial(ext)

    def run_cmake(self, ext: Extension) -> None:
        """Builds ext with cmake; raises RuntimeError if a tool is missing or fails."""
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found on PATH")
        if find_cxx() is None:
            raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
        # In editable mode setuptools builds into build_lib and then copies the file next to the
        # sources itself (it skips the copy when an optional extension's file is missing).
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        suffix = target.name[len(ext.name.rpartition(".")[2]):]
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        configure = [
            cmake, "-S", str(ROOT), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DVLLM_OUTPUT_DIR={target.parent}",
            f"-DVLLM_EXT_SUFFIX={suffix}",
        ]
        jobs = str(os.cpu_count() or 1)
        build = [cmake, "--build", str(build_dir), "--config", "Release", "--parallel", jobs]
        for cmd in (configure, build):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                output = (result.stdout + result.stderr).strip()[-2000:]
                raise RuntimeError(f"{' '.join(cmd[:2])} ... failed:\n{output}")
        if not target.is_file():
            raise RuntimeError(f"cmake finished but {target} is missing")

    def remove_partial(self, ext: Extension) -> None:
        """Deletes a half-written library, and for in-place builds the old in-tree one."""
        built = Path(self.get_ext_fullpath(ext.name))
        built.unlink(missing_ok=True)
        if getattr(self, "copies_to_source", False):
            (ROOT / Path(*ext.name.split(".")).parent / built.name).unlink(missing_ok=True)


setup(ext_modules=[CMakeExtension("vllm._C")], cmdclass={"build_ext": CMakeBuild})
