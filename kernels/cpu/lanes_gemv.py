"""One token times one weight tile, all blocks, in ggml's vec_dot arithmetic (decode's product).

qmatmul_lanes (matmul.py) walks a tile block by block through memory; for a single token the
whole walk fits in registers, so this intrinsic writes it as one LLVM loop: per 32-column
block b, with the tile's R = 32 rows as 2 x 16 vector lanes,

    lane[l]  = sum_{j<4} code[r, 32b + 4l + j] * x[32b + 4l + j]      (vpdpbusd, exact int32)
    acc[l]  = fma(scale[b, r] * d_x[b], float(lane[l] - offset * xn4[8b + l]), acc[l])
    summs   = fma(bias[b, r], s_x[b], summs)                             (formats with a min)

and stores acc (8, R) then summs (R,) to out: the same float steps, in the same order, as the
block loop. Codes are bytes, or nibbles two a byte (see matmul.py's tile layout)."""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import _splat, open_loop
from .vnni import R

_I8X64 = ir.VectorType(ir.IntType(8), 64)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_I32X16 = ir.VectorType(_I32, 16)
_F32X16 = ir.VectorType(_F32, 16)


def _data(context, builder, array_type, array):
    return cgutils.create_struct_proxy(array_type)(context, builder, value=array).data


def _load(builder, base, offset, vector_type):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), vector_type.as_pointer()), align=1)


def _make(nibbles: bool, has_min: bool):
    @intrinsic
    def lanes_gemv(typingctx, w, w_off, scale, bias, sc_off, x, x_off, xd, xs, xn4, b_off, n_blk, offset, out):
        """w: tile bytes from w_off; scale/bias (flat) from sc_off, R per block; x (int8) from
        x_off; xd/xs per block and xn4 per lane from b_off; out (9 * R,) float32."""
        sig = types.void(w, types.intp, scale, bias, types.intp, x, types.intp, xd, xs, xn4, types.intp,
                         types.intp, types.int32, out)

        def codegen(context, builder, signature, args):
            (w_a, w_o, sc_a, bi_a, sc_o, x_a, x_o, xd_a, xs_a, xn_a, b_o, n_blk, offset, out_a) = args
            a = signature.args
            wp = builder.bitcast(builder.gep(_data(context, builder, a[0], w_a), [w_o]), ir.IntType(8).as_pointer())
            scp, bip = _data(context, builder, a[2], sc_a), _data(context, builder, a[3], bi_a)
            xp = builder.bitcast(builder.gep(_data(context, builder, a[5], x_a), [x_o]), ir.IntType(8).as_pointer())
            xdp, xsp, xnp = (_data(context, builder, a[i], v) for i, v in ((7, xd_a), (8, xs_a), (9, xn_a)))
            outp = _data(context, builder, a[13], out_a)
            intp = w_o.type
            c = lambda v: ir.Constant(intp, v)  # noqa: E731
            dpbusd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_I32X16, [_I32X16, _I8X64, _I8X64]), "llvm.x86.avx512.vpdpbusd.512")
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3),
                                                 "llvm.fma.v16f32")
            zero_f = ir.Constant(_F32X16, None)
            n_acc = 16 + (2 if has_min else 0)  # [lane][half], then summs halves

            b, accs, finish = open_loop(builder, n_blk, [zero_f] * n_acc)
            block_bytes = 16 * R if nibbles else 32 * R
            wb = builder.mul(b, c(block_bytes))
            low, four = ir.Constant(_I8X64, [15] * 64), ir.Constant(_I8X64, [4] * 64)

            def codes(lane, h):  # the 16 rows' codes of lane l, half h (loaded where used)
                if not nibbles:
                    return _load(builder, wp, builder.add(wb, c(128 * lane + 64 * h)), _I8X64)
                # 128 bytes per pair of lanes: low nibbles lane 2p, high nibbles lane 2p + 1
                v = _load(builder, wp, builder.add(wb, c(128 * (lane // 2) + 64 * h)), _I8X64)
                return builder.lshr(v, four) if lane % 2 else builder.and_(v, low)

            sb = builder.add(sc_o, builder.mul(b, c(R)))  # this block's R scales
            xb = builder.add(b_o, b)
            xdv = _splat(builder, builder.load(builder.gep(xdp, [xb])), _F32X16)
            dd = [builder.fmul(_load(builder, scp, builder.add(sb, c(16 * h)), _F32X16), xdv) for h in range(2)]
            news = []
            for lane in range(8):
                x4 = builder.load(builder.bitcast(builder.gep(xp, [builder.add(builder.mul(b, c(32)), c(4 * lane))]),
                                                  _I32.as_pointer()), align=1)
                xv = builder.bitcast(_splat(builder, x4, _I32X16), _I8X64)
                n4 = builder.load(builder.gep(xnp, [builder.add(builder.mul(xb, c(8)), c(lane))]))
                # the dot product starts from -offset * sum(x): lane - shift in one exact step
                start = _splat(builder, builder.neg(builder.mul(offset, n4)), _I32X16)
                for h in range(2):
                    f = builder.sitofp(builder.call(dpbusd, [start, codes(lane, h), xv]), _F32X16)
                    news.append(builder.call(fma, [dd[h], f, accs[2 * lane + h]]))
            if has_min:
                xsv = _splat(builder, builder.load(builder.gep(xsp, [xb])), _F32X16)
                for h in range(2):
                    bias_v = _load(builder, bip, builder.add(sb, c(16 * h)), _F32X16)
                    news.append(builder.call(fma, [bias_v, xsv, accs[16 + h]]))
            results = finish(news)
            for k, res in enumerate(results):
                ptr = builder.bitcast(builder.gep(outp, [ir.Constant(ir.IntType(64), 16 * k)]), _F32X16.as_pointer())
                builder.store(res, ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lanes_gemv


gemv_bytes, gemv_bytes_min = _make(False, False), _make(False, True)
gemv_nibbles, gemv_nibbles_min = _make(True, False), _make(True, True)
