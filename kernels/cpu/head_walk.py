"""ggml's one-chunk attention of a group of heads over their cells, as one LLVM loop: the F16
cache's (heads_walk_f16) and the q8_0/q4_0 cache's (heads_walk_q). Written cell by cell in Numba
code, each cell called libm's expf (with every vector register saved around it) and waited on
the last; here glibc's expf is in line and the cells go in blocks of 32, in three passes (all
scores; each head's softmax; the V sums). SmolLM2's heads: 27.5 -> 13-15 ns a cell and head on
one thread (docs/performance.md).

glibc's expf (sysdeps/ieee754/flt-32/e_expf.c, the FMA build x86-64 selects) computes in double:
x = (k + r) ln2 / 32 with k an integer, 2^(k/32) from a 32-entry table and 2^(r/32) by a cubic.
`expf_exact` reproduces it bit for bit for every x <= 0 and every NaN (an exhaustive check, and
tests/test_attention.py samples it against math.exp): attention's exponents are never positive.
"""
import struct
from decimal import Decimal, localcontext

import numba as nb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ops import GGML_AVX512
from .simd import (_F32X8, _F32X16, _I32, _block_codes, _f16_round, _fma, _halve, _load_f32x16, _ptr, _splat, _splat_n,
                   open_loop, prefetch_line)

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


def expf_ir(builder, x):
    """glibc's expf of x (x <= 0 or NaN), in line: x a float, or a vector of floats (each lane
    the same steps in double)."""
    table = builder.module.globals.get("minillm_exp2f_table")
    if table is None:
        table = cgutils.global_constant(builder.module, "minillm_exp2f_table",
                                        ir.Constant(ir.ArrayType(_I64, 32), _EXP2_TABLE))
    n = x.type.count if isinstance(x.type, ir.VectorType) else 0
    f64, i64 = (ir.VectorType(_F64, n), ir.VectorType(_I64, n)) if n else (_F64, _I64)
    d = lambda v: ir.Constant(f64, [v] * n if n else v)  # noqa: E731
    i = lambda v: ir.Constant(i64, [v] * n if n else v)  # noqa: E731
    fma_fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f64, [f64] * 3),
                                            f"llvm.fma.v{n}f64" if n else "llvm.fma.f64")
    fma64 = lambda a, b, c: builder.call(fma_fn, [a, b, c])  # noqa: E731
    xd = builder.fpext(x, f64)
    kd = fma64(d(_INV_LN2_32), xd, d(_ROUND_SHIFT))  # k + shift, k = round(x 32 / ln 2)
    ki = builder.bitcast(kd, i64)
    kd = builder.fsub(kd, d(_ROUND_SHIFT))
    r = fma64(d(_INV_LN2_32), xd, builder.fneg(kd))
    index = builder.and_(ki, i(31))

    def entry_at(j):  # the table's entry for lane j (or the scalar)
        at = builder.extract_element(index, ir.Constant(_I32, j)) if n else index
        return builder.load(builder.gep(table, [ir.Constant(_I32, 0), at]))

    if n == 8 and GGML_AVX512:
        entry = _table_entries_8(builder, index)
    elif n:
        entry = ir.Constant(i64, None)
        for j in range(n):
            entry = builder.insert_element(entry, entry_at(j), ir.Constant(_I32, j))
    else:
        entry = entry_at(0)
    s = builder.bitcast(builder.add(entry, builder.shl(ki, i(47))), f64)  # 2^(k/32)
    z = fma64(d(_POLY[0]), r, d(_POLY[1]))
    y = fma64(d(_POLY[2]), r, d(1.0))
    y = fma64(z, builder.fmul(r, r), y)
    f32 = ir.VectorType(_F32, n) if n else _F32
    result = builder.fptrunc(builder.fmul(y, s), f32)
    zero, underflow = (ir.Constant(f32, [v] * n if n else v) for v in (0.0, _UNDERFLOW))
    return builder.select(builder.fcmp_ordered("<", x, underflow), zero, result)


