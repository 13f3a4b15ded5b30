"""One head's walk over its cells with an F16 cache (ggml's one-chunk attention), as one LLVM
loop: per cell the f16 dot of K and the query, glibc's expf written out in line, the V sum kept
in float16. Written as Numba code, each cell paid a call to libm's expf (with every vector
register saved around it) and a generic loop body: 27.5 ns a head and cell here, against
about 10 written this way (docs/performance.md).

glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, the FMA build x86-64 selects) computes in double:
x = (k + r) ln2 / 32 with k an integer, 2^(k/32) from a 32-entry table and 2^(r/32) by a cubic.
`expf_exact` reproduces it bit for bit for every x <= 0 and every NaN (an exhaustive check, and
tests/test_attention.py samples it against math.exp): attention's exponents are never positive.
"""
import struct
from decimal import Decimal, localcontext

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ops import GGML_AVX512
from .simd import _F32X16, _I32, _fma, _halve, _load_f32x16, _ptr, _splat, open_loop

_F64 = ir.DoubleType()
_I64 = ir.IntType(64)
_F32 = ir.FloatType()

_INV_LN2_32 = float.fromhex("0x1.71547652b82fep+0") * 32  # 32 / ln 2
_ROUND_SHIFT = float.fromhex("0x1.8p+52")                    # adding it rounds to an integer
_POLY = (float.fromhex("0x1.c6af84b912394p-5") / 32 ** 3,    # 2^(r/32) ~ ((C0 r + C1) r^2 + C2 r + 1)
         float.fromhex("0x1.ebfce50fac4f3p-3") / 32 ** 2,
         float.fromhex("0x1.62e42ff0c52d6p-1") / 32)
_UNDERFLOW = float.fromhex("-0x1.9fe368p6")  # below this glibc returns 0 (log of 2^-150)


def _exp2_table():
    """2^(i/32) as doubles, each with i << 47 taken from its bits (glibc's __exp2f_data.tab)."""
    with localcontext() as ctx:
        ctx.prec = 60
        powers = [float(Decimal(2) ** (Decimal(i) / 32)) for i in range(32)]
    return [(struct.unpack("<Q", struct.pack("<d", p))[0] - (i << 47)) % 2 ** 64 for i, p in enumerate(powers)]


_EXP2_TABLE = _exp2_table()


def _fma64(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F64, [_F64] * 3), "llvm.fma.f64")
    return builder.call(fn, [a, b, c])


def expf_ir(builder, x):
    """glibc's expf of the float x (x <= 0 or NaN), in line."""
    table = builder.module.globals.get("minillm_exp2f_table")
    if table is None:
        table = cgutils.global_constant(builder.module, "minillm_exp2f_table",
                                        ir.Constant(ir.ArrayType(_I64, 32), _EXP2_TABLE))
    d = lambda v: ir.Constant(_F64, v)  # noqa: E731
    xd = builder.fpext(x, _F64)
    kd = _fma64(builder, d(_INV_LN2_32), xd, d(_ROUND_SHIFT))  # k + shift, k = round(x 32 / ln 2)
    ki = builder.bitcast(kd, _I64)
    kd = builder.fsub(kd, d(_ROUND_SHIFT))
    r = _fma64(builder, d(_INV_LN2_32), xd, builder.fneg(kd))
    entry = builder.load(builder.gep(table, [ir.Constant(_I32, 0), builder.and_(ki, ir.Constant(_I64, 31))]))
    s = builder.bitcast(builder.add(entry, builder.shl(ki, ir.Constant(_I64, 47))), _F64)  # 2^(k/32)
    z = _fma64(builder, d(_POLY[0]), r, d(_POLY[1]))
    y = _fma64(builder, d(_POLY[2]), r, d(1.0))
    y = _fma64(builder, z, builder.fmul(r, r), y)
    result = builder.fptrunc(builder.fmul(y, s), _F32)
    return builder.select(builder.fcmp_ordered("<", x, ir.Constant(_F32, _UNDERFLOW)), ir.Constant(_F32, 0.0), result)


