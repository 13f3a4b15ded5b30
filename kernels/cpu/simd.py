"""Row-vector steps of the exact products, written as LLVM vector code.

Numba fully unrolls the 32-row loops of kernels/cpu/matmul.py and then cannot vectorize them
(it cannot prove the arrays apart), leaving 32 scalar fma per step. These intrinsics do one
step for the R = 32 rows of a tile in two 16-lane vectors, with the same single-rounding fma
as ggml's SIMD code. The quantized KV cache's attention (attention_q.py) has its steps here too:
rows of q8_0/q4_0 codes widened, the integer dot's lanes, the float32 V sum. Offsets count
elements of each array's flat data (bytes for a cache)."""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_F32X16 = ir.VectorType(_F32, LANES)
_I32X16 = ir.VectorType(_I32, LANES)


def _ptr(context, builder, array_type, array, offset, vector_type):
    data = cgutils.create_struct_proxy(array_type)(context, builder, value=array).data
    return builder.bitcast(builder.gep(data, [offset]), vector_type.as_pointer())


def _load_f32x16(context, builder, array_type, array, offset, lanes=LANES):
    """16 consecutive values (or `lanes` of them) of a float32 array, of a uint16 array of float16
    bit patterns (the KV cache, F16 weights) widened to float32 (vcvtph2ps), or of an int16 array
    of bfloat16 bit patterns (BF16 weights) widened by a shift, as <16 x float> (<lanes x float>)."""
    f32s, i32s = ir.VectorType(_F32, lanes), ir.VectorType(_I32, lanes)
    if array_type.dtype in (types.uint16, types.int16):
        halves = builder.load(_ptr(context, builder, array_type, array, offset, ir.VectorType(ir.IntType(16), lanes)),
                              align=2)
        if array_type.dtype == types.int16:
            wide = builder.shl(builder.zext(halves, i32s), ir.Constant(i32s, [16] * lanes))
            return builder.bitcast(wide, f32s)
        return builder.fpext(builder.bitcast(halves, ir.VectorType(ir.HalfType(), lanes)), f32s)
    return builder.load(_ptr(context, builder, array_type, array, offset, f32s), align=4)


def _splat(builder, value, vector_type):
    v = builder.insert_element(ir.Constant(vector_type, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vector_type, None), ir.Constant(_I32X16, [0] * LANES))


def _fma(builder, a, b, c):
    """fma(a, b, c) of <16 x float> (or of any width)."""
    vector = a.type
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                        f"llvm.fma.v{vector.count}f32")
    return builder.call(fn, [a, b, c])


def _f16_round(builder, x):
    """float32 -> nearest float16 (ties to even, as vcvtps2ph) -> float32, 16 lanes."""
    half = builder.fptrunc(x, ir.VectorType(ir.HalfType(), LANES))
    return builder.fpext(half, _F32X16)


