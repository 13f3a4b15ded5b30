"""Numba's caches, keyed to every source the kernels are compiled from.

Numba checks a cached function against its own source file only. A kernel that inlines code
from another module (most do: simd.py's intrinsics, the layer's operations, the CUDA device
helpers) would otherwise load machine code compiled from that module's old text after it
changed (an edit, an upgrade of minillm that leaves the caches in place): wrong results or a
crash. `install_cpu()` and `install_cuda()` add to the stamp of every cached function of this
package a digest of all the sources its backend's compiled code is made of, so that any change
to them compiles that backend's kernels again, once.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

# globbed in kernels/ and minillm/
CPU_SOURCES = ("cpu/*.py", "arch/*.py", "quality/imatrix.py")
CUDA_SOURCES = ("cuda/*.py", "cpu/*.py")  # the CUDA kernels take some constants from the CPU's


def _roots() -> tuple[Path, Path]:
    """kernels/ and the package folder whose sources (arch/, quality/) compiled code also comes
    from, found by the layout rather than by importing the package: installed, kernels/ is
    minillm/kernels; in the source tree (an editable install), kernels/ sits beside minillm/."""
    kernels = Path(__file__).resolve().parent
    installed = kernels.parent
    return kernels, installed if (installed / "arch").is_dir() else installed / "minillm"


def source_digest(patterns=CPU_SOURCES) -> str:
    """sha256 over the files compiled code comes from (their names and contents)."""
    h = hashlib.sha256()
    for root in _roots():
        for pattern in patterns:
            for path in sorted(root.glob(pattern)):
                h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _stamp(locator_classes, digest: str) -> None:
    """Each class's get_source_stamp, for functions of this package, also returns digest."""
    roots = tuple(str(p) for p in _roots())
    own_stamps = [(cls, cls.get_source_stamp) for cls in locator_classes]  # all before any is replaced
    for cls, own_stamp in own_stamps:
        def get_source_stamp(self, own_stamp=own_stamp):
            stamp = own_stamp(self)
            if str(Path(self._py_file).resolve()).startswith(roots):
                return stamp, digest
            return stamp

        cls.get_source_stamp = get_source_stamp
        cls._minillm_digest = digest


def install_cpu() -> bool:
    """Stamp this package's cached CPU functions with source_digest(CPU_SOURCES) (once); False
    where this Numba lacks the hook."""
    try:
        from numba.core.caching import _SourceFileBackedLocatorMixin
    except ImportError:
        return False
    if "_minillm_digest" not in vars(_SourceFileBackedLocatorMixin):
        _stamp([_SourceFileBackedLocatorMixin], source_digest(CPU_SOURCES))
    return True


def install_cuda() -> bool:
    """Stamp this package's cached CUDA kernels with source_digest(CUDA_SOURCES) and the ggml
    build they compute as (once): every locator numba-cuda's cache tries; False where this
    numba-cuda lacks them. (The CUDA kernels sum as the host CPU's ggml build does, and a cache
    can move between hosts, where Numba's CPU cache is kept per CPU.)"""
    try:
        from numba.cuda.core.caching import CacheImpl
    except ImportError:
        return False
    from .cpu.target import GGML_AVX512

    classes = [cls for cls in CacheImpl._locator_classes if "_minillm_digest" not in vars(cls)]
    _stamp(classes, source_digest(CUDA_SOURCES) + ("-avx512" if GGML_AVX512 else "-avx2"))
    return True
