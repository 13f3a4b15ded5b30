"""The int8 dot product of one weight tile with one activation group, in AVX-512 VNNI.

Numba cannot emit `vpdpbusd` from Python loops, so this is a Numba intrinsic that writes the
LLVM IR itself. Layout (see matmul.py): a tile holds R = 32 rows; for every 4 consecutive
columns (k4) it stores 128 bytes, rows 0..15 then 16..31, 4 bytes per row, each weight code
as unsigned (q + 128). One step of the loop:

    acc[r] += sum_{j<4} w_u8[k4, r, j] * x_s8[4*k4 + j]      for the 32 rows r

so after n_k4 steps out[r] = sum_k code[r, k] * x[k], code = q + offset; the caller subtracts
offset * sum(x). `tile_dot_nib` reads 4-bit codes, two columns per byte (half the bytes).
`tile_dot4` does 4 tokens at once, reusing each weight load (prefill). The `_portable`
versions compute the same in plain Numba for CPUs without AVX-512 VNNI.
"""
import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .target import FEATURES

R = 32
HAS_VNNI = FEATURES.get("avx512vnni", False)
# the LLVM kernels need an exact 4-byte integer dot product: vpdpbusd (AVX-512 VNNI), or the
# same sums from vpmaddwd on AVX2 (dpbusd below); elsewhere the plain Numba (_portable) paths run
HAS_INT8_DOT = HAS_VNNI or FEATURES.get("avx2", False)

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I32X16 = ir.VectorType(_I32, 16)
_I8X64 = ir.VectorType(ir.IntType(8), 64)


def dpbusd(builder, acc, u8, s8, small=False):
    """acc (16 x i32) + in each lane j the sum of u8[4j + i] * s8[4j + i], i < 4 (u8 unsigned,
    s8 signed bytes, 64 each): vpdpbusd. Without AVX-512 VNNI, AVX2 gives the same exact sums
    (dpbusd8, on each half)."""
    if HAS_VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32X16, [_I32X16, _I8X64, _I8X64]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [acc, u8, s8])
    halves = []
    for c in range(2):
        pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * c, 32 * c + 32)))
        acc8 = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(_I32, 8), list(range(8 * c, 8 * c + 8))))
        halves.append(dpbusd8(builder, acc8, builder.shuffle_vector(u8, u8, pick),
                              builder.shuffle_vector(s8, s8, pick), small))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_I32X16, list(range(16))))


def dpbusd8(builder, acc, u8, s8, small=False):
    """acc (8 x i32) + in each lane j the sum of u8[4j + i] * s8[4j + i], i < 4 (32 unsigned
    bytes u8, 32 signed s8), on AVX2: vpmaddubsw adds the products in pairs to 16 bits, then
    vpmaddwd by ones adds the pairs. vpmaddubsw saturates above 2^15 - 1, which codes below 128
    (as 4- to 6-bit codes are: small) never reach with activations in [-127, 127]
    (2 * 127 * 127); wider codes are split into their top bit and the rest
    (u8 = (u8 & 128) + (u8 & 127): 2 * 128 * 127 fits too), each summed so. Exact sums."""
    i8x32, i16x16, i32x8 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8)
    maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16x16, [i8x32, i8x32]),
                                             "llvm.x86.avx2.pmadd.ub.sw")
    pmaddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32x8, [i16x16, i16x16]),
                                             "llvm.x86.avx2.pmadd.wd")
    ones = ir.Constant(i16x16, [1] * 16)
    parts = [u8] if small else [builder.and_(u8, ir.Constant(i8x32, [127] * 32)),
                                builder.and_(u8, ir.Constant(i8x32, [128] * 32))]
    for part in parts:
        acc = builder.add(acc, builder.call(pmaddwd, [builder.call(maddubs, [part, s8]), ones]))
    return acc


def _data_pointer(context, builder, array_type, array, offset):
    data = cgutils.create_struct_proxy(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [offset]), ir.IntType(8).as_pointer())


