"""Loading cached kernels without parsing their LLVM bitcode.

Numba caches a compiled function as its machine code plus its LLVM bitcode. Loading it, Numba
parses the bitcode (kept for linking the function into one compiled later) and lists the
symbols the bitcode defines. For this project's layer functions that was 0.15-0.25 s of every
start and ~30 MiB held for the life of the process, for bitcode no normal run links against.

`install()` changes two methods of Numba's CPU code library: a cached library takes its
defined symbols from the machine code's ELF symbol table, its bitcode is parsed only if
something links against it, and one whose code calls the threading layer starts the layer.
Where the hooks it relies on are missing (another Numba) or the machine code is not ELF
(another OS), Numba's own loading runs unchanged.
"""
from __future__ import annotations

import struct

# A cached function that calls a parallel=True one (layers.quantize, through quantize_act, the
# parallel quantizer) calls the threading layer's entry points, but Numba starts the layer on
# loading the parallel function's own cache entry only (numba issues 8578 and 9938): loaded
# first in a process, such a function jumped to address 0. A cached library whose code names
# the layer's entry point starts it before it loads.
_THREADING_ENTRY = b"numba_parallel_for"
_SHT_SYMTAB = 2
_SHN_UNDEF = 0
_STT_SECTION, _STT_FILE = 3, 4


def elf_defined_symbols(obj: bytes) -> set[str] | None:
    """Names of the symbols a 64-bit little-endian ELF object defines; None if obj is not one."""
    if obj[:4] != b"\x7fELF" or obj[4:6] != b"\x02\x01":
        return None
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != _SHT_SYMTAB:
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, entsize):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", obj, at)
            if st_shndx == _SHN_UNDEF or st_name == 0 or st_info & 0xF in (_STT_SECTION, _STT_FILE):
                continue
            start = strings + st_name
            names.add(obj[start:obj.index(b"\0", start)].decode())
    return names


def install() -> bool:
    """Patch Numba's CPU code library (once); False where this Numba lacks the hooks."""
    try:
        import llvmlite.binding as llvm
        from numba.core.codegen import CPUCodeLibrary, JitEngine
        from numba.np.ufunc.parallel import _launch_threads
    except ImportError:
        return False
    if getattr(CPUCodeLibrary, "_minillm_lazy", False):
        return True
    hooks = ("_unserialize", "_get_module_for_linking", "enable_object_caching", "_set_compiled_object",
             "_finalize_final_module")
    if not all(hasattr(CPUCodeLibrary, h) for h in hooks) or not hasattr(JitEngine, "_load_defined_symbols"):
        return False
    numba_unserialize = CPUCodeLibrary._unserialize.__func__
    numba_module_for_linking = CPUCodeLibrary._get_module_for_linking

    def _unserialize(cls, codegen, state):
        _, kind, data = state
        if kind == "object" and _THREADING_ENTRY in data[0]:
            _launch_threads()
        symbols = elf_defined_symbols(data[0]) if kind == "object" else None
        if symbols is None:
            return numba_unserialize(cls, codegen, state)
        library = codegen.create_library(state[0])
        library.enable_object_caching()
        library._set_compiled_object(data[0])
        library._minillm_bitcode = data[1]
        library._finalize_final_module()
        codegen._engine._defined_symbols |= symbols
        return library

    def _get_module_for_linking(self):
        bitcode = getattr(self, "_minillm_bitcode", None)
        if bitcode is not None:
            self._shared_module = llvm.parse_bitcode(bitcode)
            self._minillm_bitcode = None
        return numba_module_for_linking(self)

    CPUCodeLibrary._unserialize = classmethod(_unserialize)
    CPUCodeLibrary._get_module_for_linking = _get_module_for_linking
    CPUCodeLibrary._minillm_lazy = True
    return True
