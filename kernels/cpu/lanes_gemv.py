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
from .vnni import R, dpbusd

_I8X64 = ir.VectorType(ir.IntType(8), 64)
_I1X64 = ir.VectorType(ir.IntType(1), 64)
_I16X16 = ir.VectorType(ir.IntType(16), 16)
_F16X16 = ir.VectorType(ir.HalfType(), 16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_I32X16 = ir.VectorType(_I32, 16)
_F32X16 = ir.VectorType(_F32, 16)
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


def _make(bits: int, has_min: bool):
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
