"""One token times one lanes tile (kernels/cpu/lanes.py), all blocks, in ggml's vec_dot
arithmetic (decode's product, and every token of a batch).

For a single token the whole walk over a tile fits in registers, so this intrinsic writes it
as one LLVM loop: per 32-column block b, with the tile's R = 32 rows as 2 x 16 vector lanes,

    lane[l]  = sum_{j<4} code[r, 32b + 4l + j] * x[32b + 4l + j] - offset * xn4[8b + l]
               (vpdpbusd started from -offset * sum(x): exact int32)
    acc[l]  = fma(d_w[b, r] * d_x[b], float(lane[l]), acc[l])
    summs   = fma(m_w[b, r], s_x[b], summs)                              (formats with a min)

and stores acc (8, R) then summs (R,) to out: the same float steps, in the same order, as
ggml's. Codes are 8, 4 or 5 bits wide; d_w and m_w float16, after each block's codes."""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import _splat, open_loop
from .vnni import HAS_VNNI, R, dpbusd, dpbusd8

_I8X64 = ir.VectorType(ir.IntType(8), 64)
_I1X64 = ir.VectorType(ir.IntType(1), 64)
_I16X16 = ir.VectorType(ir.IntType(16), 16)
_F16X16 = ir.VectorType(ir.HalfType(), 16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_I32X16 = ir.VectorType(_I32, 16)
_F32X16 = ir.VectorType(_F32, 16)
_I8X32 = ir.VectorType(ir.IntType(8), 32)
_I1X32 = ir.VectorType(ir.IntType(1), 32)
_I16X8 = ir.VectorType(ir.IntType(16), 8)
_F16X8 = ir.VectorType(ir.HalfType(), 8)
_I32X8 = ir.VectorType(ir.IntType(32), 8)
_F32X8 = ir.VectorType(ir.FloatType(), 8)
_LANE_BYTES = 4 * R
CODE_BYTES = {8: 8 * _LANE_BYTES, 4: 4 * _LANE_BYTES, 5: 4 * _LANE_BYTES + R * 32 // 8}


def _data(context, builder, array_type, array):
    return cgutils.create_struct_proxy(array_type)(context, builder, value=array).data


def _load(builder, base, offset, vector_type):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), vector_type.as_pointer()), align=1)


