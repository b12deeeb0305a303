"""Builds the C++ extensions in csrc/ when the package is installed.

No compiler runs at run time and no torch or CUDA headers are needed: the extensions take
raw pointers and sizes. There is no -march=native: each instruction-set variant of a kernel
lives in its own source file that selects its target with `#pragma GCC target`, and the
code picks a variant at run time from what the CPU reports.
"""

import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

COMMON_FLAGS = ["-O3", "-fvisibility=hidden", "-fno-strict-aliasing", "-pthread"]


def extension(name: str, folder: str) -> Pybind11Extension:
    return Pybind11Extension(
        name,
        sorted(glob.glob(f"csrc/{folder}/*.cpp")),
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=COMMON_FLAGS,
        extra_link_args=["-pthread"],
    )


# OFFLOAD_BUILD_ONLY=adam (or aio) builds one extension: a developer convenience for
# `python setup.py build_ext --inplace` while the other is being edited.
_only = {name for name in os.environ.get("OFFLOAD_BUILD_ONLY", "").split(",") if name}
_extensions = [extension(f"offload._{folder}_ext", folder) for folder in ("adam", "aio") if not _only or folder in _only]

setup(
    ext_modules=_extensions,
    cmdclass={"build_ext": build_ext},
)
