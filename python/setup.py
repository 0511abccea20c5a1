"""Builds the native part of `lvx` (target lvx_torch_ops of the repository's CMake project) with
the Python that runs pip, so it links the libtorch inside that Python's torch, and puts
_lvx_ops.so into the package.

Build folder: $LVX_BUILD_DIR if set; else the repository's build/ when setup.sh configured it
(the library is then already built, or one target away); else python/build-cmake/ (configured
here: Ninja, Release, tests and benchmarks off). The system libraries lvx links (FFmpeg, OpenCV,
yaml-cpp; setup.sh installs them) must stay installed.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def build_dir():
    if os.environ.get("LVX_BUILD_DIR"):
        return Path(os.environ["LVX_BUILD_DIR"]).resolve()
    if (ROOT / "build" / "CMakeCache.txt").exists():
        return ROOT / "build"
    return HERE / "build-cmake"


class BuildWithOps(build_py):
    def run(self):
        super().run()
        b = build_dir()
        if not (b / "CMakeCache.txt").exists():
            subprocess.check_call(
                ["cmake", "-S", str(ROOT), "-B", str(b), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 f"-DLVX_PYTHON={sys.executable}", "-DLVX_BUILD_TESTS=OFF",
                 "-DLVX_BUILD_BENCHMARKS=OFF", f"-DLVX_CUDA={os.environ.get('LVX_CUDA', 'AUTO')}"])
        subprocess.check_call(["cmake", "--build", str(b), "--target", "lvx_torch_ops"])
        lib = b / "python" / "lvx" / "_lvx_ops.so"
        dest = Path(self.build_lib) / "lvx"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, dest / lib.name)


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True  # a platform wheel: it carries a shared library


setup(packages=["lvx"], cmdclass={"build_py": BuildWithOps}, distclass=BinaryDistribution)