def _codes(builder, wp, wb, bits, lane, h, c):
    """The 16 rows' stored codes of lane `lane`, half h, of the block at byte wb: <64 x i8>."""
    if bits == 8:
        return _load(builder, wp, builder.add(wb, c(_LANE_BYTES * lane + 64 * h)), _I8X64)
    v = _load(builder, wp, builder.add(wb, c(_LANE_BYTES * (lane // 2) + 64 * h)), _I8X64)
    if lane % 2:
        v = builder.lshr(v, ir.Constant(_I8X64, [4] * 64))
    else:
        v = builder.and_(v, ir.Constant(_I8X64, [15] * 64))
    if bits == 5:
        at = builder.add(wb, c(4 * _LANE_BYTES + 8 * (2 * lane + h)))
        mask = builder.load(builder.bitcast(builder.gep(wp, [at]), _I64.as_pointer()), align=1)
        fifth = builder.select(builder.bitcast(mask, _I1X64), ir.Constant(_I8X64, [16] * 64),
                               ir.Constant(_I8X64, [0] * 64))
        v = builder.or_(v, fifth)
    return v


def _splat8(builder, value, vector_type):
    v = builder.insert_element(ir.Constant(vector_type, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vector_type, None), ir.Constant(_I32X8, [0] * 8))


def _codes8(builder, wp, wb, bits, lane, q, c):
    """Rows 8q..8q+7 of lane `lane` of the block at byte wb: <32 x i8> (AVX2's quarter tile)."""
    if bits == 8:
        return _load(builder, wp, builder.add(wb, c(_LANE_BYTES * lane + 32 * q)), _I8X32)
    v = _load(builder, wp, builder.add(wb, c(_LANE_BYTES * (lane // 2) + 32 * q)), _I8X32)
    if lane % 2:
        v = builder.lshr(v, ir.Constant(_I8X32, [4] * 32))
    else:
        v = builder.and_(v, ir.Constant(_I8X32, [15] * 32))
    if bits == 5:  # this quarter's 32 bits of the (lane, half q // 2) fifth-bit mask
        at = builder.add(wb, c(4 * _LANE_BYTES + 8 * (2 * lane + q // 2) + 4 * (q % 2)))
        mask = builder.load(builder.bitcast(builder.gep(wp, [at]), _I32.as_pointer()), align=1)
        fifth = builder.select(builder.bitcast(mask, _I1X32), ir.Constant(_I8X32, [16] * 32),
                               ir.Constant(_I8X32, [0] * 32))
        v = builder.or_(v, fifth)
    return v


def _quarters(builder, fma, wp, xp, xdp, xsp, xnp, outp, b_o, n_blk, offset, c, bits, has_min):
    """AVX2 (16 vector registers): the tile as 4 passes over its blocks, 8 rows each, so that a
    pass's 8 lane accumulators (+ summs) stay in registers. Each row's steps are the 32-row
    walk's, in the same order: the same floats."""
    code_bytes = CODE_BYTES[bits]
    block_bytes = code_bytes + 2 * R * (2 if has_min else 1)
    zero_f = ir.Constant(_F32X8, None)

    def halves(wb, at):  # 8 float16 values of this block at byte `at` after the codes, as float
        v = _load(builder, wp, builder.add(wb, c(code_bytes + at)), _I16X8)
        return builder.fpext(builder.bitcast(v, _F16X8), _F32X8)

    for q in range(4):
        b, accs, finish = open_loop(builder, n_blk, [zero_f] * (9 if has_min else 8))
        wb = builder.mul(b, c(block_bytes))
        xb = builder.add(b_o, b)
        dd = builder.fmul(halves(wb, 16 * q), _splat8(builder, builder.load(builder.gep(xdp, [xb])), _F32X8))
        news = []
        for lane in range(8):
            x4 = builder.load(builder.bitcast(builder.gep(xp, [builder.add(builder.mul(b, c(32)), c(4 * lane))]),
                                              _I32.as_pointer()), align=1)
            xv = builder.bitcast(_splat8(builder, x4, _I32X8), _I8X32)
            n4 = builder.load(builder.gep(xnp, [builder.add(builder.mul(xb, c(8)), c(lane))]))
            start = _splat8(builder, builder.neg(builder.mul(offset, n4)), _I32X8)
            lanes = dpbusd8(builder, start, _codes8(builder, wp, wb, bits, lane, q, c), xv, small=bits < 8)
            news.append(builder.call(fma, [dd, builder.sitofp(lanes, _F32X8), accs[lane]]))
        if has_min:
            xsv = _splat8(builder, builder.load(builder.gep(xsp, [xb])), _F32X8)
            news.append(builder.call(fma, [halves(wb, 2 * R + 16 * q), xsv, accs[8]]))
        for k, res in enumerate(finish(news)):  # lane k's rows 8q.., then the summs
            ptr = builder.bitcast(builder.gep(outp, [ir.Constant(_I64, R * k + 8 * q)]), _F32X8.as_pointer())
            builder.store(res, ptr, align=4)


def _make(bits: int, has_min: bool, quarters: bool = False):
    code_bytes = CODE_BYTES[bits]
    block_bytes = code_bytes + 2 * R * (2 if has_min else 1)

    @intrinsic
    def lanes_gemv(typingctx, w, w_off, x, x_off, xd, xs, xn4, b_off, n_blk, offset, out):
        """w: the tile's bytes from w_off; x (int8) from x_off; xd/xs per block and xn4 per lane
        from b_off; out (9 * R,) float32."""
        sig = types.void(w, types.intp, x, types.intp, xd, xs, xn4, types.intp, types.intp, types.int32, out)

        def codegen(context, builder, signature, args):
            (w_a, w_o, x_a, x_o, xd_a, xs_a, xn_a, b_o, n_blk, offset, out_a) = args
            a = signature.args
            wp = builder.bitcast(builder.gep(_data(context, builder, a[0], w_a), [w_o]), ir.IntType(8).as_pointer())
            xp = builder.bitcast(builder.gep(_data(context, builder, a[2], x_a), [x_o]), ir.IntType(8).as_pointer())
            xdp, xsp, xnp = (_data(context, builder, a[i], v) for i, v in ((4, xd_a), (5, xs_a), (6, xn_a)))
            outp = _data(context, builder, a[10], out_a)
            intp = w_o.type
            c = lambda v: ir.Constant(intp, v)  # noqa: E731
            if quarters:
                fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X8, [_F32X8] * 3),
                                                      "llvm.fma.v8f32")
                _quarters(builder, fma8, wp, xp, xdp, xsp, xnp, outp, b_o, n_blk, offset, c, bits, has_min)
                return context.get_dummy_value()
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3),
                                                 "llvm.fma.v16f32")
            zero_f = ir.Constant(_F32X16, None)
            n_acc = 16 + (2 if has_min else 0)  # [lane][half], then summs halves

            b, accs, finish = open_loop(builder, n_blk, [zero_f] * n_acc)
            wb = builder.mul(b, c(block_bytes))
            def codes(lane, h):
                return _codes(builder, wp, wb, bits, lane, h, c)

            def halves(at):  # 16 float16 values of this block at byte `at` after the codes, as float
                v = _load(builder, wp, builder.add(wb, c(code_bytes + at)), _I16X16)
                return builder.fpext(builder.bitcast(v, _F16X16), _F32X16)

            xb = builder.add(b_o, b)
            xdv = _splat(builder, builder.load(builder.gep(xdp, [xb])), _F32X16)
            dd = [builder.fmul(halves(32 * h), xdv) for h in range(2)]
            news = []
            for lane in range(8):
                x4 = builder.load(builder.bitcast(builder.gep(xp, [builder.add(builder.mul(b, c(32)), c(4 * lane))]),
                                                  _I32.as_pointer()), align=1)
                xv = builder.bitcast(_splat(builder, x4, _I32X16), _I8X64)
                n4 = builder.load(builder.gep(xnp, [builder.add(builder.mul(xb, c(8)), c(lane))]))
                # the dot product starts from -offset * sum(x): lane - shift in one exact step
                start = _splat(builder, builder.neg(builder.mul(offset, n4)), _I32X16)
                for h in range(2):
                    f = builder.sitofp(dpbusd(builder, start, codes(lane, h), xv, small=bits < 8), _F32X16)
                    news.append(builder.call(fma, [dd[h], f, accs[2 * lane + h]]))
            if has_min:
                xsv = _splat(builder, builder.load(builder.gep(xsp, [xb])), _F32X16)
                for h in range(2):
                    news.append(builder.call(fma, [halves(2 * R + 32 * h), xsv, accs[16 + h]]))
            results = finish(news)
            for k, res in enumerate(results):
                ptr = builder.bitcast(builder.gep(outp, [ir.Constant(_I64, 16 * k)]), _F32X16.as_pointer())
                builder.store(res, ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lanes_gemv


gemv_4, gemv_4_min = _make(4, False), _make(4, True)
gemv_5, gemv_5_min = _make(5, False), _make(5, True)
gemv_8, gemv_8_min = _make(8, False), _make(8, True)
# AVX2 in batches: the tile in 4 passes of 8 rows (_quarters). Over SmolLM2's Q4_1 matrices,
# interleaved runs: 2 tokens 8.1 ms against 8.5 in one pass, 8 tokens 16.9 against 20.0; a lone
# token (memory-bound) 6.6 in one pass against 7.0
if HAS_VNNI:
    gemq_4, gemq_4_min, gemq_5, gemq_5_min, gemq_8, gemq_8_min = (
        gemv_4, gemv_4_min, gemv_5, gemv_5_min, gemv_8, gemv_8_min)
else:
    gemq_4, gemq_4_min = _make(4, False, True), _make(4, True, True)
    gemq_5, gemq_5_min = _make(5, False, True), _make(5, True, True)
    gemq_8, gemq_8_min = _make(8, False, True), _make(8, True, True)



def _make_widen(has_min: bool):
    src_bb = CODE_BYTES[5] + 2 * R * (2 if has_min else 1)
    dst_bb = CODE_BYTES[8] + 2 * R * (2 if has_min else 1)

    @intrinsic
    def widen_5(typingctx, w, w_off, n_blk, out):
        """out (n_blk blocks of the 8-bit layout) = the 5-bit tile at w_off with each code in a
        byte; each block's float16 scales (and mins) copied after its codes."""
        sig = types.void(w, types.intp, types.intp, out)

        def codegen(context, builder, signature, args):
            w_a, w_o, n_blk, out_a = args
            wp = builder.bitcast(builder.gep(_data(context, builder, signature.args[0], w_a), [w_o]),
                                 ir.IntType(8).as_pointer())
            op = builder.bitcast(_data(context, builder, signature.args[3], out_a), ir.IntType(8).as_pointer())
            c = lambda v: ir.Constant(w_o.type, v)  # noqa: E731
            b, _, finish = open_loop(builder, n_blk, [])
            wb, ob = builder.mul(b, c(src_bb)), builder.mul(b, c(dst_bb))
            for lane in range(8):
                for h in range(2):
                    at = builder.add(ob, c(_LANE_BYTES * lane + 64 * h))
                    builder.store(_codes(builder, wp, wb, 5, lane, h, c),
                                  builder.bitcast(builder.gep(op, [at]), _I8X64.as_pointer()), align=1)
            for k in range(0, src_bb - CODE_BYTES[5], 32):  # the float16 scales (and mins)
                v = _load(builder, wp, builder.add(wb, c(CODE_BYTES[5] + k)), _I16X16)
                builder.store(v, builder.bitcast(builder.gep(op, [builder.add(ob, c(CODE_BYTES[8] + k))]),
                                                 _I16X16.as_pointer()), align=1)
            finish([])
            return context.get_dummy_value()

        return sig, codegen

    return widen_5


widen_5, widen_5_min = _make_widen(False), _make_widen(True)