def _table_entries_8(builder, index):
    """The exp2 table's entries at 8 indices (0..31) in registers: vpermi2q picks from 16
    entries by an index's low 4 bits, so two of them and a select on bit 4. Lane by lane (an
    extract, a load and an insert each) the lookup took most of the softmax's steps."""
    i64x8 = ir.VectorType(_I64, 8)
    permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64x8, [i64x8] * 3),
                                             "llvm.x86.avx512.vpermi2var.q.512")
    quarters = [ir.Constant(i64x8, _EXP2_TABLE[8 * p:8 * p + 8]) for p in range(4)]
    low = builder.call(permute, [quarters[0], index, quarters[1]])
    high = builder.call(permute, [quarters[2], index, quarters[3]])
    sixteen = ir.Constant(i64x8, [16] * 8)
    return builder.select(builder.icmp_unsigned("!=", builder.and_(index, sixteen), ir.Constant(i64x8, None)),
                          high, low)


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


# One walk's buffers are on the stack (aligned, sized for the most it takes): G heads of D values
WALK_MAX_VALUES = 2048  # G * D: the queries and the sums
_MAX_HEADS = 16         # G: scores, ms and vs for each head and cell of a block
_MAX_DIM = 512          # D: the cell's widened K and V rows
_BLOCK = 32             # cells a walk takes a phase at a time


@nb.njit(inline="always", cache=True, nogil=True)
def walk_fits(G, D):
    """Whether a walk takes G heads of size D (else callers take the steps in Numba code)."""
    return G <= _MAX_HEADS and D <= _MAX_DIM and G * D <= WALK_MAX_VALUES and D % 32 == 0


