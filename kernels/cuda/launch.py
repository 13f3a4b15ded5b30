"""Every kernel launch of the CUDA path goes through `launch`, so that a forward pass can be
recorded once and replayed without the Python that issued it.

    launch(kernel, grid, block, *args)      launch now (and record, while recording)
    with recording() as launches: ...       the launches issued inside, in order
    Replay(launches, stream).run()          issue them again, same arguments

A decode step issues the same launches with the same device buffers every token (the data that
changes, the token's embedding, its position and slots, lives in device buffers the step reads),
so the backend records the step once per KV cache and replays it. numba-cuda's launch path costs
~0.28 ms of Python a launch (typing the arguments, marshalling them, context checks); a replay
pays it once. Three ways to replay, the first that works on this device:
    graph      the launches captured into a CUDA graph on the replay's stream, one
               cuGraphLaunch a step
    prepared   each launch's marshalled arguments kept, one cuLaunchKernel a launch
    direct     the kernels called as at recording (the CUDA simulator has no driver)
MINILLM_CUDA_REPLAY=graph|prepared|direct chooses one (gpu-check compares them); off records
nothing (minillm/backends/cuda.py).

COUNTS is the hook the tests read: kernel launches issued (replays included, a graph's launches
counted one by one) and device buffers allocated by the layers' pool.
"""
from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections import Counter
from dataclasses import dataclass

from numba import cuda
from numba.core import config

COUNTS: Counter = Counter()  # "launches", "allocations", "replays"
_RECORDING: list | None = None
REPLAY_MODES = ("graph", "prepared", "direct")


@dataclass(frozen=True)
class Launch:
    kernel: object   # the numba-cuda dispatcher
    grid: tuple
    block: tuple
    args: tuple


GRID_LIMITS = (2**31 - 1, 65535, 65535)  # blocks along x, y, z (the kernels put rows on x)


def launch(kernel, grid, block, *args) -> None:
    """kernel[grid, block](*args), recorded while a recording is open; nothing for a grid of no
    blocks (work over zero rows, which CUDA refuses to launch). A grid past GRID_LIMITS, which
    a GPU refuses and the simulator runs, is a ValueError."""
    dims = grid if isinstance(grid, tuple) else (grid,)
    if not all(dims):
        return
    if any(d > limit for d, limit in zip(dims, GRID_LIMITS)):
        raise ValueError(f"a grid of {dims} blocks is past CUDA's limits {GRID_LIMITS}")
    COUNTS["launches"] += 1
    if _RECORDING is not None:
        _RECORDING.append(Launch(kernel, grid, block, args))
    kernel[grid, block](*args)


@contextlib.contextmanager
def recording():
    """Collect the launches issued inside the block (one recording at a time)."""
    global _RECORDING
    if _RECORDING is not None:
        raise RuntimeError("a recording is already open")
    _RECORDING = []
    try:
        yield _RECORDING
    finally:
        _RECORDING = None


def _dims(dims) -> tuple[int, int, int]:
    dims = tuple(dims) if isinstance(dims, tuple) else (dims,)
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def kernel_param(value):
    """One of numba-cuda's marshalled kernel arguments as the C value the kernel reads. Its
    _prepare_args gives ctypes scalars, and plain Python values that cuda.core's launch packs
    itself: ints (an array's size, itemsize, pointer, shape and strides: intptr_t) and bools."""
    if isinstance(value, ctypes._SimpleCData):
        return value
    if isinstance(value, bool):
        return ctypes.c_bool(value)
    if isinstance(value, int):
        return ctypes.c_ssize_t(value)
    if isinstance(value, float):
        return ctypes.c_double(value)
    raise TypeError(f"a kernel argument of type {type(value).__name__} cannot be prepared")


