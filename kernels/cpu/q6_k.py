"""Q6_K products for whole weight tiles, written as LLVM loops over super-blocks so that the
integer and float accumulators stay in registers (see matmul.qmatmul_q6_k for the arithmetic,
which these repeat step for step). Tile layout as matmul.py's byte tiles: codes q + 96 (the
6-bit value plus 96), 128 bytes per 4 columns of the tile's R = 32 rows; sc (NT, K/16, R)
int8 scales; sb (NT, 2 K/256, R) each super-block's d at even entries.

    vec_dot_q6_k   one token, ggml_vec_dot_q6_K_q8_K's 8 lanes of 4 columns; out (8, R) lane
                   accumulators, summed by the caller with hsum_float_8
    tiled_q6_k     n_tok tokens, ggml's tiled kernel: one integer sum a super-block,
                   acc = fma(float(S) * d_w, d_x, acc); out (n_tok, R)"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import ask_ahead, open_loop
from .vnni import R, dpbusd

_I8X64 = ir.VectorType(ir.IntType(8), 64)
_I32 = ir.IntType(32)
_I32X16 = ir.VectorType(_I32, 16)
_I8X16 = ir.VectorType(ir.IntType(8), 16)
_F32X16 = ir.VectorType(ir.FloatType(), 16)


class _Emitter:
    """IR helpers bound to one builder: typed loads from array data at element offsets."""

    def __init__(self, context, builder, signature, args, intp):
        self.b, self.intp = builder, intp
        self.ptrs = [cgutils.create_struct_proxy(t)(context, builder, value=a).data
                     if isinstance(t, types.Array) else None for t, a in zip(signature.args, args)]
        self.dpbusd = lambda acc, u8, s8, small=False: dpbusd(builder, acc, u8, s8, small)
        self.fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3),
                                                  "llvm.fma.v16f32")

    def c(self, v):
        return ir.Constant(self.intp, v)

    def at(self, arg, offset):
        return self.b.gep(self.ptrs[arg], [offset])

    def vec(self, arg, offset, vtype):
        return self.b.load(self.b.bitcast(self.at(arg, offset), vtype.as_pointer()), align=1)

    def scalar(self, arg, offset):
        return self.b.load(self.at(arg, offset))

    def splat(self, value, vtype):
        v = self.b.insert_element(ir.Constant(vtype, None), value, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(vtype, None), ir.Constant(_I32X16, [0] * 16))

    def x4(self, arg, offset):
        """4 activation bytes at offset, in all 16 lanes."""
        p = self.b.bitcast(self.at(arg, offset), _I32.as_pointer())
        return self.b.bitcast(self.splat(self.b.load(p, align=1), _I32X16), _I8X64)

    def int_scales(self, arg, offset):
        """16 int8 sub-block scales at offset, widened to int32."""
        return self.b.sext(self.vec(arg, offset, _I8X16), _I32X16)

    def loop(self, n, init):
        """simd.open_loop: (i, carried, finish) of a loop over [0, n)."""
        return open_loop(self.b, n, init)

    def store(self, arg, offset, value):
        self.b.store(value, self.b.bitcast(self.at(arg, offset), value.type.as_pointer()), align=4)

    def ask_ahead(self, args, first, n_steps, step, max_lines):
        """simd.ask_ahead for the lines the caller passed as (array, byte, n_lines) from args[first]."""
        ap = self.b.bitcast(self.at(first, args[first + 1]), ir.IntType(8).as_pointer())
        ask_ahead(self.b, (ap, args[first + 2]), self.c, n_steps, step, max_lines)


# argument indices of both intrinsics; _AHEAD: (array, byte, n_lines), the cache lines that the
# walk asks for on its way (simd.ask_ahead; which ones: matmul._walk_ahead)
_W, _W_OFF, _SC, _SB, _NT, _X, _X_OFF, _XD, _XN4, _XN16, _T, _N_SB, _AHEAD, _OUT = (*range(13), 15)


def _signature(w, sc, sb, x, xd, xn4, xn16, ahead, out):
    return types.void(w, types.intp, sc, sb, types.intp, x, types.intp, xd, xn4, xn16, types.intp, types.intp,
                      ahead, types.intp, types.intp, out)


@intrinsic
def vec_dot_q6_k(typingctx, w, w_off, sc, sb, nt, x, x_off, xd, xn4, xn16, t, n_sb, ahead, ahead_at, ahead_lines,
                 out):
    """Tile nt (codes from w_off) times token t (codes from x_off), n_sb super-blocks."""
    sig = _signature(w, sc, sb, x, xd, xn4, xn16, ahead, out)

    def codegen(context, builder, signature, args):
        e = _Emitter(context, builder, signature, args, args[_W_OFF].type)
        b, c = builder, e.c
        n_half = b.mul(args[_N_SB], c(16))     # sc entries per row of the tile
        n_blk = b.mul(args[_N_SB], c(8))
        zero_i, zero_f = ir.Constant(_I32X16, None), ir.Constant(_F32X16, None)
        s, accs, finish = e.loop(args[_N_SB], [zero_f] * 16)  # acc[lane][half]
        e.ask_ahead(args, _AHEAD, args[_N_SB], s, 128)
        isum = [zero_i] * 16
        for j in range(8):
            blk = b.add(b.mul(s, c(8)), c(j))
            wb = b.add(args[_W_OFF], b.mul(blk, c(32 * R)))
            xb = b.add(args[_X_OFF], b.mul(blk, c(32)))
            for lane in range(8):
                xv = e.x4(_X, b.add(xb, c(4 * lane)))
                n4 = e.scalar(_XN4, b.add(b.mul(args[_T], b.mul(n_blk, c(8))), b.add(b.mul(blk, c(8)), c(lane))))
                start = e.splat(b.mul(ir.Constant(_I32, -96), n4), _I32X16)  # codes q + 96 -> q
                g = b.add(b.mul(args[_NT], n_half), b.add(b.mul(blk, c(2)), c(lane // 4)))
                for h in range(2):
                    code = e.vec(_W, b.add(wb, c(128 * lane + 64 * h)), _I8X64)
                    dot = e.dpbusd(start, code, xv)
                    scale = e.int_scales(_SC, b.add(b.mul(g, c(R)), c(16 * h)))
                    isum[2 * lane + h] = b.add(isum[2 * lane + h], b.mul(scale, dot))
        da = e.splat(e.scalar(_XD, b.add(b.mul(args[_T], n_blk), b.mul(s, c(8)))), _F32X16)
        new = []
        for lane in range(8):
            g = b.add(b.mul(s, c(16)), c(2 * lane))  # the lane's offset term: 16-groups g, g + 1
            n0 = e.splat(e.scalar(_XN16, b.add(b.mul(args[_T], n_half), g)), _I32X16)
            n1 = e.splat(e.scalar(_XN16, b.add(b.add(b.mul(args[_T], n_half), g), c(1))), _I32X16)
            for h in range(2):
                row0 = b.add(b.mul(b.add(b.mul(args[_NT], n_half), g), c(R)), c(16 * h))
                off = b.add(b.mul(e.int_scales(_SC, row0), n0), b.mul(e.int_scales(_SC, b.add(row0, c(R))), n1))
                total = b.sub(isum[2 * lane + h], b.shl(off, ir.Constant(_I32X16, [5] * 16)))
                dw = e.vec(_SB, b.add(b.mul(b.add(b.mul(args[_NT], b.mul(args[_N_SB], c(2))), b.mul(s, c(2))), c(R)),
                                      c(16 * h)), _F32X16)
                new.append(b.call(e.fma, [b.fmul(da, dw), b.sitofp(total, _F32X16), accs[2 * lane + h]]))
        for k, v in enumerate(finish(new)):
            e.store(_OUT, c(16 * k), v)
        return context.get_dummy_value()

    return sig, codegen


def _make_tiled(n_tok: int):
    @intrinsic
    def tiled_q6_k(typingctx, w, w_off, sc, sb, nt, x, x_off, xd, xn4, xn16, t, n_sb, ahead, ahead_at, ahead_lines,
                   out):
        """Tile nt times tokens t..t+n_tok-1 (token k's codes from x_off + k * K)."""
        sig = _signature(w, sc, sb, x, xd, xn4, xn16, ahead, out)

        def codegen(context, builder, signature, args):
            e = _Emitter(context, builder, signature, args, args[_W_OFF].type)
            b, c = builder, e.c
            n_half = b.mul(args[_N_SB], c(16))
            K = b.mul(args[_N_SB], c(256))
            zero_i, zero_f = ir.Constant(_I32X16, None), ir.Constant(_F32X16, None)
            s, accs, finish = e.loop(args[_N_SB], [zero_f] * (2 * n_tok))  # acc[tok][half]
            e.ask_ahead(args, _AHEAD, args[_N_SB], s, 64)
            isum = [zero_i] * (2 * n_tok)
            for grp in range(16):  # 16-column groups: 4 steps of 4 columns
                g = b.add(b.mul(s, c(16)), c(grp))
                scales = [e.int_scales(_SC, b.add(b.mul(b.add(b.mul(args[_NT], n_half), g), c(R)), c(16 * h)))
                          for h in range(2)]
                dots = []
                for k in range(n_tok):  # each dot starts from -128 * sum(x): codes q + 96 -> q - 32
                    n16 = e.scalar(_XN16, b.add(b.mul(b.add(args[_T], c(k)), n_half), g))
                    dots += [e.splat(b.mul(ir.Constant(_I32, -128), n16), _I32X16)] * 2
                for step in range(4):
                    col = b.add(b.mul(g, c(16)), c(4 * step))
                    codes = [e.vec(_W, b.add(args[_W_OFF], b.add(b.mul(col, c(R)), c(64 * h))), _I8X64)
                             for h in range(2)]
                    for k in range(n_tok):
                        xv = e.x4(_X, b.add(b.add(args[_X_OFF], b.mul(K, c(k))), col))
                        for h in range(2):
                            dots[2 * k + h] = e.dpbusd(dots[2 * k + h], codes[h], xv)
                for k in range(n_tok):
                    for h in range(2):
                        isum[2 * k + h] = b.add(isum[2 * k + h], b.mul(scales[h], dots[2 * k + h]))
            new = []
            for k in range(n_tok):
                da = e.splat(e.scalar(_XD, b.add(b.mul(b.add(args[_T], c(k)), b.mul(args[_N_SB], c(8))),
                                                 b.mul(s, c(8)))), _F32X16)
                for h in range(2):
                    dw = e.vec(_SB, b.add(b.mul(b.add(b.mul(args[_NT], b.mul(args[_N_SB], c(2))), b.mul(s, c(2))),
                                                c(R)), c(16 * h)), _F32X16)
                    scaled = b.fmul(b.sitofp(isum[2 * k + h], _F32X16), dw)
                    new.append(b.call(e.fma, [scaled, da, accs[2 * k + h]]))
            for k, v in enumerate(finish(new)):
                e.store(_OUT, c(16 * k), v)
            return context.get_dummy_value()

        return sig, codegen

    return tiled_q6_k


tiled_q6_k_1, tiled_q6_k_4 = _make_tiled(1), _make_tiled(4)
