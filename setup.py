"""Builds the optional C++ kernels; everything else is in pyproject.toml.

Four kernels for eager CPU runs, each from ``src/leanformer/ops/<name>.cpp``:
``leanformer.ops._kmedoids_cpu`` and ``_kmeans_cpu`` run K-Medoids and K-Means iterations,
``_attention_received_cpu`` attention with received scores, ``_segment_sum_cpu`` the
weighted sums that pool tokens. The package registers each as a ``torch.library`` custom op
(``torch.ops.leanformer.*``, in ``leanformer/ops/*_native.py``). They
need torch at build time, so they are built without build isolation (``pip install
--no-build-isolation -e .``, as the Makefile does). Where they cannot be built (no torch,
no C++ compiler), the package installs without them and runs its PyTorch code instead.
"""

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # built in isolation, without torch: the package runs without the kernel
    ext_modules, cmdclass = [], {}
else:
    # -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers, so without it the
    # examples run one after another (at run time the library uses torch's libgomp, which
    # is already loaded under the same soname). -fno-trapping-math -fno-math-errno, as
    # torch itself is built: loops with float comparisons and exp vectorise. -g0: Python's
    # own flags ask for debug information, which nearly doubles the build of torch's headers.
    flags = ["-O3", "-g0", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
    ext_modules = [
        CppExtension(
            f"leanformer.ops._{name}",
            [f"src/leanformer/ops/{name}.cpp"],
            extra_compile_args=flags,
            extra_link_args=["-fopenmp"],
            depends=["src/leanformer/ops/cpu_kernel.h"],
            optional=True,
        )
        for name in ("kmedoids_cpu", "kmeans_cpu", "attention_received_cpu", "segment_sum_cpu")
    ]
    cmdclass = {"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
