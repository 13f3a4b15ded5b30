"""Numba's cache, keyed to every source its kernels are compiled from.

Numba checks a cached function against its own source file only. A kernel that inlines code
from another module (most do: simd.py's intrinsics, the layer's operations) would otherwise
load machine code compiled from that module's old text after it changed (an edit, an upgrade
of minillm that leaves the caches in place): wrong results or a crash. `install()` adds to
the stamp of every function of this package a digest of all the sources compiled code is made
of, so that any change to them recompiles every kernel once.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

COMPILED_SOURCES = ("cpu/*.py", "arch/*.py", "quality/imatrix.py")  # globbed in kernels/ and minillm/


def _roots() -> tuple[Path, Path]:
    """kernels/ and minillm/ (kernels/ is installed as minillm.kernels, so minillm is importing it)."""
    import minillm

    return Path(__file__).resolve().parent.parent, Path(minillm.__file__).resolve().parent


def source_digest() -> str:
    """sha256 over the files compiled code comes from (their names and contents)."""
    h = hashlib.sha256()
    for root in _roots():
        for pattern in COMPILED_SOURCES:
            for path in sorted(root.glob(pattern)):
                h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def install() -> bool:
    """Stamp this package's cached functions with source_digest() (once); False where this
    Numba lacks the hook."""
    try:
        from numba.core.caching import _SourceFileBackedLocatorMixin
    except ImportError:
        return False
    if getattr(_SourceFileBackedLocatorMixin, "_minillm_digest", None) is not None:
        return True
    roots = tuple(str(p) for p in _roots())
    numba_stamp = _SourceFileBackedLocatorMixin.get_source_stamp
    digest = source_digest()

    def get_source_stamp(self):
        stamp = numba_stamp(self)
        if str(Path(self._py_file).resolve()).startswith(roots):
            return stamp, digest
        return stamp

    _SourceFileBackedLocatorMixin.get_source_stamp = get_source_stamp
    _SourceFileBackedLocatorMixin._minillm_digest = digest
    return True
