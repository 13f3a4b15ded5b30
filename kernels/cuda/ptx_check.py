"""Compile every registered CUDA kernel to PTX, and assemble it to the GPU's machine code
(a cubin, through nvJitLink), without needing a GPU.

    python -m minillm.kernels.cuda.ptx_check [--cc 9.0] [--out DIR]

Assembling checks what compiling to PTX does not: the inline PTX of kernels/cuda/ptx.py (dp4a,
the tensor cores' mma) and every instruction's operands, as the driver would on first launch.
Each line also gives ptxas's registers a thread and stack bytes: a kernel's local arrays that
did not stay in registers (indexed by a value the compiler cannot unroll) show as stack. A kernel
whose PTX has a float multiply or add that ptxas could fuse into an fma fails (registry.py
compiles without contraction, so that a kernel rounds as its source and the simulator do).

Needs the real CUDA target (NUMBA_ENABLE_CUDASIM unset) and NVVM, which the `cuda` extra brings
(numba-cuda[cu13] installs NVVM, NVRTC and libdevice as wheels, found by cuda-pathfinder: no
CUDA_HOME needed). Prints one line per kernel signature and exits 1 if any fails.

numba-cuda compiles a kernel's device functions for the *current device's* compute capability,
which asks the driver; with no GPU that fails even inside compile_ptx. While compiling here,
the device query answers with the requested capability instead (_assume_device).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
import types
from pathlib import Path


@contextlib.contextmanager
def _assume_device(cc: tuple[int, int]):
    import numba.cuda.dispatcher as dispatcher

    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def compile_all(cc: tuple[int, int] = (9, 0), report=None) -> dict[tuple[str, str], str]:
    """{(kernel name, signature): PTX} for every kernel in the registry; raises on the first failure."""
    from numba import cuda
    from numba.core import config

    if config.ENABLE_CUDASIM:
        raise RuntimeError("ptx_check needs the real CUDA target: unset NUMBA_ENABLE_CUDASIM")
    from . import KERNELS  # noqa: F401  (imports every kernel module, filling the registry)

    results = {}
    with _assume_device(cc):
        for spec in KERNELS.values():
            for sig in spec.signatures:
                start = time.perf_counter()
                ptx, _ = cuda.compile_ptx(spec.pyfunc, sig, cc=cc)
                check_no_fusable_arithmetic(ptx, spec.name)
                code = assemble(ptx, cc, spec.name)
                results[spec.name, sig] = ptx
                if report:
                    report(f"{spec.name:24s} {len(ptx):7d} chars of PTX, {code['cubin_bytes']:7d} bytes of "
                           f"sm_{cc[0]}{cc[1]} code, {code['registers']:3d} registers, {code['stack_bytes']:4d} B stack "
                           f" {time.perf_counter() - start:5.2f} s  {sig}")
    return results


# a float multiply, add or subtract without a rounding modifier, which ptxas may fuse into an fma
_FUSABLE = re.compile(r"^\s*(?:@!?%p\d+\s+)?(mul|add|sub)\.f(?:32|64)\s", re.M)


def check_no_fusable_arithmetic(ptx: str, name: str) -> None:
    """RuntimeError if ptx has an instruction ptxas could fuse into an fma (registry.py compiles
    without contraction, so that the kernels round as their source does)."""
    fusable = _FUSABLE.findall(ptx)
    if fusable:
        raise RuntimeError(f"{name}: {len(fusable)} float {'/'.join(sorted(set(fusable)))} instructions "
                           "without a rounding modifier (ptxas may fuse them into fma)")


def assemble(ptx: str, cc: tuple[int, int], name: str) -> dict:
    """ptx assembled by nvJitLink for compute capability cc: the cubin's bytes, and ptxas's
    registers a thread and stack bytes (local memory: arrays not kept in registers, spills);
    RuntimeError with its log if it refuses the PTX."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(2, [f"-arch=sm_{cc[0]}{cc[1]}", "-verbose"])
    try:
        data = ptx.encode()
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), name)
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            raise RuntimeError(f"{name}: nvJitLink refuses its PTX ({exc}): {_log(handle, 'error')}") from None
        info = _log(handle, "info")
        registers = re.search(r"Used (\d+) registers", info)
        stack = re.search(r"(\d+) bytes stack frame", info)
        return {"cubin_bytes": nvjitlink.get_linked_cubin_size(handle),
                "registers": int(registers.group(1)) if registers else -1,
                "stack_bytes": int(stack.group(1)) if stack else -1}
    finally:
        nvjitlink.destroy(handle)


def _log(handle, kind: str) -> str:
    from cuda.bindings import nvjitlink

    size = getattr(nvjitlink, f"get_{kind}_log_size")(handle)
    log = bytearray(size)
    getattr(nvjitlink, f"get_{kind}_log")(handle, log)
    return log.decode(errors="replace")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 (Hopper), 8.0, 8.9")
    parser.add_argument("--out", type=Path, help="write each kernel's PTX into this folder")
    args = parser.parse_args(argv)
    cc = tuple(int(part) for part in args.cc.split("."))
    try:
        results = compile_all(cc, report=print)
    except Exception as exc:  # report which kernel failed, then the error
        print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        names = sorted({name for name, _ in results})
        for name in names:
            sigs = [sig for n, sig in results if n == name]
            for i, sig in enumerate(sigs):
                filename = f"{name}.ptx" if len(sigs) == 1 else f"{name}_{i}.ptx"
                (args.out / filename).write_text(results[name, sig])
    print(f"compiled {len(results)} kernel signatures for sm_{cc[0]}{cc[1]}, each assembled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