def _make_vnni_intrinsic(nibbles: bool, n_tok: int):
    """The tile dot product of n_tok tokens (each weight load reused n_tok times) for bytes (one
    k4 step per 128 bytes) or nibbles (two k4 steps per 128 bytes: low nibbles are columns
    8p..8p+3, high nibbles 8p+4..8p+7). out[tok * 32 + r]; token tok's codes at x_off + tok * x_stride."""

    @intrinsic
    def tile_dot(typingctx, w, w_off, x, x_off, x_stride, n_k4, out):
        sig = types.void(w, types.intp, x, types.intp, types.intp, types.intp, out)

        def codegen(context, builder, signature, args):
            w_arr, w_off, x_arr, x_off, x_stride, n, out_arr = args
            wp = _data_pointer(context, builder, signature.args[0], w_arr, w_off)
            xps = [_data_pointer(context, builder, signature.args[2], x_arr,
                                 builder.add(x_off, builder.mul(x_stride, ir.Constant(n.type, tok))))
                   for tok in range(n_tok)]
            op = cgutils.create_struct_proxy(signature.args[6])(context, builder, value=out_arr).data
            n_steps = builder.lshr(n, ir.Constant(n.type, 1)) if nibbles else n
            zero = ir.Constant(_I32X16, None)
            entry = builder.block
            loop = builder.append_basic_block("vnni_loop")
            done = builder.append_basic_block("vnni_done")
            builder.cbranch(builder.icmp_signed(">", n_steps, ir.Constant(n.type, 0)), loop, done)

            builder.position_at_end(loop)
            i = builder.phi(n.type)
            i.add_incoming(ir.Constant(n.type, 0), entry)
            accs = [builder.phi(_I32X16) for _ in range(2 * n_tok)]  # [tok][half]
            for acc in accs:
                acc.add_incoming(zero, entry)

            def x_broadcast(xp, col):  # 4 activation bytes at column col, in all 16 lanes
                x4 = builder.load(builder.bitcast(builder.gep(xp, [col]), _I32.as_pointer()), align=1)
                xv = builder.insert_element(ir.Constant(_I32X16, None), x4, ir.Constant(_I32, 0))
                xv = builder.shuffle_vector(xv, ir.Constant(_I32X16, None), ir.Constant(_I32X16, [0] * 16))
                return builder.bitcast(xv, _I8X64)

            base = builder.shl(i, ir.Constant(n.type, 7))  # 128 bytes per step
            halves = [builder.load(builder.bitcast(builder.gep(wp, [builder.add(base, ir.Constant(n.type, off))]),
                                                   _I8X64.as_pointer()), align=1) for off in (0, 64)]
            if nibbles:
                low, four = ir.Constant(_I8X64, [15] * 64), ir.Constant(_I8X64, [4] * 64)
                halves = [(builder.and_(h, low), builder.lshr(h, four)) for h in halves]
                col = builder.shl(i, ir.Constant(n.type, 3))
            else:
                col = builder.shl(i, ir.Constant(n.type, 2))
            news = []
            for tok in range(n_tok):
                if nibbles:
                    xa = x_broadcast(xps[tok], col)
                    xb = x_broadcast(xps[tok], builder.add(col, ir.Constant(n.type, 4)))
                    for half in range(2):
                        lo, hi = halves[half]
                        new = dpbusd(builder, accs[2 * tok + half], lo, xa, small=True)
                        news.append(dpbusd(builder, new, hi, xb, small=True))
                else:
                    xv = x_broadcast(xps[tok], col)
                    for half in range(2):
                        news.append(dpbusd(builder, accs[2 * tok + half], halves[half], xv))
            nxt = builder.add(i, ir.Constant(n.type, 1))
            i.add_incoming(nxt, loop)
            for acc, new in zip(accs, news):
                acc.add_incoming(new, loop)
            builder.cbranch(builder.icmp_signed("<", nxt, n_steps), loop, done)

            builder.position_at_end(done)
            results = [builder.phi(_I32X16) for _ in news]  # phi nodes first in the block
            for k, (res, new) in enumerate(zip(results, news)):
                res.add_incoming(zero, entry)
                res.add_incoming(new, loop)
            for k, res in enumerate(results):
                ptr = builder.gep(op, [ir.Constant(ir.IntType(64), 16 * k)])
                builder.store(res, builder.bitcast(ptr, _I32X16.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_dot


_vnni = {(nib, n): _make_vnni_intrinsic(nib, n) for nib in (False, True) for n in (1, 4)}
_vnni_b1, _vnni_b4, _vnni_n1, _vnni_n4 = _vnni[False, 1], _vnni[False, 4], _vnni[True, 1], _vnni[True, 4]


def _make_lanes_intrinsic(nibbles: bool, n_tok: int):
    """The integer dot products of one 32-column block, kept per lane as ggml's SIMD vec_dot
    keeps them: lane l (0..7) sums columns 4l..4l+3 of the block. out[(tok * 8 + l) * 32 + r]
    for the 32 rows r of the tile; w_off is the block's first byte, x_off its first column."""

    @intrinsic
    def tile_lanes(typingctx, w, w_off, x, x_off, x_stride, out):
        sig = types.void(w, types.intp, x, types.intp, types.intp, out)

        def codegen(context, builder, signature, args):
            w_arr, w_off, x_arr, x_off, x_stride, out_arr = args
            wp = _data_pointer(context, builder, signature.args[0], w_arr, w_off)
            op = cgutils.create_struct_proxy(signature.args[5])(context, builder, value=out_arr).data
            zero = ir.Constant(_I32X16, None)
            intp = w_off.type

            def load_w(byte):
                ptr = builder.bitcast(builder.gep(wp, [ir.Constant(intp, byte)]), _I8X64.as_pointer())
                return builder.load(ptr, align=1)

            weights = []  # weights[l] = (rows 0..15, rows 16..31) codes of lane l, one byte each
            if nibbles:
                low, four = ir.Constant(_I8X64, [15] * 64), ir.Constant(_I8X64, [4] * 64)
                for p in range(4):
                    halves = [load_w(128 * p + off) for off in (0, 64)]
                    weights.append([builder.and_(h, low) for h in halves])
                    weights.append([builder.lshr(h, four) for h in halves])
            else:
                for l in range(8):
                    weights.append([load_w(128 * l + off) for off in (0, 64)])
            for tok in range(n_tok):
                xoff = builder.add(x_off, builder.mul(x_stride, ir.Constant(intp, tok)))
                xp = _data_pointer(context, builder, signature.args[2], x_arr, xoff)
                for l in range(8):
                    x4 = builder.load(builder.bitcast(builder.gep(xp, [ir.Constant(intp, 4 * l)]),
                                                      _I32.as_pointer()), align=1)
                    xv = builder.insert_element(ir.Constant(_I32X16, None), x4, ir.Constant(_I32, 0))
                    xv = builder.shuffle_vector(xv, ir.Constant(_I32X16, None), ir.Constant(_I32X16, [0] * 16))
                    xv = builder.bitcast(xv, _I8X64)
                    for half in range(2):
                        res = dpbusd(builder, zero, weights[l][half], xv, small=nibbles)
                        ptr = builder.gep(op, [ir.Constant(ir.IntType(64), (tok * 8 + l) * 32 + 16 * half)])
                        builder.store(res, builder.bitcast(ptr, _I32X16.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile_lanes


_lanes = {(nib, n): _make_lanes_intrinsic(nib, n) for nib in (False, True) for n in (1, 4)}
_lanes_b1, _lanes_b4, _lanes_n1, _lanes_n4 = _lanes[False, 1], _lanes[False, 4], _lanes[True, 1], _lanes[True, 4]


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_lanes_vnni(w, w_off, x, x_off, x_stride, n_tok, nibbles, out):
    if nibbles:
        if n_tok == 4:
            _lanes_n4(w, w_off, x, x_off, x_stride, out)
        else:
            _lanes_n1(w, w_off, x, x_off, x_stride, out)
    elif n_tok == 4:
        _lanes_b4(w, w_off, x, x_off, x_stride, out)
    else:
        _lanes_b1(w, w_off, x, x_off, x_stride, out)


@nb.njit(inline="always", cache=True, nogil=True)
def tile_lanes_portable(w, w_off, x, x_off, x_stride, n_tok, nibbles, out):
    for tok in range(n_tok):
        xb = x_off + tok * x_stride
        for l in range(8):
            for r in range(R):
                total = np.int32(0)
                for j in range(4):
                    if nibbles:
                        byte = np.int32(w[w_off + (l // 2) * 4 * R + 4 * r + j])
                        code = (byte >> 4) if l % 2 else (byte & 15)
                    else:
                        code = np.int32(w[w_off + l * 4 * R + 4 * r + j])
                    total += code * np.int32(x[xb + 4 * l + j])
                out[(tok * 8 + l) * R + r] = total



@nb.njit(inline="always", cache=True, nogil=True)
def _tile_dot_vnni_call(w, w_off, x, x_off, n_k4, out):
    _vnni_b1(w, w_off, x, x_off, 0, n_k4, out)


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_dot_vnni_nib_call(w, w_off, x, x_off, n_k4, out):
    _vnni_n1(w, w_off, x, x_off, 0, n_k4, out)


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_dot4_vnni_call(w, w_off, x, x_off, x_stride, n_k4, out):
    _vnni_b4(w, w_off, x, x_off, x_stride, n_k4, out)


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_dot4_vnni_nib_call(w, w_off, x, x_off, x_stride, n_k4, out):
    _vnni_n4(w, w_off, x, x_off, x_stride, n_k4, out)


@nb.njit(inline="always", cache=True, nogil=True)
def tile_dot_portable(w, w_off, x, x_off, n_k4, out):
    for r in range(R):
        out[r] = 0
    for s in range(n_k4):
        wb = w_off + s * 4 * R
        xb = x_off + s * 4
        x0, x1 = np.int32(x[xb]), np.int32(x[xb + 1])
        x2, x3 = np.int32(x[xb + 2]), np.int32(x[xb + 3])
        for r in range(R):
            o = wb + 4 * r
            out[r] = np.int32(out[r] + np.int32(w[o]) * x0 + np.int32(w[o + 1]) * x1
                              + np.int32(w[o + 2]) * x2 + np.int32(w[o + 3]) * x3)


@nb.njit(inline="always", cache=True, nogil=True)
def tile_dot_nib_portable(w, w_off, x, x_off, n_k4, out):
    for r in range(R):
        out[r] = 0
    for s in range(n_k4 // 2):
        wb = w_off + s * 4 * R
        xb = x_off + s * 8
        for r in range(R):
            o = wb + 4 * r
            total = np.int32(0)
            for j in range(4):
                byte = np.int32(w[o + j])
                total += (byte & 15) * np.int32(x[xb + j]) + (byte >> 4) * np.int32(x[xb + 4 + j])
            out[r] = np.int32(out[r] + total)


@nb.njit(inline="always", cache=True, nogil=True)
def tile_dot4_portable(w, w_off, x, x_off, x_stride, n_k4, out):
    for tok in range(4):
        tile_dot_portable(w, w_off, x, x_off + tok * x_stride, n_k4, out[tok * R:])


@nb.njit(inline="always", cache=True, nogil=True)
def tile_dot4_nib_portable(w, w_off, x, x_off, x_stride, n_k4, out):
    for tok in range(4):
        tile_dot_nib_portable(w, w_off, x, x_off + tok * x_stride, n_k4, out[tok * R:])


tile_dot = _tile_dot_vnni_call if HAS_INT8_DOT else tile_dot_portable
tile_dot_nib = _tile_dot_vnni_nib_call if HAS_INT8_DOT else tile_dot_nib_portable
tile_dot4 = _tile_dot4_vnni_call if HAS_INT8_DOT else tile_dot4_portable          # 4 tokens at once
tile_dot4_nib = _tile_dot4_vnni_nib_call if HAS_INT8_DOT else tile_dot4_nib_portable
tile_lanes = _tile_lanes_vnni if HAS_INT8_DOT else tile_lanes_portable  # per-lane sums of one block