@intrinsic
def f16_mad_rows(typingctx, acc, acc_off, v, v_off, s):
    """ggml_vec_mad_f16 on 32 consecutive values: acc[i] = f16(fma(v[i], s, acc[i])) (v float32,
    or float16 bit patterns)."""
    sig = types.void(acc, types.intp, v, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        acc_a, acc_o, v_a, v_o, s = args
        sv = _splat(builder, s, _F32X16)
        for half in range(2):
            step = ir.Constant(acc_o.type, LANES * half)
            pa = _ptr(context, builder, signature.args[0], acc_a, builder.add(acc_o, step), _F32X16)
            vv = _load_f32x16(context, builder, signature.args[2], v_a, builder.add(v_o, step))
            summed = _fma(builder, vv, sv, builder.load(pa, align=4))
            builder.store(_f16_round(builder, summed), pa, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def f16_rescale_add_rows(typingctx, acc, acc_off, v, v_off, ms):
    """ggml_vec_scale_f16 then ggml_vec_mad_f16 with 1, on 32 consecutive values:
    acc[i] = f16(v[i] + f16(acc[i] * ms)) (v float32, or float16 bit patterns)."""
    sig = types.void(acc, types.intp, v, types.intp, types.float32)

    def codegen(context, builder, signature, args):
        acc_a, acc_o, v_a, v_o, ms = args
        mv = _splat(builder, ms, _F32X16)
        for half in range(2):
            step = ir.Constant(acc_o.type, LANES * half)
            pa = _ptr(context, builder, signature.args[0], acc_a, builder.add(acc_o, step), _F32X16)
            vv = _load_f32x16(context, builder, signature.args[2], v_a, builder.add(v_o, step))
            scaled = _f16_round(builder, builder.fmul(builder.load(pa, align=4), mv))
            builder.store(_f16_round(builder, builder.fadd(vv, scaled)), pa, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _f32_step_16(rescale):
    @intrinsic
    def step(typingctx, acc, acc_off, v, v_off, s):
        """16 consecutive float32 values: acc[i] = fma(v[i], s, acc[i]), or with rescale
        acc[i] = acc[i] * s + v[i] (two roundings, no fma)."""
        sig = types.void(acc, types.intp, v, types.intp, types.float32)

        def codegen(context, builder, signature, args):
            acc_a, acc_o, v_a, v_o, s = args
            pa = _ptr(context, builder, signature.args[0], acc_a, acc_o, _F32X16)
            vv = _load_f32x16(context, builder, signature.args[2], v_a, v_o)
            old, sv = builder.load(pa, align=4), _splat(builder, s, _F32X16)
            new = builder.fadd(builder.fmul(old, sv), vv) if rescale else _fma(builder, vv, sv, old)
            builder.store(new, pa, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return step


f32_mad_16 = _f32_step_16(False)           # the V sum's step: acc = fma(v, s, acc)
f32_rescale_add_16 = _f32_step_16(True)    # a new maximum: acc = acc * s + v

_F32X32 = ir.VectorType(_F32, 32)
_F32X8 = ir.VectorType(_F32, 8)


def _splat_n(builder, value, n):
    """The float `value` in all n lanes of a vector."""
    vt = ir.VectorType(_F32, n)
    v = builder.insert_element(ir.Constant(vt, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, None), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _block_codes(builder, data, at, q4):
    """The 32 codes of a q8_0 block (int8 at byte `at`) or of a q4_0 block (16 bytes of nibbles:
    low ones first, each minus 8) as <32 x float>."""
    i8 = ir.IntType(8)
    if not q4:
        raw = builder.load(builder.bitcast(builder.gep(data, [at]), ir.VectorType(i8, 32).as_pointer()), align=1)
        return builder.sitofp(raw, _F32X32)
    raw = builder.load(builder.bitcast(builder.gep(data, [at]), ir.VectorType(i8, 16).as_pointer()), align=1)
    wide = builder.zext(raw, _I32X16)
    lo = builder.sub(builder.and_(wide, ir.Constant(_I32X16, [15] * 16)), ir.Constant(_I32X16, [8] * 16))
    hi = builder.sub(builder.lshr(wide, ir.Constant(_I32X16, [4] * 16)), ir.Constant(_I32X16, [8] * 16))
    both = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    return builder.sitofp(both, _F32X32)


def _unpack_codes(q4):
    @intrinsic
    def unpack(typingctx, out, out_off, cache, byte_off, block_bytes, scales, n_blocks):
        """out[out_off + 32b + j] = code j of block b * scales[b], for the n_blocks blocks of a
        quantized cache row starting at byte byte_off of the cache (block_bytes apart)."""
        sig = types.void(out, types.intp, cache, types.intp, types.intp, scales, types.intp)

        def codegen(context, builder, signature, args):
            out_a, out_o, cache_a, byte_o, step, sc_a, n = args
            c = lambda v: ir.Constant(out_o.type, v)  # noqa: E731
            data = cgutils.create_struct_proxy(signature.args[2])(context, builder, value=cache_a).data
            sc = cgutils.create_struct_proxy(signature.args[5])(context, builder, value=sc_a).data

            def body(b, carried):
                codes = _block_codes(builder, data, builder.add(builder.add(byte_o, builder.mul(b, step)), c(2)), q4)
                d = builder.load(builder.gep(sc, [b]))
                vals = builder.fmul(codes, _splat_n(builder, d, 32))
                at = builder.add(out_o, builder.mul(b, c(32)))
                builder.store(vals, _ptr(context, builder, signature.args[0], out_a, at, _F32X32), align=4)
                return carried

            _loop(builder, n, [], body)
            return context.get_dummy_value()

        return sig, codegen

    return unpack


unpack_q8_0_codes = _unpack_codes(False)
unpack_q4_0_codes = _unpack_codes(True)


@intrinsic
def dot_q_lanes(typingctx, k, q, q_off, dd, n_blocks):
    """ggml's AVX2 vec_dot_q8_0_q8_0 / q4_0_q8_0 on codes held as floats: per 32-block, lane l
    sums the products of codes 4l..4l+3 (exact integers), acc[l] = fma(dd[b], sum, acc[l]);
    then hsum_float_8: ((4 + 0) + (6 + 2)) + ((5 + 1) + (7 + 3)). k (32 n_blocks,) the key's
    codes, q[q_off:] the query's, dd (n_blocks,) the products of their block scales."""
    sig = types.float32(k, q, types.intp, dd, types.intp)

    def codegen(context, builder, signature, args):
        k_a, q_a, q_o, dd_a, n = args
        c = lambda v: ir.Constant(q_o.type, v)  # noqa: E731
        dd_data = cgutils.create_struct_proxy(signature.args[3])(context, builder, value=dd_a).data
        evens = lambda m: ir.Constant(ir.VectorType(_I32, m), list(range(0, 2 * m, 2)))  # noqa: E731
        odds = lambda m: ir.Constant(ir.VectorType(_I32, m), list(range(1, 2 * m, 2)))  # noqa: E731

        def body(b, carried):
            at = builder.mul(b, c(32))
            kv = builder.load(_ptr(context, builder, signature.args[0], k_a, at, _F32X32), align=4)
            qv = builder.load(_ptr(context, builder, signature.args[1], q_a, builder.add(q_o, at), _F32X32), align=4)
            p = builder.fmul(kv, qv)
            s16 = builder.fadd(builder.shuffle_vector(p, p, evens(16)), builder.shuffle_vector(p, p, odds(16)))
            s8 = builder.fadd(builder.shuffle_vector(s16, s16, evens(8)), builder.shuffle_vector(s16, s16, odds(8)))
            d = builder.load(builder.gep(dd_data, [b]))
            dv = _splat_n(builder, d, 8)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X8, [_F32X8] * 3), "llvm.fma.v8f32")
            return [builder.call(fn, [dv, s8, carried[0]])]

        (acc,) = _loop(builder, n, [ir.Constant(_F32X8, [0.0] * 8)], body)
        lane = lambda j: builder.extract_element(acc, ir.Constant(_I32, j))  # noqa: E731
        return builder.fadd(builder.fadd(builder.fadd(lane(4), lane(0)), builder.fadd(lane(6), lane(2))),
                            builder.fadd(builder.fadd(lane(5), lane(1)), builder.fadd(lane(7), lane(3))))

    return sig, codegen


def _f32(value):
    return ir.Constant(_F32X16, [float(value)] * LANES)


def v_expf_vector(builder, x):
    """ggml_v_expf (AVX-512) on 16 lanes, step for step (see ops.v_expf): the polynomial in
    fma, then scalef(j, n) as exact multiplies by powers of two (one rounding)."""
    from .ops import (_EXP_C1, _EXP_C2, _EXP_C3, _EXP_C4, _EXP_C5, _EXP_ROUND, _LN2_HI, _LN2_LO,
                      _LOG2E)
    fma_ = lambda a, b, c: _fma(builder, a, b, c)  # noqa: E731
    z = fma_(x, _f32(_LOG2E), _f32(_EXP_ROUND))
    n = builder.fsub(z, _f32(_EXP_ROUND))
    neg_n = builder.fneg(n)
    b = fma_(neg_n, _f32(_LN2_LO), fma_(neg_n, _f32(_LN2_HI), x))
    u = builder.fmul(b, b)
    j = fma_(fma_(fma_(_f32(_EXP_C5), b, _f32(_EXP_C4)), u, fma_(_f32(_EXP_C3), b, _f32(_EXP_C2))), u,
             fma_(_f32(_EXP_C1), b, _f32(1.0)))
    # n clamped to a finite range before the integer conversion (|n| > 192 is decided below)
    nc = builder.select(builder.fcmp_ordered("<", n, _f32(-200.0)), _f32(-200.0), n)
    nc = builder.select(builder.fcmp_ordered(">", nc, _f32(200.0)), _f32(200.0), nc)
    nc = builder.select(builder.fcmp_unordered("uno", nc, nc), _f32(0.0), nc)
    e = builder.fptosi(nc, _I32X16)

    def pow2(k):  # the float 2^k for k in [-126, 127]
        bits = builder.shl(builder.add(k, ir.Constant(_I32X16, [127] * LANES)), ir.Constant(_I32X16, [23] * LANES))
        return builder.bitcast(bits, _F32X16)

    low = builder.icmp_signed("<", e, ir.Constant(_I32X16, [-126] * LANES))
    high = builder.icmp_signed(">", e, ir.Constant(_I32X16, [127] * LANES))
    # low: j * 2^(e + 100) is exact, then * 2^-100 rounds once; high: j * 2^(e - 64), * 2^64
    adjust = builder.select(low, ir.Constant(_I32X16, [100] * LANES),
                            builder.select(high, ir.Constant(_I32X16, [-64] * LANES), ir.Constant(_I32X16, None)))
    scaled = builder.fmul(j, pow2(builder.add(e, adjust)))
    back = builder.select(low, _f32(2.0 ** -100), builder.select(high, _f32(2.0 ** 64), _f32(1.0)))
    scaled = builder.fmul(scaled, back)
    absn = builder.select(builder.fcmp_ordered("<", n, _f32(0.0)), builder.fneg(n), n)
    big = builder.fcmp_ordered(">", absn, _f32(192.0))
    limit = builder.select(builder.fcmp_ordered("<=", n, _f32(0.0)), _f32(0.0), _f32(float("inf")))
    return builder.select(big, limit, scaled)


def v_expf_avx2_vector(builder, x):
    """ggml_v_expf's AVX2 version on 16 lanes, step for step (ops.v_expf_avx2): 2^n in the
    exponent bits of z, the polynomial without its constant term, then fma(j, 2^n, 2^n); |n| >
    126 through two factors."""
    from .ops import (_AVX2_ONE_BITS, _AVX2_SPECIAL_NEG, _EXP_C1, _EXP_C2, _EXP_C3, _EXP_C4, _EXP_C5, _EXP_ROUND,
                      _LN2_HI, _LN2_LO, _LOG2E)
    fma_ = lambda a, b, c: _fma(builder, a, b, c)  # noqa: E731
    ints = lambda v: ir.Constant(_I32X16, [int(v)] * LANES)  # noqa: E731
    z = fma_(x, _f32(_LOG2E), _f32(_EXP_ROUND))
    n = builder.fsub(z, _f32(_EXP_ROUND))
    neg_n = builder.fneg(n)
    b = fma_(neg_n, _f32(_LN2_LO), fma_(neg_n, _f32(_LN2_HI), x))
    e = builder.shl(builder.bitcast(z, _I32X16), ints(23))
    k = builder.bitcast(builder.add(e, ints(_AVX2_ONE_BITS)), _F32X16)
    u = builder.fmul(b, b)
    j = fma_(fma_(fma_(_f32(_EXP_C5), b, _f32(_EXP_C4)), u, fma_(_f32(_EXP_C3), b, _f32(_EXP_C2))), u,
             builder.fmul(_f32(_EXP_C1), b))
    g = builder.select(builder.fcmp_ordered("<=", n, _f32(0.0)), ints(_AVX2_SPECIAL_NEG), ints(0))
    s1 = builder.bitcast(builder.add(g, ints(0x7F000000)), _F32X16)
    s2 = builder.bitcast(builder.sub(e, g), _F32X16)
    an = builder.select(builder.fcmp_ordered("<", n, _f32(0.0)), builder.fneg(n), n)
    special = builder.select(builder.fcmp_ordered(">", an, _f32(192.0)), builder.fmul(s1, s1),
                             builder.fmul(fma_(s2, j, s2), s1))
    return builder.select(builder.fcmp_ordered(">", an, _f32(126.0)), special, fma_(j, k, k))


@intrinsic
def scaled_masked_max(typingctx, row, row_off, bias, bias_off, scale, n16):
    """row[i] = row[i] * scale + bias[i] for i < 16 * n16 (bias: 0, or -inf where masked, as
    ggml adds its mask); returns the largest of them (-inf when all are masked)."""
    sig = types.float32(row, types.intp, bias, types.intp, types.float32, types.intp)

    def codegen(context, builder, signature, args):
        row_a, row_o, bias_a, bias_o, scale, n = args
        c = lambda v: ir.Constant(row_o.type, v)  # noqa: E731
        scale_v = _splat(builder, scale, _F32X16)

        def body(i, carried):
            at = builder.mul(i, c(LANES))
            p = _ptr(context, builder, signature.args[0], row_a, builder.add(row_o, at), _F32X16)
            b = builder.load(_ptr(context, builder, signature.args[2], bias_a, builder.add(bias_o, at), _F32X16),
                             align=4)
            v = builder.fadd(builder.fmul(builder.load(p, align=4), scale_v), b)
            builder.store(v, p, align=4)
            return [_larger(builder, v, carried[0])]

        (top,) = _loop(builder, n, [_f32(float("-inf"))], body)
        for width in (8, 4, 2, 1):  # the lanes' largest (any order gives the same)
            lo = builder.shuffle_vector(top, top, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
            hi = builder.shuffle_vector(top, top, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width))))
            top = _larger(builder, lo, hi)
        return builder.extract_element(top, ir.Constant(_I32, 0))

    return sig, codegen


def _larger(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _exp_sum_rows(lanes):
    """An intrinsic: row[i] = ggml_v_expf(row[i] - shift) for i < 16 * n16, as ggml builds it
    with AVX-512 (lanes 16) or AVX2 (8); returns ggml_vec_soft_max_f32's sum of them: each
    `lanes` values' hsum (attention._reduce16, _reduce8), added in order in double."""
    @intrinsic
    def exp_sum_rows(typingctx, row, row_off, shift, n16):
        sig = types.float64(row, types.intp, types.float32, types.intp)

        def codegen(context, builder, signature, args):
            row_a, row_o, shift, n = args
            c = lambda v: ir.Constant(row_o.type, v)  # noqa: E731
            shift_v = _splat(builder, shift, _F32X16)

            def body(i, carried):
                p = _ptr(context, builder, signature.args[0], row_a, builder.add(row_o, builder.mul(i, c(LANES))),
                         _F32X16)
                x = builder.fsub(builder.load(p, align=4), shift_v)
                e = v_expf_vector(builder, x) if lanes == 16 else v_expf_avx2_vector(builder, x)
                builder.store(e, p, align=4)
                total = carried[0]
                for part in range(0, LANES, lanes):
                    v = builder.shuffle_vector(e, e, ir.Constant(ir.VectorType(_I32, lanes),
                                                                 list(range(part, part + lanes))))
                    total = builder.fadd(total, builder.fpext(_ggml_hsum(builder, v), ir.DoubleType()))
                return [total]

            (total,) = _loop(builder, n, [ir.Constant(ir.DoubleType(), 0.0)], body)
            return total

        return sig, codegen

    return exp_sum_rows


exp_sum_rows, exp_sum_rows8 = _exp_sum_rows(16), _exp_sum_rows(8)


@intrinsic
def swiglu_16(typingctx, gate, up, out, off):
    """out[i] = (g / (1 + ggml_v_expf(0 - g))) * up[i], g = gate[i], for 16 consecutive i:
    ggml_vec_swiglu_f32's vector step (ggml_v_silu, AVX-512)."""
    sig = types.void(gate, up, out, types.intp)

    def codegen(context, builder, signature, args):
        (g_a, u_a, o_a, at), (g_t, u_t, o_t, _) = args, signature.args
        g = builder.load(_ptr(context, builder, g_t, g_a, at, _F32X16), align=4)
        silu = builder.fdiv(g, builder.fadd(_f32(1.0), v_expf_vector(builder, builder.fsub(_f32(0.0), g))))
        u = builder.load(_ptr(context, builder, u_t, u_a, at, _F32X16), align=4)
        builder.store(builder.fmul(silu, u), _ptr(context, builder, o_t, o_a, at, _F32X16), align=4)
        return context.get_dummy_value()

    return sig, codegen


def open_loop(builder, n, init):
    """Start `for i in range(n)` carrying the vectors `init`; returns (i, carried, finish), where
    finish(new_values) closes the loop and returns the values after it (init when n <= 0)."""
    intp = n.type
    entry = builder.block
    loop = builder.append_basic_block("loop")
    done = builder.append_basic_block("loop_done")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(intp, 0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(intp)
    i.add_incoming(ir.Constant(intp, 0), entry)
    carried = [builder.phi(v.type) for v in init]
    for phi, v in zip(carried, init):
        phi.add_incoming(v, entry)

    def finish(new):
        last = builder.block
        nxt = builder.add(i, ir.Constant(intp, 1))
        i.add_incoming(nxt, last)
        for phi, v in zip(carried, new):
            phi.add_incoming(v, last)
        builder.cbranch(builder.icmp_signed("<", nxt, n), loop, done)
        builder.position_at_end(done)
        out = []
        for v0, v in zip(init, new):
            phi = builder.phi(v.type)
            phi.add_incoming(v0, entry)
            phi.add_incoming(v, last)
            out.append(phi)
        return out

    return i, carried, finish


def _loop(builder, n, init, body):
    """for i in range(n): carried = body(i, carried); returns the final carried vectors."""
    i, carried, finish = open_loop(builder, n, init)
    return finish(body(i, carried))


def _fma_chains(n_rows, width=64):
    """An intrinsic: for n_rows rows r and `width` (a multiple of 16) consecutive
    acc[acc_off + r * acc_row + j], one fma chain each over i in [0, n), in order,
    acc = fma(m[m_off + i * m_stride + j], s[s_off + r * s_row + i * s_step], acc), kept in
    registers. The rows share each step's loads of m, and several rows give the core
    independent chains (one row's wait on the fma latency). Flash attention's tiles: scores
    (K^T rows times a query's values) and the V sum (V rows times a row's probabilities)."""
    n_vec = width // 16

    @intrinsic
    def fma_chains(typingctx, acc, acc_off, acc_row, m, m_off, m_stride, s, s_off, s_row, s_step, n):
        sig = types.void(acc, types.intp, types.intp, m, types.intp, types.intp, s, types.intp, types.intp,
                         types.intp, types.intp)

        def codegen(context, builder, signature, args):
            acc_a, acc_o, acc_r, m_a, m_o, m_st, s_a, s_o, s_r, s_st, n = args
            c = lambda v: ir.Constant(acc_o.type, v)  # noqa: E731
            acc_ptrs = [_ptr(context, builder, signature.args[0], acc_a,
                             builder.add(builder.add(acc_o, builder.mul(acc_r, c(r))), c(16 * k)), _F32X16)
                        for r in range(n_rows) for k in range(n_vec)]
            init = [builder.load(p, align=4) for p in acc_ptrs]
            s_data = cgutils.create_struct_proxy(signature.args[6])(context, builder, value=s_a).data

            def body(i, carried):
                row = builder.add(m_o, builder.mul(i, m_st))
                mv = [builder.load(_ptr(context, builder, signature.args[3], m_a, builder.add(row, c(16 * k)),
                                        _F32X16), align=4) for k in range(n_vec)]
                out = []
                for r in range(n_rows):
                    at = builder.add(builder.add(s_o, builder.mul(s_r, c(r))), builder.mul(i, s_st))
                    sv = _splat(builder, builder.load(builder.gep(s_data, [at])), _F32X16)
                    out += [_fma(builder, mv[k], sv, carried[n_vec * r + k]) for k in range(n_vec)]
                return out

            for p, v in zip(acc_ptrs, _loop(builder, n, init, body)):
                builder.store(v, p, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return fma_chains


fma_chain_64 = _fma_chains(1)
fma_chains_64x2 = _fma_chains(2)
fma_chains_64x6 = _fma_chains(6)  # 24 chains: flash attention's tiles, 6 query rows at a time
# AVX2's 16 registers: 32 columns (4 registers a row) of 3, 2 or 1 rows
fma_chain_32, fma_chains_32x2, fma_chains_32x3 = _fma_chains(1, 32), _fma_chains(2, 32), _fma_chains(3, 32)


def _first_values(context, builder, array_type, array, count):
    """array[0], ..., array[count - 1] (an int64 array of starts)."""
    data = cgutils.create_struct_proxy(array_type)(context, builder, value=array).data
    return [builder.load(builder.gep(data, [ir.Constant(ir.IntType(64), k)])) for k in range(count)]




@intrinsic
def quantize_block_32(typingctx, x, x_off, q, q_off, n4, n4_off):
    """One 32-value block of llama.cpp's quantize_row_q8_0/_q8_1 (x86): amax = max |x|, each
    code rint(x * (127 / amax)) (0 where amax is 0) stored at q[q_off:q_off + 32] (int8), and
    the sums of every 4 codes at n4[n4_off:n4_off + 8] (int32). Returns amax. The max is taken
    over the bits of |x| as integers (positive floats order as their bits): a vector reduction,
    where a float max is a chain the compiler keeps scalar."""
    sig = types.float32(x, types.intp, q, types.intp, n4, types.intp)

    def codegen(context, builder, signature, args):
        x_a, x_o, q_a, q_o, n4_a, n4_o = args
        b = builder
        c = lambda v: ir.Constant(x_o.type, v)  # noqa: E731
        halves = [b.load(_ptr(context, b, signature.args[0], x_a, b.add(x_o, c(16 * h)), _F32X16), align=4)
                  for h in range(2)]
        magnitude = [b.and_(b.bitcast(v, _I32X16), ir.Constant(_I32X16, [0x7FFFFFFF] * LANES)) for v in halves]
        most = b.select(b.icmp_signed(">", magnitude[0], magnitude[1]), magnitude[0], magnitude[1])
        smax = cgutils.get_or_insert_function(b.module, ir.FunctionType(_I32, [_I32X16]),
                                              "llvm.vector.reduce.smax.v16i32")
        amax = b.bitcast(b.call(smax, [most]), _F32)
        zero = ir.Constant(_F32, 0.0)
        inv = b.select(b.fcmp_unordered("!=", amax, zero), b.fdiv(ir.Constant(_F32, 127.0), amax), zero)
        rint = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F32X16, [_F32X16]), "llvm.rint.v16f32")
        codes = [b.fptosi(b.call(rint, [b.fmul(v, _splat(b, inv, _F32X16))]), _I32X16) for v in halves]
        for h in range(2):
            b.store(b.trunc(codes[h], ir.VectorType(ir.IntType(8), LANES)),
                    _ptr(context, b, signature.args[2], q_a, b.add(q_o, c(16 * h)), ir.VectorType(ir.IntType(8), LANES)),
                    align=1)
        i32x8 = ir.VectorType(_I32, 8)
        pick = lambda j: b.shuffle_vector(codes[0], codes[1], ir.Constant(i32x8, [4 * g + j for g in range(8)]))  # noqa: E731
        sums = b.add(b.add(pick(0), pick(1)), b.add(pick(2), pick(3)))
        b.store(sums, _ptr(context, b, signature.args[4], n4_a, n4_o, i32x8), align=4)
        return amax

    return sig, codegen


@intrinsic
def load_u32(typingctx, array, offset):
    """The little-endian uint32 at byte `offset` of a contiguous uint8 array's data, whatever its
    alignment (one unaligned load)."""
    sig = types.uint32(array, types.intp)

    def codegen(context, builder, signature, args):
        data = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0]).data
        at = builder.bitcast(builder.gep(data, [args[1]]), _I32.as_pointer())
        return builder.load(at, align=1)

    return sig, codegen