def _stack_floats(builder, count):
    """A float* to `count` (a multiple of 16) floats on the stack, 64-byte aligned: 32-byte
    loads and stores that cross cache lines cost twice as much, and numpy's buffers are only
    16-byte aligned."""
    with builder.goto_entry_block():
        buf = builder.alloca(_F32X16, size=ir.Constant(ir.IntType(64), count // 16))
        buf.align = 64
    return builder.bitcast(buf, _F32.as_pointer())


class _Walk:
    """The blocked walk of G heads over n cells, in LLVM code (heads_walk_f16 says why and
    how); the cache's own steps are callbacks: widen_k(cell) and widen_v(cell) put a cell's K
    and V row into k_row / v_row (float32), score(h) is head h's dot with the widened K row,
    and f16_sums says whether the V sums are kept in float16 (F16 V) or float32."""

    def __init__(self, context, builder, n, n_heads, dim):
        self.context, self.builder, self.n, self.n_heads, self.dim = context, builder, n, n_heads, dim
        self.n_vec = builder.sdiv(dim, self.c(16))
        self.q_buf, self.sums = _stack_floats(builder, WALK_MAX_VALUES), _stack_floats(builder, WALK_MAX_VALUES)
        self.k_row, self.v_row = _stack_floats(builder, _MAX_DIM), _stack_floats(builder, _MAX_DIM)
        # per (cell of the block, head): the score, then the cell's (ms, vs); per head: M and S
        self.scores, self.ms_buf, self.vs_buf = (_stack_floats(builder, _MAX_HEADS * _BLOCK) for _ in range(3))
        self.m_buf, self.s_buf = _stack_floats(builder, _MAX_HEADS), _stack_floats(builder, _MAX_HEADS)

    def c(self, x):
        return ir.Constant(self.n.type, x)

    def vec(self, buf, at):
        return self.builder.bitcast(self.builder.gep(buf, [at]), _F32X16.as_pointer())

    def loop(self, count, body):
        """for j in range(count): body(j)"""
        j, _, finish = open_loop(self.builder, count, [])
        body(j)
        finish([])

    def run(self, m_data, s_data, scale, widen_k, score, widen_v, f16_sums, fetch_k=None, fetch_v=None):
        b, c = self.builder, self.c
        mul, add = b.mul, b.add
        f32 = lambda x: ir.Constant(_F32, x)  # noqa: E731
        self.loop(mul(self.n_heads, self.n_vec),
                  lambda j: b.store(ir.Constant(_F32X16, None), self.vec(self.sums, mul(j, c(16))), align=64))
        # every head slot starts at M = -inf, S = 0, and the scores of the slots past the heads
        # at 0: their lanes of the softmax compute on finite values (and are never stored)
        f32x16 = lambda x: ir.Constant(_F32X16, [x] * 16)  # noqa: E731
        b.store(f32x16(float("-inf")), self.vec(self.m_buf, c(0)), align=64)
        b.store(f32x16(0.0), self.vec(self.s_buf, c(0)), align=64)
        self.loop(c(_BLOCK), lambda i: b.store(f32x16(0.0), self.vec(self.scores, mul(i, c(_MAX_HEADS))), align=64))
        blk, _, finish_blocks = open_loop(b, b.sdiv(add(self.n, c(_BLOCK - 1)), c(_BLOCK)), [])
        first = mul(blk, c(_BLOCK))
        size = b.select(b.icmp_signed("<", b.sub(self.n, first), c(_BLOCK)), b.sub(self.n, first), c(_BLOCK))
        at = lambda h, i: add(mul(i, c(_MAX_HEADS)), h)  # noqa: E731

        def score_cell(i):
            if fetch_k is not None:  # while the block's scores compute: its V rows, the next block's K rows
                fetch_v(add(first, i))
                ahead = add(add(first, i), c(_BLOCK))
                fetch_k(b.select(b.icmp_signed("<", ahead, self.n), ahead, b.sub(self.n, c(1))))
            widen_k(add(first, i))
            self.loop(self.n_heads, lambda h: b.store(b.fmul(score(h), scale), b.gep(self.scores, [at(h, i)])))

        self.loop(size, score_cell)

        def softmax_heads(o):  # ggml's M and S of heads 8o..8o+7, and each cell's (ms, vs)
            f32x8 = ir.VectorType(_F32, 8)
            vec8 = lambda buf, at: b.bitcast(b.gep(buf, [at]), f32x8.as_pointer())  # noqa: E731
            h0 = mul(o, c(8))
            i, (m_old, s_old), finish = open_loop(b, size, [b.load(vec8(self.m_buf, h0), align=32),
                                                          b.load(vec8(self.s_buf, h0), align=32)])
            cell_score = b.load(vec8(self.scores, at(h0, i)), align=32)
            grows = b.fcmp_ordered(">", cell_score, m_old)
            e = expf_ir(b, b.select(grows, b.fsub(m_old, cell_score), b.fsub(cell_score, m_old)))
            one = ir.Constant(f32x8, [1.0] * 8)
            ms, vs = b.select(grows, e, one), b.select(grows, one, e)
            b.store(ms, vec8(self.ms_buf, at(h0, i)), align=32)
            b.store(vs, vec8(self.vs_buf, at(h0, i)), align=32)
            fma8 = cgutils.get_or_insert_function(b.module, ir.FunctionType(f32x8, [f32x8] * 3), "llvm.fma.v8f32")
            m_new, s_new = finish([b.select(grows, cell_score, m_old), b.call(fma8, [s_old, ms, vs])])
            b.store(m_new, vec8(self.m_buf, h0), align=32)
            b.store(s_new, vec8(self.s_buf, h0), align=32)

        # the heads side by side, 8 to a vector: each lane's steps are a head's, in cell order
        self.loop(b.sdiv(add(self.n_heads, c(7)), c(8)), softmax_heads)
        rounded = (lambda x: _f16_round(b, x)) if f16_sums else (lambda x: x)  # noqa: E731

        def sum_cell(i):
            widen_v(add(first, i))

            def head(h):
                ms, vs = b.load(b.gep(self.ms_buf, [at(h, i)])), b.load(b.gep(self.vs_buf, [at(h, i)]))
                sum_at = lambda j: self.vec(self.sums, add(mul(h, self.dim), mul(j, c(16))))  # noqa: E731
                # a new maximum: the sum scaled (ggml_vec_scale_f16 / _f32); by 1 it is unchanged
                with b.if_then(b.fcmp_unordered("!=", ms, f32(1.0)), likely=False):
                    msv = _splat(b, ms, _F32X16)
                    self.loop(self.n_vec, lambda j: b.store(rounded(b.fmul(b.load(sum_at(j), align=64), msv)),
                                                            sum_at(j), align=64))
                vsv = _splat(b, vs, _F32X16)
                self.loop(self.n_vec, lambda j: b.store(  # ggml_vec_mad_f16 / _f32
                    rounded(_fma(b, b.load(self.vec(self.v_row, mul(j, c(16))), align=64), vsv,
                                 b.load(sum_at(j), align=64))), sum_at(j), align=64))

            self.loop(self.n_heads, head)

        self.loop(size, sum_cell)
        finish_blocks([])
        self.loop(self.n_heads, lambda h: (b.store(b.load(b.gep(self.m_buf, [h])), b.gep(m_data, [h])),
                                           b.store(b.load(b.gep(self.s_buf, [h])), b.gep(s_data, [h]))))

    def sums_to(self, acc_t, acc_a):
        """The V sums into the array acc (G * D,)."""
        b, c = self.builder, self.c
        self.loop(b.mul(self.n_heads, self.n_vec), lambda j: b.store(
            b.load(self.vec(self.sums, b.mul(j, c(16))), align=64),
            _ptr(self.context, b, acc_t, acc_a, b.mul(j, c(16)), _F32X16), align=4))


def _data(context, builder, array_type, array):
    return cgutils.create_struct_proxy(array_type)(context, builder, value=array).data


@intrinsic
def heads_walk_f16(typingctx, k, v, row_at, n, q, scale, acc, m, s, D):
    """ggml's one-chunk attention of G heads that share a KV head, over n cells: K and V of cell
    i are row row_at[i] (row * Hkv + kvh) of the flat f16 caches k and v (uint16), D values each;
    q (G * D,) the heads' f16-rounded queries (G heads of D values: walk_fits(G, D)). Per cell
    and head, as ggml_compute_forward_flash_attn_ext_f16_one_chunk:
    score = dot(K, q) * scale; if score > M: ms = expf(M - score), M = score, the sum rescaled
    (acc = f16(acc * ms)) and vs = 1; else vs = expf(score - M); then acc = f16(fma(V, vs, acc))
    and S = S * ms + vs. Results: acc (G * D,) the f16-valued, unnormalized V sums, m and s (G,)
    each head's M and S.

    Done that way a cell at a time, each cell waits for the last (the dot, then expf, then the
    sum), so the cells go in blocks of _BLOCK, in three passes: every score of the block; each
    head's M, S and (ms, vs) per cell (expf of cells that no longer wait on one another); the V
    sums. Each head's operations and their order are ggml's; a cell's K and V are widened to
    float32 once for the G heads."""
    sig = types.void(k, v, row_at, types.intp, q, types.float32, acc, m, s, types.intp)

    def codegen(context, builder, signature, args):
        k_a, v_a, at_a, n, q_a, scale, acc_a, m_a, s_a, dim = args
        k_t, v_t, at_t, _, q_t, _, acc_t, m_t, s_t, _ = signature.args
        b = builder
        n_heads = b.sdiv(cgutils.create_struct_proxy(q_t)(context, b, value=q_a).nitems, dim)
        walk = _Walk(context, b, n, n_heads, dim)
        c, at_data = walk.c, _data(context, b, at_t, at_a)
        walk.loop(b.mul(n_heads, walk.n_vec), lambda j: b.store(  # the queries, aligned
            _load_f32x16(context, b, q_t, q_a, b.mul(j, c(16))), walk.vec(walk.q_buf, b.mul(j, c(16))), align=64))

        def widen(cache_t, cache_a, into):
            def row(cell):  # a cell's f16 row as float32 (vcvtph2ps)
                start = b.mul(b.load(b.gep(at_data, [cell])), dim)
                walk.loop(walk.n_vec, lambda j: b.store(
                    _load_f32x16(context, b, cache_t, cache_a, b.add(start, b.mul(j, c(16)))),
                    walk.vec(into, b.mul(j, c(16))), align=64))
            return row

        def fetch(cache_t, cache_a):
            def row(cell):  # a cell's f16 row, one prefetch per 64 bytes (32 values)
                start = b.mul(b.load(b.gep(at_data, [cell])), dim)
                walk.loop(b.sdiv(dim, c(32)), lambda j: prefetch_line(
                    b, _ptr(context, b, cache_t, cache_a, b.add(start, b.mul(j, c(32))), ir.IntType(8))))
            return row

        walk.run(_data(context, b, m_t, m_a), _data(context, b, s_t, s_a), scale, widen(k_t, k_a, walk.k_row),
                 lambda h: _dot(b, walk.k_row, walk.q_buf, b.mul(h, dim), dim), widen(v_t, v_a, walk.v_row), True,
                 fetch(k_t, k_a), fetch(v_t, v_a))
        walk.sums_to(acc_t, acc_a)
        return context.get_dummy_value()

    return sig, codegen


# A q8_0 dot's lane l sums the products of codes 4l..4l+3 (ggml's AVX2 vec_dot). The walk keeps
# a block's 32 codes lane-major, position 8j + l holding code 4l + j, so that the 8 lanes are
# the sum of four aligned 8-wide pieces (the sums are of integers below 2^24: exact in any order).
_LANE_MAJOR = [4 * (i % 8) + i // 8 for i in range(32)]


def _lane_major(builder, codes):
    return builder.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(_I32, 32), _LANE_MAJOR))


def _piece(builder, v, j):
    """Lanes 8j..8j+7 of a 32-lane vector."""
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 8), list(range(8 * j, 8 * j + 8))))


