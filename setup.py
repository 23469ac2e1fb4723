"""Only here because cffi's builders are declared through setup(); see pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["kernels/_cffi_src/build_native.py:ffi"])