def prefetch_line(builder, pointer, locality=3):
    """Asks for the cache line at pointer, for reading: locality 3 into every level (prefetcht0),
    2 into L2 and below (prefetcht1)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(pointer, i8p), ir.Constant(i32, 0), ir.Constant(i32, locality),
                      ir.Constant(i32, 1)])


def ask_ahead(builder, ahead, c, n_steps, step, max_lines):
    """Step `step` of a walk of n_steps asks for its share of the cache lines ahead = (pointer,
    n_lines) (n_lines 0: none) into L2, the lines spread evenly over the steps, at most
    max_lines a step. Straight-line code in groups of 8 lines, each group skipped when the
    share is smaller (all of them when it is 0): a loop here would split the walk's loop, and
    its accumulators would go through the stack."""
    ap, n_lines = ahead
    per_step = builder.udiv(builder.add(n_lines, builder.sub(n_steps, c(1))), n_steps)
    first, last = builder.mul(step, per_step), builder.sub(n_lines, c(1))
    smaller = lambda u, v: builder.select(builder.icmp_signed("<", u, v), u, v)  # noqa: E731
    for group in range(0, max_lines, 8):
        with builder.if_then(builder.icmp_signed(">", per_step, c(group))):
            for k in range(group, min(group + 8, max_lines)):
                line = smaller(builder.add(first, smaller(c(k), builder.sub(per_step, c(1)))), last)
                prefetch_line(builder, builder.gep(ap, [builder.mul(line, c(64))]), locality=2)


@intrinsic
def prefetch_l2(typingctx, array, start, stop):
    """Asks for the cache lines of bytes start..stop - 1 of a contiguous array's data, one
    prefetch per 64 bytes, into L2 (L1 keeps what the caller is working on)."""
    sig = types.void(array, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        data = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=args[0]).data
        c = lambda v: ir.Constant(args[1].type, v)  # noqa: E731
        n_lines = builder.sdiv(builder.add(builder.sub(args[2], args[1]), c(63)), c(64))
        first = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]])

        def body(i, carried):
            prefetch_line(builder, builder.gep(first, [builder.mul(i, c(64))]), locality=2)
            return []
        _loop(builder, n_lines, [], body)
        return context.get_dummy_value()

    return sig, codegen


def _ggml_hsum(builder, v):
    """The sum of a <16 x float> in _mm512_reduce_add_ps's order (attention._reduce16: halves
    added 16 -> 8 -> 4, then (0 + 2) + (1 + 3)), or of a <8 x float> in ggml's AVX2 hsum's
    (_reduce8: 8 -> 4, then the same)."""
    s4 = _halve(builder, _halve(builder, v, 8) if v.type.count == 16 else v, 4)
    lane = lambda j: builder.extract_element(s4, ir.Constant(_I32, j))  # noqa: E731
    return builder.fadd(builder.fadd(lane(0), lane(2)), builder.fadd(lane(1), lane(3)))


def _halve(builder, v, n):
    """The first n lanes plus the next n (a 2n-lane vector -> n lanes)."""
    lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
    hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
    return builder.fadd(lo, hi)


def _dot_f16_accumulators(context, builder, signature, args, n_acc, ahead=0):
    """The 16-lane fma accumulators of an f16 dot product over steps of 16 * n_acc values
    (args: a, a_off, b, b_off, n, n a multiple of the step): accumulator k takes values
    16k..16k+15 of each step. ahead: each step also asks for a's lines `ahead` values further
    on, into L2 (a matrix's rows walked one after the other)."""
    a_a, a_o, b_a, b_o, n = args
    c = lambda v: ir.Constant(a_o.type, v)  # noqa: E731
    step = 16 * n_acc
    a_data = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=a_a).data

    def body(i, carried):
        at = builder.mul(i, c(step))
        if ahead:
            for k in range(n_acc):
                prefetch_line(builder, builder.gep(a_data, [builder.add(a_o, builder.add(at, c(16 * k + ahead)))]), 2)
        return [_fma(builder,
                     _load_f32x16(context, builder, signature.args[0], a_a, builder.add(a_o, builder.add(at, c(16 * k)))),
                     _load_f32x16(context, builder, signature.args[2], b_a, builder.add(b_o, builder.add(at, c(16 * k)))),
                     acc)
                for k, acc in enumerate(carried)]

    return _loop(builder, builder.sdiv(n, c(step)), [ir.Constant(_F32X16, None)] * n_acc, body)