@intrinsic
def heads_walk_q(typingctx, kcache, vcache, row_at, n, qq, qd, scale, acc, m, s, D, k_q8, v_q8):
    """The walk of heads_walk_f16 over a quantized cache (attention_q.py): row row_at[i] of the
    flat uint8 caches holds D/32 blocks of q8_0 (k_q8 / v_q8) or q4_0; qq (G * D,) the heads'
    q8_0 query codes as floats, qd (G * D/32,) their block scales. Per cell and head, as ggml
    with a quantized K or V: score = ggml_vec_dot_{q8_0,q4_0}_q8_0 (8 lanes each summing 4
    code products, exact; per block fma(d_k * d_q, sum, lane); then hsum_float_8) * scale; the
    softmax as heads_walk_f16's; the V sum in float32: a new maximum gives acc * ms (rounded)
    + V, else fma(V, vs, acc). Results as heads_walk_f16's (acc in float32)."""
    sig = types.void(kcache, vcache, row_at, types.intp, qq, qd, types.float32, acc, m, s, types.intp,
                     types.boolean, types.boolean)

    def codegen(context, builder, signature, args):
        k_a, v_a, at_a, n, qq_a, qd_a, scale, acc_a, m_a, s_a, dim, k_q8, v_q8 = args
        k_t, v_t, at_t, _, qq_t, qd_t, _, acc_t, m_t, s_t = signature.args[:10]
        b = builder
        n_heads = b.sdiv(cgutils.create_struct_proxy(qq_t)(context, b, value=qq_a).nitems, dim)
        walk = _Walk(context, b, n, n_heads, dim)
        c, at_data = walk.c, _data(context, b, at_t, at_a)
        n_blocks = b.sdiv(dim, c(32))
        k_scales, q_scales = _stack_floats(b, _MAX_DIM // 32), _stack_floats(b, WALK_MAX_VALUES // 32)
        f32x32 = ir.VectorType(_F32, 32).as_pointer()
        qq_data = _data(context, b, qq_t, qq_a)
        walk.loop(b.mul(n_heads, n_blocks), lambda j: b.store(  # the query codes, lane-major
            _lane_major(b, b.load(b.bitcast(b.gep(qq_data, [b.mul(j, c(32))]), f32x32), align=4)),
            b.bitcast(b.gep(walk.q_buf, [b.mul(j, c(32))]), f32x32), align=64))
        qd_data = _data(context, b, qd_t, qd_a)
        walk.loop(b.mul(n_heads, n_blocks), lambda j: b.store(b.load(b.gep(qd_data, [j])), b.gep(q_scales, [j])))

        def widen(cache_t, cache_a, q8, into, scales):
            data = _data(context, b, cache_t, cache_a)

            def row(cell):  # a cell's blocks: codes (times the block scale for V) and scales
                def block(bi):
                    block_bytes = b.select(q8, c(34), c(18))
                    start = b.mul(b.load(b.gep(at_data, [cell])), b.mul(n_blocks, block_bytes))
                    at = b.add(start, b.mul(bi, block_bytes))
                    scale_bits = b.load(b.bitcast(b.gep(data, [at]), ir.IntType(16).as_pointer()), align=1)
                    d = b.fpext(b.bitcast(scale_bits, ir.HalfType()), _F32)
                    dest = b.bitcast(b.gep(into, [b.mul(bi, c(32))]), f32x32)
                    with b.if_else(q8) as (q8_block, q4_block):
                        for is_q4, branch in ((False, q8_block), (True, q4_block)):
                            with branch:
                                codes = _block_codes(b, data, b.add(at, c(2)), is_q4)
                                if scales is not None:  # K: the codes, lane-major
                                    b.store(_lane_major(b, codes), dest, align=64)
                                else:  # V: the values, in order
                                    b.store(b.fmul(codes, _splat_n(b, d, 32)), dest, align=64)
                    if scales is not None:
                        b.store(d, b.gep(scales, [bi]))
                walk.loop(n_blocks, block)
            return row

        def score(h):  # ggml_vec_dot_q8_0_q8_0 / _q4_0_q8_0 (AVX2), as simd.dot_q_lanes
            fma8 = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F32X8, [_F32X8] * 3), "llvm.fma.v8f32")
            bi, (lanes,), finish = open_loop(b, n_blocks, [ir.Constant(_F32X8, None)])
            kv = b.load(b.bitcast(b.gep(walk.k_row, [b.mul(bi, c(32))]), f32x32), align=64)
            qv = b.load(b.bitcast(b.gep(walk.q_buf, [b.add(b.mul(h, dim), b.mul(bi, c(32)))]), f32x32), align=64)
            p = b.fmul(kv, qv)
            sums = b.fadd(b.fadd(_piece(b, p, 0), _piece(b, p, 1)), b.fadd(_piece(b, p, 2), _piece(b, p, 3)))
            dd = b.fmul(b.load(b.gep(k_scales, [bi])), b.load(b.gep(q_scales, [b.add(b.mul(h, n_blocks), bi)])))
            (lanes,) = finish([b.call(fma8, [_splat_n(b, dd, 8), sums, lanes])])
            lane = lambda j: b.extract_element(lanes, ir.Constant(_I32, j))  # noqa: E731
            return b.fadd(b.fadd(b.fadd(lane(4), lane(0)), b.fadd(lane(6), lane(2))),
                          b.fadd(b.fadd(lane(5), lane(1)), b.fadd(lane(7), lane(3))))

        def fetch(cache_t, cache_a, q8):
            data = _data(context, b, cache_t, cache_a)

            def row(cell):  # a cell's blocks: a prefetch at each 64 bytes, and at the last byte
                row_bytes = b.mul(n_blocks, b.select(q8, c(34), c(18)))
                start = b.mul(b.load(b.gep(at_data, [cell])), row_bytes)
                for j in range(_MAX_DIM // 32 * 34 // 64):
                    with b.if_then(b.icmp_signed("<", c(64 * j), row_bytes), likely=True):
                        prefetch_line(b, b.gep(data, [b.add(start, c(64 * j))]))
                prefetch_line(b, b.gep(data, [b.add(start, b.sub(row_bytes, c(1)))]))
            return row

        walk.run(_data(context, b, m_t, m_a), _data(context, b, s_t, s_a), scale,
                 widen(k_t, k_a, k_q8, walk.k_row, k_scales), score, widen(v_t, v_a, v_q8, walk.v_row, None), False,
                 fetch(k_t, k_a, k_q8), fetch(v_t, v_a, v_q8))
        walk.sums_to(acc_t, acc_a)
        return context.get_dummy_value()

    return sig, codegen


def _dot(builder, k, q, q_at, dim):
    """ggml_vec_dot_f16 of the dim floats at k (a widened K row) and at q + q_at: the SIMD steps
    in float32 (_dot_reduce), the rest (dim % _DOT_STEP) added in double, in order."""
    c = lambda x: ir.Constant(dim.type, x)  # noqa: E731

    def vec(buf, at):
        return builder.load(builder.bitcast(builder.gep(buf, [at]), _F32X16.as_pointer()), align=64)

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
