"""The one compiled piece: the int8-gemv kernel (src/gpt2lab/inference/_gemv.c). Everything else
about the package is in pyproject.toml. The kernel is optional: where no C compiler (or no OpenMP) is
there, pip installs gpt2lab without it, and `--quantize int8` uses PyTorch's int8 kernel alone."""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):  # gcc and clang with OpenMP; elsewhere PyTorch's kernel serves
    ext_modules.append(
        Extension(
            "gpt2lab.inference._gemv",
            ["src/gpt2lab/inference/_gemv.c"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