@intrinsic
def expf_exact(typingctx, x):
    """glibc's expf (libm's, as math.exp of a float32 calls it) for x <= 0 or NaN."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return expf_ir(builder, args[0])

    return sig, codegen


# ggml's f16 dot sums 16-lane registers in steps of 64 where it is built with AVX-512, 8-lane
# ones in steps of 32 with AVX2 (attention.F16_DOT_STEP); here both as 16-lane vectors
_DOT_STEP = 64 if GGML_AVX512 else 32


def _dot_reduce(builder, accs):
    """ggml_vec_dot_f16's sum of its accumulators (attention.F16_DOT_STEP): AVX-512, 4 x 16 lanes:
    (0 + 2) + (1 + 3), then _mm512_reduce_add_ps; AVX2, 4 x 8 lanes held as two 16-lane vectors:
    (0 + 2) + (1 + 3), the 128-bit halves added, then (0 + 1) + (2 + 3)."""
    lane = lambda v, j: builder.extract_element(v, ir.Constant(_I32, j))  # noqa: E731
    if len(accs) == 4:
        s4 = _halve(builder, _halve(builder, builder.fadd(builder.fadd(accs[0], accs[2]),
                                                          builder.fadd(accs[1], accs[3])), 8), 4)
        return builder.fadd(builder.fadd(lane(s4, 0), lane(s4, 2)), builder.fadd(lane(s4, 1), lane(s4, 3)))
    s4 = _halve(builder, _halve(builder, builder.fadd(accs[0], accs[1]), 8), 4)
    return builder.fadd(builder.fadd(lane(s4, 0), lane(s4, 1)), builder.fadd(lane(s4, 2), lane(s4, 3)))


def _f16_round(builder, x):
    return builder.fpext(builder.fptrunc(x, ir.VectorType(ir.HalfType(), 16)), _F32X16)


WALK_MAX_VALUES = 2048  # G * D of one walk: its queries and sums live in aligned stack buffers
_BLOCK = 32             # cells a walk takes a phase at a time


def _stack_floats(builder, count):
    """A float* to `count` (a multiple of 16) floats on the stack, 64-byte aligned: 32-byte
    loads and stores that cross cache lines cost twice as much, and numpy's buffers are only
    16-byte aligned."""
    with builder.goto_entry_block():
        buf = builder.alloca(_F32X16, size=ir.Constant(ir.IntType(64), count // 16))
        buf.align = 64
    return builder.bitcast(buf, _F32.as_pointer())


@intrinsic
def heads_walk_f16(typingctx, k, v, row_at, n, q, scale, acc, m, s, D):
    """ggml's one-chunk attention of G heads that share a KV head, over n cells: K and V of cell
    i start at element row_at[i] of the flat f16 caches k and v (uint16); q (G * D,) the heads'
    f16-rounded queries, D (the head dimension) a multiple of 32, G * D <= WALK_MAX_VALUES. Per
    cell and head, as ggml_compute_forward_flash_attn_ext_f16_one_chunk: score = dot(K, q) *
    scale; if score > M: ms = expf(M - score), M = score, the sum rescaled (acc = f16(acc * ms))
    and vs = 1; else vs = expf(score - M); then acc = f16(fma(V, vs, acc)) and S = S * ms + vs.
    Results: acc (G * D,) the f16-valued, unnormalized V sums, m and s (G,) each head's M and S.

    Done that way a cell at a time, each cell waits for the last (the dot, then expf, then the
    sum), so the cells go in blocks of _BLOCK, in three passes: every score of the block; each
    head's M, S and (ms, vs) per cell (expf of cells that no longer wait on one another); the V
    sums. Each head's operations and their order are ggml's; a cell's K and V are widened to
    float32 once for the G heads."""
    sig = types.void(k, v, row_at, types.intp, q, types.float32, acc, m, s, types.intp)

    def codegen(context, builder, signature, args):
        k_a, v_a, at_a, n, q_a, scale, acc_a, m_a, s_a, dim = args
        k_t, v_t, at_t, _, q_t, _, acc_t, m_t, s_t, _ = signature.args
        c = lambda x: ir.Constant(n.type, x)  # noqa: E731
        f32 = lambda x: ir.Constant(_F32, x)  # noqa: E731
        data = lambda t, a: cgutils.create_struct_proxy(t)(context, builder, value=a).data  # noqa: E731
        m_data, s_data, at_data = data(m_t, m_a), data(s_t, s_a), data(at_t, at_a)
        n_heads = builder.sdiv(cgutils.create_struct_proxy(q_t)(context, builder, value=q_a).nitems, dim)
        n_vec = builder.sdiv(dim, c(16))
        q_buf, sums, row = (_stack_floats(builder, WALK_MAX_VALUES), _stack_floats(builder, WALK_MAX_VALUES),
                            _stack_floats(builder, WALK_MAX_VALUES))
        # per (head, cell of the block): the score, then the cell's (ms, vs)
        scores, ms_buf, vs_buf = (_stack_floats(builder, WALK_MAX_VALUES // 32 * _BLOCK) for _ in range(3))
        vec = lambda buf, at: builder.bitcast(builder.gep(buf, [at]), _F32X16.as_pointer())  # noqa: E731
        mul, add = builder.mul, builder.add

        def loop(count, body):  # for j in range(count): body(j)
            j, _, finish = open_loop(builder, count, [])
            body(j)
            finish([])

        def start(j):  # the queries into their buffer, the sums zero
            builder.store(_load_f32x16(context, builder, q_t, q_a, mul(j, c(16))), vec(q_buf, mul(j, c(16))), align=64)
            builder.store(ir.Constant(_F32X16, None), vec(sums, mul(j, c(16))), align=64)

        loop(mul(n_heads, n_vec), start)
        loop(n_heads, lambda h: (builder.store(f32(float("-inf")), builder.gep(m_data, [h])),
                                 builder.store(f32(0.0), builder.gep(s_data, [h]))))

        def widen(cache_t, cache_a, cell):  # the cell's K or V row as float32 into `row`
            at = builder.load(builder.gep(at_data, [cell]))
            loop(n_vec, lambda j: builder.store(_load_f32x16(context, builder, cache_t, cache_a, add(at, mul(j, c(16)))),
                                                vec(row, mul(j, c(16))), align=64))

        blk, _, finish_blocks = open_loop(builder, builder.sdiv(add(n, c(_BLOCK - 1)), c(_BLOCK)), [])
        first = mul(blk, c(_BLOCK))
        size = builder.select(builder.icmp_signed("<", builder.sub(n, first), c(_BLOCK)), builder.sub(n, first), c(_BLOCK))

        def prefetch(cell):  # the K and V rows of a cell of the next block, toward L1 (64-byte lines)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [
                ir.IntType(8).as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
            with builder.if_then(builder.icmp_signed("<", cell, n)):
                at = builder.load(builder.gep(at_data, [cell]))
                for cache_t, cache_a in ((k_t, k_a), (v_t, v_a)):
                    base = data(cache_t, cache_a)
                    loop(builder.sdiv(dim, c(32)), lambda line: builder.call(fn, [
                        builder.bitcast(builder.gep(base, [add(at, mul(line, c(32)))]), ir.IntType(8).as_pointer()),
                        ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)]))

        def score_cell(i):
            prefetch(add(add(first, i), c(_BLOCK)))
            widen(k_t, k_a, add(first, i))
            loop(n_heads, lambda h: builder.store(builder.fmul(_dot(builder, row, q_buf, mul(h, dim), dim), scale),
                                                  builder.gep(scores, [add(mul(h, c(_BLOCK)), i)])))

        loop(size, score_cell)

        def softmax_head(h):  # ggml's M and S, and each cell's (ms, vs)
            i, (m_old, s_old), finish = open_loop(builder, size, [builder.load(builder.gep(m_data, [h])),
                                                                  builder.load(builder.gep(s_data, [h]))])
            at = add(mul(h, c(_BLOCK)), i)
            score = builder.load(builder.gep(scores, [at]))
            grows = builder.fcmp_ordered(">", score, m_old)
            e = expf_ir(builder, builder.select(grows, builder.fsub(m_old, score), builder.fsub(score, m_old)))
            ms, vs = builder.select(grows, e, f32(1.0)), builder.select(grows, f32(1.0), e)
            builder.store(ms, builder.gep(ms_buf, [at]))
            builder.store(vs, builder.gep(vs_buf, [at]))
            fma32 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
            m_new, s_new = finish([builder.select(grows, score, m_old), builder.call(fma32, [s_old, ms, vs])])
            builder.store(m_new, builder.gep(m_data, [h]))
            builder.store(s_new, builder.gep(s_data, [h]))

        loop(n_heads, softmax_head)

        def sum_cell(i):
            widen(v_t, v_a, add(first, i))

            def head(h):
                at = add(mul(h, c(_BLOCK)), i)
                ms, vs = builder.load(builder.gep(ms_buf, [at])), builder.load(builder.gep(vs_buf, [at]))
                sum_at = lambda j: vec(sums, add(mul(h, dim), mul(j, c(16))))  # noqa: E731
                # ggml_vec_scale_f16 when the maximum grew (f16(acc * 1) is acc: skipped)
                with builder.if_then(builder.fcmp_unordered("!=", ms, f32(1.0)), likely=False):
                    msv = _splat(builder, ms, _F32X16)
                    loop(n_vec, lambda j: builder.store(
                        _f16_round(builder, builder.fmul(builder.load(sum_at(j), align=64), msv)), sum_at(j), align=64))
                vsv = _splat(builder, vs, _F32X16)
                loop(n_vec, lambda j: builder.store(  # ggml_vec_mad_f16
                    _f16_round(builder, _fma(builder, builder.load(vec(row, mul(j, c(16))), align=64), vsv,
                                             builder.load(sum_at(j), align=64))), sum_at(j), align=64))

            loop(n_heads, head)

        loop(size, sum_cell)
        finish_blocks([])
        loop(mul(n_heads, n_vec), lambda j: builder.store(
            builder.load(vec(sums, mul(j, c(16))), align=64),
            _ptr(context, builder, acc_t, acc_a, mul(j, c(16)), _F32X16), align=4))
        return context.get_dummy_value()

    return sig, codegen


def _dot(builder, k, q, q_at, dim):
    """ggml_vec_dot_f16 of the dim floats at k (a widened K row) and at q + q_at: the SIMD steps
    in float32 (_dot_reduce), the rest (dim % _DOT_STEP) added in double, in order."""
    c = lambda x: ir.Constant(dim.type, x)  # noqa: E731
    vec = lambda buf, at: builder.load(builder.bitcast(builder.gep(buf, [at]), _F32X16.as_pointer()), align=64)  # noqa: E731
    n_steps = builder.sdiv(dim, c(_DOT_STEP))
    step, accs, finish = open_loop(builder, n_steps, [ir.Constant(_F32X16, None)] * (_DOT_STEP // 16))
    base = builder.mul(step, c(_DOT_STEP))
    new = [_fma(builder, vec(k, builder.add(base, c(16 * a))), vec(q, builder.add(q_at, builder.add(base, c(16 * a)))),
                acc)
           for a, acc in enumerate(accs)]
    total = builder.fpext(_dot_reduce(builder, finish(new)), _F64)
    done = builder.mul(n_steps, c(_DOT_STEP))
    t, (part,), finish = open_loop(builder, builder.sub(dim, done), [total])
    d = builder.add(done, t)
    prod = builder.fmul(builder.load(builder.gep(k, [d])), builder.load(builder.gep(q, [builder.add(q_at, d)])))
    (total,) = finish([builder.fadd(part, builder.fpext(prod, _F64))])
    return builder.fptrunc(total, _F32)