class _Prepared:
    """One launch with its arguments marshalled once (numba-cuda's own _prepare_args)."""

    def __init__(self, item: Launch):
        dispatcher = item.kernel
        argtypes = tuple(dispatcher.typeof_pyval(a) for a in item.args)
        compiled = dispatcher.compile(argtypes)  # already compiled by the recorded launch
        marshalled = []
        for ty, value in zip(compiled.argument_types, item.args):
            compiled._prepare_args(ty, value, 0, [], marshalled)
        self.kernelargs = [kernel_param(v) for v in marshalled]  # alive as long as params points at them
        self.params = (ctypes.c_void_p * len(self.kernelargs))(*[ctypes.addressof(a) for a in self.kernelargs])
        self.handle = compiled._codelibrary.get_cufunc().handle
        self.grid, self.block = _dims(item.grid), _dims(item.block)

    def issue(self, driver, stream_handle) -> None:
        driver.cuLaunchKernel(self.handle, *self.grid, *self.block, 0, stream_handle,
                              ctypes.addressof(self.params), 0)


class Replay:
    """Recorded launches, issued again on `stream` (None under the simulator)."""

    def __init__(self, launches: list[Launch], stream=None, mode: str = "auto"):
        """mode: one of REPLAY_MODES, or "auto": the first that works (why the others did not
        is kept in `fallback`). Under the simulator (stream None) always direct."""
        if mode not in ("auto", *REPLAY_MODES):
            raise ValueError(f"replay mode {mode!r}: choose auto or one of {', '.join(REPLAY_MODES)}")
        self.launches = list(launches)
        self.stream = stream
        self.mode = "direct"
        self.fallback = ""
        self._prepared: list[_Prepared] = []
        self._graph = None
        if config.ENABLE_CUDASIM or stream is None or mode == "direct":
            return
        try:
            self._prepared = [_Prepared(item) for item in self.launches]
            self.mode = "prepared"
            if mode in ("auto", "graph"):
                self._graph = self._capture()
                self.mode = "graph"
        except Exception as exc:  # noqa: BLE001 (whatever the driver or numba-cuda's internals raise)
            if mode != "auto":
                raise
            self.fallback = f"{type(exc).__name__}: {exc}"
            if self.mode == "direct":
                self._prepared = []

    def _capture(self):
        """The prepared launches as one instantiated CUDA graph (captured, not run). A device
        free would invalidate the capture: numba's deferred frees (issued when garbage is
        collected, which the capture's own Python can set off) wait until it ends. The captured
        graph is destroyed once instantiated, the executable one when this Replay goes (a cache
        copied for a beam records its own)."""
        from cuda.bindings import driver as binding
        from numba.cuda.cudadrv.driver import driver

        handle = self.stream.handle
        with cuda.defer_cleanup():
            driver.cuStreamBeginCapture(handle, binding.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            try:
                for item in self._prepared:
                    item.issue(driver, handle)
            finally:
                graph = driver.cuStreamEndCapture(handle)
        try:
            executable = driver.cuGraphInstantiate(graph, 0)
        finally:
            driver.cuGraphDestroy(graph)
        weakref.finalize(self, _destroy_executable, executable).atexit = False  # the process's end frees it
        return executable

    def run(self) -> None:
        COUNTS["replays"] += 1
        COUNTS["launches"] += len(self.launches)
        if self._graph is not None:
            from numba.cuda.cudadrv.driver import driver

            driver.cuGraphLaunch(self._graph, self.stream.handle)
        elif self._prepared:
            from numba.cuda.cudadrv.driver import driver

            handle = self.stream.handle
            for item in self._prepared:
                item.issue(driver, handle)
        else:
            for item in self.launches:
                if self.stream is None:
                    item.kernel[item.grid, item.block](*item.args)
                else:
                    item.kernel[item.grid, item.block, self.stream](*item.args)


def _destroy_executable(executable) -> None:
    from numba.cuda.cudadrv.driver import driver

    try:
        driver.cuGraphExecDestroy(executable)
    except Exception:  # noqa: BLE001 (the context already gone: nothing left to free)
        pass


def new_stream():
    """The stream replays run on: a stream of its own on a GPU (graph capture cannot use the
    legacy default stream), None under the simulator."""
    return None if config.ENABLE_CUDASIM else cuda.stream()