def _dot_f16(step, ahead):
    """ggml_vec_dot_f16 over the first n (a multiple of `step`) values of a and b, in registers,
    as ggml builds it for AVX-512 (step 64) or AVX2 (step 32); float32. Either array may hold
    float16 bit patterns (uint16), widened as they load. ahead: _dot_f16_accumulators'.
    - AVX-512: 4 accumulators of 16 lanes, fma over steps of 64, summed (0 + 2) + (1 + 3), then
      _mm512_reduce_add_ps's halving tree 16 -> 8 -> 4 and (0 + 2) + (1 + 3).
    - AVX2: 4 accumulators of 8 lanes, fma over steps of 32, summed (0 + 2) + (1 + 3), the two
      halves of the 8 lanes added, then two hadds: (0 + 1) + (2 + 3). Here the four 8-lane
      accumulators are two 16-lane vectors (elements 0-15 and 16-31 of each step)."""
    @intrinsic
    def dot_f16(typingctx, a, a_off, b, b_off, n):
        sig = types.float32(a, types.intp, b, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            acc = _dot_f16_accumulators(context, builder, signature, args, step // 16, ahead)
            if step == 64:
                return _ggml_hsum(builder, builder.fadd(builder.fadd(acc[0], acc[2]), builder.fadd(acc[1], acc[3])))
            s16 = builder.fadd(acc[0], acc[1])  # (0+2)+(1+3) of the 8-lane accumulators
            s4 = _halve(builder, _halve(builder, s16, 8), 4)
            lane = lambda j: builder.extract_element(s4, ir.Constant(_I32, j))  # noqa: E731
            return builder.fadd(builder.fadd(lane(0), lane(1)), builder.fadd(lane(2), lane(3)))

        return sig, codegen

    return dot_f16


dot_f16_64 = _dot_f16(64, 0)
dot_f16_64_ahead = _dot_f16(64, 4096)  # a weight matrix's rows, one after the other (float_matmul)
dot_f16_32 = _dot_f16(32, 0)
dot_f16_32_ahead = _dot_f16(32, 4096)


class _BFloat(ir.Type):
    """LLVM's bfloat (llvmlite's IR builder has no class for it)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_BF16X32 = ir.VectorType(_BFloat(), 32)
_I16X32 = ir.VectorType(ir.IntType(16), 32)


def _hsum_all(builder, vectors):
    """The lane sums of many <16 x float> taken together (or of <8 x float>), each in ggml's
    order: _mm512_reduce_add_ps's (lanes i + i+8, then i + i+4, i + i+2, 0 + 1:
    attention._reduce16) or for 8 lanes its AVX2 hsum's (i + i+4, then i + i+2, 0 + 1: _reduce8).
    At each level two vectors holding L lanes per sum become one holding L/2, the first halves of
    each sum's lanes added to the second halves. Returns [(vector, n)]: vectors of as many sums as
    lanes, in the input order, the last one's first n real (so 24 sums cost 23 vector adds, not 96)."""
    lanes = vectors[0].type.count
    mask = ir.VectorType(_I32, lanes)
    width, level = lanes, [(v, 1) for v in vectors]  # (vector, sums it holds)
    while width > 1:
        half, paired = width // 2, []
        if len(level) % 2:
            level.append((ir.Constant(vectors[0].type, 0.0), 0))
        for (a, n_a), (b, n_b) in zip(level[::2], level[1::2]):
            slots = lanes // width  # sums a vector holds at this level
            firsts = [o * width + j for o in range(2 * slots) for j in range(half)]
            seconds = [i + half for i in firsts]
            lo = builder.shuffle_vector(a, b, ir.Constant(mask, firsts))
            hi = builder.shuffle_vector(a, b, ir.Constant(mask, seconds))
            paired.append((builder.fadd(lo, hi), slots + n_b if n_a == slots else n_a))
        level, width = paired, half
    return level


def _lane_tiles(n_w, n_x, product, n_chain=1, summed=False, ahead=0, lanes=LANES):
    """An intrinsic: accumulators of `lanes` lanes (16, or 8 for AVX2) for n_w weight rows
    (starting at w_at[k]) by n_x activation rows (at x_at[r]), n_chain each, from zero, in
    registers: step i's c-th vector of
    values (at width * (n_chain * i + c)) goes to accumulator c, stored at
    acc[lanes * (n_chain * (n_x * k + r) + c) + j]; summed: each accumulator's hsum (_hsum_all)
    instead, at acc[n_chain * (n_x * k + r) + c]. Each step loads a weight vector once for the
    n_x rows and an activation vector once for the n_w; ahead: it also asks for the weight lines
    `ahead` values further on, into L2 (a matrix's next rows).
    product "fma": tinyBLAS's lanes, `lanes` values a vector, acc = fma(w, x, acc); float32 arrays, or
    float16 (uint16) / bfloat16 (int16) bit patterns widened as they load.
    product "mul_add": the same loads, acc = acc + w * x rounded twice (ggml_vec_dot_bf16's steps).
    product "dpbf16": 32 values a vector of int16 arrays of bfloat16 bit patterns, one vdpbf16ps:
    lane j adds the products of the vector's values 2j + 1 and 2j (exact in float32), with
    ggml's rounding and flushing of subnormals: the instruction llama.cpp's BF16 products take."""
    width = 32 if product == "dpbf16" else lanes
    acc_type = ir.VectorType(_F32, lanes)

    @intrinsic
    def lane_tiles(typingctx, w, w_at, x, x_at, n_steps, acc):
        sig = types.void(w, w_at, x, x_at, types.intp, acc)

        def codegen(context, builder, signature, args):
            w_a, w_at_a, x_a, x_at_a, n, acc_a = args
            c = lambda v: ir.Constant(n.type, v)  # noqa: E731
            if product in ("fma", "mul_add"):
                load = lambda array_type, array, at: _load_f32x16(context, builder, array_type, array, at, lanes)  # noqa: E731
                if product == "fma":
                    step = lambda acc, wv, xv: _fma(builder, wv, xv, acc)  # noqa: E731
                else:
                    step = lambda acc, wv, xv: builder.fadd(builder.fmul(wv, xv), acc)  # noqa: E731
            else:
                dp = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_F32X16, [_F32X16, _BF16X32, _BF16X32]),
                    "llvm.x86.avx512bf16.dpbf16ps.512")

                def load(array_type, array, at):
                    halves = builder.load(_ptr(context, builder, array_type, array, at, _I16X32), align=2)
                    return builder.bitcast(halves, _BF16X32)

                step = lambda acc, wv, xv: builder.call(dp, [acc, wv, xv])  # noqa: E731

            w_starts = _first_values(context, builder, signature.args[1], w_at_a, n_w)
            x_starts = _first_values(context, builder, signature.args[3], x_at_a, n_x)
            w_data = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=w_a).data

            w_per_line = 64 * 8 // signature.args[0].dtype.bitwidth

            def body(i, carried):
                out = list(carried)
                for line in range(0, width * n_chain, w_per_line) if ahead else ():  # the step's lines, ahead
                    for o in w_starts:
                        at = builder.add(builder.mul(i, c(width * n_chain)), c(line + ahead))
                        prefetch_line(builder, builder.gep(w_data, [builder.add(o, at)]), 2)
                for ch in range(n_chain):
                    at = builder.add(builder.mul(i, c(width * n_chain)), c(width * ch))
                    wv = [load(signature.args[0], w_a, builder.add(o, at)) for o in w_starts]
                    xv = [load(signature.args[2], x_a, builder.add(o, at)) for o in x_starts]
                    for k in range(n_w):
                        for r in range(n_x):
                            slot = n_chain * (n_x * k + r) + ch
                            out[slot] = step(out[slot], wv[k], xv[r])
                return out

            sums = _loop(builder, n, [ir.Constant(acc_type, 0.0)] * (n_w * n_x * n_chain), body)
            acc_data = cgutils.create_struct_proxy(signature.args[5])(context, builder, value=acc_a).data
            if summed:
                for g, (v, n_real) in enumerate(_hsum_all(builder, sums)):
                    if n_real == lanes:
                        builder.store(v, _ptr(context, builder, signature.args[5], acc_a, c(lanes * g), acc_type), align=4)
                        continue
                    for j in range(n_real):
                        builder.store(builder.extract_element(v, ir.Constant(_I32, j)),
                                      builder.gep(acc_data, [c(lanes * g + j)]))
                return context.get_dummy_value()
            for k, v in enumerate(sums):
                builder.store(v, _ptr(context, builder, signature.args[5], acc_a, c(lanes * k), acc_type), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lane_tiles


@intrinsic
def widen_f32(typingctx, src, src_off, dst, dst_off, n16):
    """dst[dst_off + i] = src[src_off + i] as float32 for i < 16 * n16: float16 (uint16) or
    bfloat16 (int16) bit patterns widened, 16 a step (exact)."""
    sig = types.void(src, types.intp, dst, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        src_a, src_off_a, dst_a, dst_off_a, n = args
        c = lambda v: ir.Constant(n.type, v)  # noqa: E731

        def body(i, carried):
            at = builder.mul(i, c(LANES))
            v = _load_f32x16(context, builder, signature.args[0], src_a, builder.add(src_off_a, at))
            builder.store(v, _ptr(context, builder, signature.args[2], dst_a, builder.add(dst_off_a, at), _F32X16),
                          align=4)
            return carried

        _loop(builder, n, [], body)
        return context.get_dummy_value()

    return sig, codegen


fma_lanes_2x4 = _lane_tiles(2, 4, "fma", summed=True)
fma_lanes_4x6 = _lane_tiles(4, 6, "fma", summed=True)
# AVX2's 16 vector registers: 12 accumulators of 8 lanes (tinyBLAS's own AVX2 tiles are 4 by 3)
fma8_lanes_4x3 = _lane_tiles(4, 3, "fma", summed=True, lanes=8)
fma8_lanes_2x2 = _lane_tiles(2, 2, "fma", summed=True, lanes=8)
# ggml_vec_dot_bf16 on AVX2 for 2 rows: four accumulators of 8 lanes each, rows asked for 8 KiB ahead
mul_add8_dot_2x4 = _lane_tiles(2, 1, "mul_add", n_chain=4, ahead=4096, lanes=8)
dpbf16_lanes_2x4 = _lane_tiles(2, 4, "dpbf16", summed=True)
dpbf16_lanes_4x6 = _lane_tiles(4, 6, "dpbf16", summed=True)
# ggml_vec_dot_bf16 of 4 rows: two accumulators each over steps of 64, rows asked for 8 KiB ahead
dpbf16_dot_4x2 = _lane_tiles(4, 1, "dpbf16", n_chain=2, summed=True, ahead=4096)
