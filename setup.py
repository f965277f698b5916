"""Builds the optional C++ kernel; everything else is in pyproject.toml.

``leanformer.ops._kmedoids_cpu`` runs K-Medoids iterations on the CPU
(``src/leanformer/ops/kmedoids_cpu.cpp``). It needs torch at build time, so it is built
without build isolation (``pip install --no-build-isolation -e .``, as the Makefile
does). Where it cannot be built (no torch, no C++ compiler), the package installs
without it and the plans run their batched PyTorch code.
"""

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # built in isolation, without torch: the package runs without the kernel
    ext_modules, cmdclass = [], {}
else:
    ext_modules = [
        CppExtension(
            "leanformer.ops._kmedoids_cpu",
            ["src/leanformer/ops/kmedoids_cpu.cpp"],
            # -fopenmp-simd: the dot products' reductions vectorise (no OpenMP runtime).
            extra_compile_args=["-O3", "-fopenmp-simd"],
            optional=True,
        )
    ]
    cmdclass = {"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
