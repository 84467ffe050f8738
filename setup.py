"""Build script: compiles the Cython hot paths in ``native/``: the engine's into ``timely._native``,
the NEXMark generator into ``nexmark.nexmark_gen``.

A C compiler and the Python headers are required; without them the build stops with a
message that says so instead of a compiler traceback.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext

# module -> (native/<source>.pyx, the native/*.pxi files it includes).
NATIVE_MODULES = {
    "timely._native.hashing": ("hashing", ["batch.pxi", "route_bins.pxi", "columns.pxi"]),
    "nexmark.nexmark_gen": ("nexmark_gen", []),
}


class CheckedBuildExt(build_ext):
    """``build_ext`` that first checks for a C compiler and the Python headers."""

    def run(self) -> None:
        cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
        if shutil.which(cc) is None and shutil.which("cc") is None:
            sys.exit(
                f"error: no C compiler found (looked for {cc!r} and 'cc'). The native hot paths "
                "in native/ need one: install gcc (Debian: apt-get install build-essential python3-dev)."
            )
        include = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(include, "Python.h")):
            sys.exit(f"error: Python.h not found in {include}: install the Python development headers.")
        super().run()


def extensions():
    from Cython.Build import cythonize
    from setuptools import Extension

    exts = [
        Extension(module, [f"native/{source}.pyx"], depends=[f"native/{d}" for d in includes],
                  extra_compile_args=["-O3"])
        for module, (source, includes) in NATIVE_MODULES.items()
    ]
    return cythonize(exts, language_level=3, compiler_directives={"boundscheck": False, "wraparound": False})


setup(ext_modules=extensions(), cmdclass={"build_ext": CheckedBuildExt})
