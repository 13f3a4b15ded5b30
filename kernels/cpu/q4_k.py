"""Q4_K's products for one token against a whole weight tile as one LLVM loop over super-blocks,
accumulators in registers, with the arithmetic of the repacked q4_K_8x8 gemv (gemv_q4_k) or of
its gemm (gemm_row_q4_k: the same sums, an fma per pair of sub-blocks; see
matmul.qmatmul_q4_k). Tile layout: matmul.py's 4-bit tiles (codes 0..15, two a byte: 128 bytes
hold columns 8p..8p+3 in the low nibbles and 8p+4..8p+7 in the high ones, for the R = 32 rows);
sc, mins (NT, K/32, R) int8 (the 6-bit integers); sb (NT, 2 K/256, R) each super-block's d and
dmin. Per super-block (gemv): I = sum_j sc_j * dot_j and M = sum_j mins_j * sum(x_j) exactly,
acc = fma(float(I), d * d_x, acc), acc_min = fma(float(M), dmin * d_x, acc_min);
out (R,) = acc - acc_min."""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .q6_k import _Emitter, _I8X64, _I32, _I32X16, _F32X16
from .vnni import R

_W, _W_OFF, _SC, _MINS, _SB, _NT, _X, _X_OFF, _XD, _XN32, _T, _N_SB, _AHEAD, _OUT = (*range(13), 15)


def _make_q4_k_rows(fma_every):
    """The intrinsic for one token against a tile, its float fmas after every `fma_every`
    sub-blocks: 8 as the gemv kernel (one per super-block), 2 as the gemm kernel (one per pair of
    sub-blocks, which the batch rows in groups of 4 take)."""

    @intrinsic
    def q4_k_rows(typingctx, w, w_off, sc, mins, sb, nt, x, x_off, xd, xn32, t, n_sb, ahead, ahead_at, ahead_lines,
                  out):
        """Tile nt (codes from w_off) times token t (codes from x_off), n_sb super-blocks; on
        the way it asks for ahead_lines cache lines of `ahead` from byte ahead_at (into L2)."""
        sig = types.void(w, types.intp, sc, mins, sb, types.intp, x, types.intp, xd, xn32, types.intp,
                         types.intp, ahead, types.intp, types.intp, out)

        def codegen(context, builder, signature, args):
            e = _Emitter(context, builder, signature, args, args[_W_OFF].type)
            b, c = builder, e.c
            n_sub = b.mul(args[_N_SB], c(8))  # 32-column sub-blocks per row
            zero_i, zero_f = ir.Constant(_I32X16, None), ir.Constant(_F32X16, None)
            low, four = ir.Constant(_I8X64, [15] * 64), ir.Constant(_I8X64, [4] * 64)
            s, accs, finish = e.loop(args[_N_SB], [zero_f] * 4)  # acc[half], acc_min[half]
            e.ask_ahead(args, _AHEAD, args[_N_SB], s, 64)
            # the activations' scale is one per super-block (Q8_K)
            da = e.splat(e.scalar(_XD, b.add(b.mul(args[_T], n_sub), b.mul(s, c(8)))), _F32X16)
            sb_row = b.mul(b.add(b.mul(args[_NT], b.mul(args[_N_SB], c(2))), b.mul(s, c(2))), c(R))
            d = [e.vec(_SB, b.add(sb_row, c(16 * h)), _F32X16) for h in range(2)]
            dmin = [e.vec(_SB, b.add(b.add(sb_row, c(R)), c(16 * h)), _F32X16) for h in range(2)]
            ipart, mpart = [zero_i] * 2, [zero_i] * 2
            for j in range(8):
                sub = b.add(b.mul(s, c(8)), c(j))
                wb = b.add(args[_W_OFF], b.mul(sub, c(16 * R)))
                xb = b.add(args[_X_OFF], b.mul(sub, c(32)))
                dots = [zero_i] * 2
                for p in range(4):
                    xa, xh = e.x4(_X, b.add(xb, c(8 * p))), e.x4(_X, b.add(xb, c(8 * p + 4)))
                    for h in range(2):
                        v = e.vec(_W, b.add(wb, c(128 * p + 64 * h)), _I8X64)
                        dots[h] = e.dpbusd(e.dpbusd(dots[h], b.and_(v, low), xa, True), b.lshr(v, four), xh, True)
                row = b.mul(b.add(b.mul(args[_NT], n_sub), sub), c(R))
                xsum = e.splat(e.scalar(_XN32, b.add(b.mul(args[_T], n_sub), sub)), _I32X16)
                for h in range(2):
                    ipart[h] = b.add(ipart[h], b.mul(e.int_scales(_SC, b.add(row, c(16 * h))), dots[h]))
                    mpart[h] = b.add(mpart[h], b.mul(e.int_scales(_MINS, b.add(row, c(16 * h))), xsum))
                if (j + 1) % fma_every == 0:
                    accs = ([b.call(e.fma, [b.sitofp(ipart[h], _F32X16), b.fmul(d[h], da), accs[h]])
                             for h in range(2)]
                            + [b.call(e.fma, [b.sitofp(mpart[h], _F32X16), b.fmul(dmin[h], da), accs[2 + h]])
                               for h in range(2)])
                    ipart, mpart = [zero_i] * 2, [zero_i] * 2
            final = finish(accs)
            for h in range(2):
                e.store(_OUT, c(16 * h), b.fsub(final[h], final[2 + h]))
            return context.get_dummy_value()

        return sig, codegen

    return q4_k_rows


gemv_q4_k = _make_q4_k_rows(8)
gemm_row_q4_k = _make_q4_k_rows(2)
