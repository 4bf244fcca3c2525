"""Builds the optional C loops of the data plane (transfer/_kernels.c); everything else is in pyproject.toml.

`optional=True`: without a C compiler the install still succeeds and kvpool loops in Python instead
(`transfer.xxh3.KERNELS is None`; slower same-host reads and small-block checksums, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "transfer._kernels",
            ["transfer/_kernels.c"],
            depends=["transfer/_xxh3_avx2.h", "transfer/third_party/xxhash/xxhash.h"],
            extra_compile_args=["-O3", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
