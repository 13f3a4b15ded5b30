"""One token times one lanes tile (kernels/cpu/lanes.py), all blocks, in ggml's vec_dot
arithmetic (decode's product, and every token of a batch).

For a single token the whole walk over a tile fits in registers, so this intrinsic writes it
as one LLVM loop: per 32-column block b, with the tile's R = 32 rows as 2 x 16 vector lanes,

    lane[l]  = sum_{j<4} code[r, 32b + 4l + j] * x[32b + 4l + j] - offset * n4[8b + l]
               (vpdpbusd started from x_starts[8b + l] = -offset * n4, the activations' code
                sums of each 4 columns: exact int32)
    acc[l]  = fma(d_w[b, r] * d_x[b], float(lane[l]), acc[l])
    summs   = fma(m_w[b, r], s_x[b], summs)                              (formats with a min)

and stores acc (8, R) then summs (R,) to out: the same float steps, in the same order, as
ggml's. Codes are 8, 4 or 5 bits wide; d_w and m_w float16, after each block's codes.
A batch's tokens walk a tile several at a time, with the same float steps for each token: on
AVX2 four, lane pair by lane pair (_token_group); with AVX-512 VNNI two, half the rows a pass
(_token_group_512)."""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import ask_ahead, open_loop, prefetch_line
from .vnni import HAS_VNNI, R, dpbusd, dpbusd8

_I8X64 = ir.VectorType(ir.IntType(8), 64)
_I16X16 = ir.VectorType(ir.IntType(16), 16)
_F16X16 = ir.VectorType(ir.HalfType(), 16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_I32X16 = ir.VectorType(_I32, 16)
_F32X16 = ir.VectorType(_F32, 16)
_I16X8 = ir.VectorType(ir.IntType(16), 8)
_F16X8 = ir.VectorType(ir.HalfType(), 8)
_F32X8 = ir.VectorType(ir.FloatType(), 8)
_I32X8 = ir.VectorType(_I32, 8)
_LANE_BYTES = 4 * R
CODE_BYTES = {8: 8 * _LANE_BYTES, 4: 4 * _LANE_BYTES, 5: 4 * _LANE_BYTES + R * 32 // 8}


def _data(context, builder, array_type, array):
    return cgutils.create_struct_proxy(array_type)(context, builder, value=array).data


def _load(builder, base, offset, vector_type):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), vector_type.as_pointer()), align=1)


def _codes(builder, wp, wb, bits, lane, first, n_rows, c):
    """The stored codes of rows first..first + n_rows - 1 (16 or 8: a half or a quarter of the
    tile) of lane `lane`, in the block at byte wb: <4 n_rows x i8>. lane: a number, or (pair,
    odd) with pair an LLVM value (lane 2 pair + odd, for walks that loop over lane pairs); first:
    a number or an LLVM value, a multiple of 8."""
    pair, odd = (c(lane // 2), lane % 2) if isinstance(lane, int) else lane
    lane_at = builder.add(builder.mul(pair, c(2)), c(odd))  # the lane, as an LLVM value
    first = c(first) if isinstance(first, int) else first
    vector = ir.VectorType(ir.IntType(8), 4 * n_rows)
    at = builder.add(builder.mul(lane_at if bits == 8 else pair, c(_LANE_BYTES)), builder.mul(first, c(4)))
    v = _load(builder, wp, builder.add(wb, at), vector)
    if bits == 8:
        return v
    if odd:
        v = builder.lshr(v, ir.Constant(vector, [4] * 4 * n_rows))
    else:
        v = builder.and_(v, ir.Constant(vector, [15] * 4 * n_rows))
    if bits == 5:  # the fifth bits: 64 per (lane, half), one per code byte of the half
        at = builder.add(builder.add(wb, c(4 * _LANE_BYTES)),
                         builder.add(builder.mul(lane_at, c(16)), builder.lshr(first, c(1))))
        mask = builder.load(builder.bitcast(builder.gep(wp, [at]), ir.IntType(4 * n_rows).as_pointer()), align=1)
        fifth = builder.select(builder.bitcast(mask, ir.VectorType(ir.IntType(1), 4 * n_rows)),
                               ir.Constant(vector, [16] * 4 * n_rows), ir.Constant(vector, [0] * 4 * n_rows))
        v = builder.or_(v, fifth)
    return v


def _splat_to(builder, value, vector_type):
    """value in every lane of vector_type."""
    v = builder.insert_element(ir.Constant(vector_type, None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vector_type, None),
                                  ir.Constant(ir.VectorType(_I32, vector_type.count), [0] * vector_type.count))


def _lane_x(builder, xp, startp, b, xb, lane, offset, c, n, x_at=None):
    """For block b and lane `lane` (a number or an LLVM value): the 4 activation bytes in each
    of n int32 lanes (<4n x i8>), and the dot product's start, -offset * their code sum, as
    lanes.lane_starts stored it at startp (<n x i32>): lane - shift, exactly. offset None: the
    codes need no shift (formats with a min), the start is 0. x_at: the token's first code, if
    not at xp; xb: its block b's index."""
    i32s = ir.VectorType(_I32, n)
    lane = c(lane) if isinstance(lane, int) else lane
    col = builder.add(builder.mul(b, c(32)), builder.mul(lane, c(4)))
    x4 = builder.load(builder.bitcast(builder.gep(xp, [col if x_at is None else builder.add(x_at, col)]),
                                      _I32.as_pointer()), align=1)
    xv = builder.bitcast(_splat_to(builder, x4, i32s), ir.VectorType(ir.IntType(8), 4 * n))
    if offset is None:
        return xv, ir.Constant(i32s, None)
    start = builder.load(builder.gep(startp, [builder.add(builder.mul(xb, c(8)), lane)]))
    return xv, _splat_to(builder, start, i32s)


def _halves8(builder, wp, wb, base, first, c):
    """The float16 scales (base: the block's code bytes) or mins (base: 2 R bytes further) of
    the block at byte wb, for the 8 rows from `first` (an LLVM value), as float."""
    v = _load(builder, wp, builder.add(wb, builder.add(c(base), builder.mul(first, c(2)))), _I16X8)
    return builder.fpext(builder.bitcast(v, _F16X8), _F32X8)


def _dot4(builder, codes, xv, offset, signed):
    """<n x i32> sums of 4 products (code - offset) * x, exactly (codes, xv: <4n x i8>, n = 8 or
    16), on AVX2. signed: as ggml sums signed bytes, vpmaddubsw of |w| and sign(x, w),
    w = code - offset (|w| <= 128 and |x| <= 127 keep its pairs below saturation); else (offset
    0, codes below 128) vpmaddubsw of the codes and x. Then vpmaddwd by ones."""
    n_bytes = codes.type.count
    i8x32, i16x16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16)
    fn = lambda name, ret, n_args: cgutils.get_or_insert_function(  # noqa: E731
        builder.module, ir.FunctionType(ret, n_args), name)
    maddubs = fn("llvm.x86.avx2.pmadd.ub.sw", i16x16, [i8x32, i8x32])
    pmaddwd = fn("llvm.x86.avx2.pmadd.wd", _I32X8, [i16x16, i16x16])
    psign = fn("llvm.x86.avx2.psign.b", i8x32, [i8x32, i8x32])
    absb = fn(f"llvm.abs.v{n_bytes}i8", codes.type, [codes.type, ir.IntType(1)])
    w = a = codes
    if signed:
        w = builder.sub(codes, _splat_to(builder, builder.trunc(offset, ir.IntType(8)), codes.type))
        a = builder.call(absb, [w, ir.Constant(ir.IntType(1), 0)])
    ones = ir.Constant(i16x16, [1] * 16)
    halves = []
    for h in range(n_bytes // 32):
        pick = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * h, 32 * h + 32)))
        part = (lambda v: v) if n_bytes == 32 else (lambda v: builder.shuffle_vector(v, v, pick))  # noqa: E731
        x_part = builder.call(psign, [part(xv), part(w)]) if signed else part(xv)
        halves.append(builder.call(pmaddwd, [builder.call(maddubs, [part(a), x_part]), ones]))
    if len(halves) == 1:
        return halves[0]
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 16), list(range(16))))


def _quarters(builder, fma, wp, xp, xdp, xsp, startp, outp, b_o, n_blk, offset, c, bits, has_min, block_sums):
    """AVX2 (16 vector registers): the tile as 4 passes over its blocks, 8 rows each (a loop,
    not unrolled: one copy of the walk to compile), so that a pass's 8 lane accumulators (+
    summs) stay in registers. Each row's steps are the 32-row walk's, in the same order: the
    same floats."""
    code_bytes = CODE_BYTES[bits]
    block_bytes = code_bytes + 2 * R * (2 if has_min else 1)
    zero_f = ir.Constant(_F32X8, None)

    q, _, end_quarters = open_loop(builder, c(4), [])
    first = builder.mul(q, c(8))  # the quarter's first row
    b, accs, finish = open_loop(builder, n_blk, [zero_f] * (9 if has_min else 8))
    wb = builder.mul(b, c(block_bytes))
    xb = builder.add(b_o, b)
    xd = _splat_to(builder, builder.load(builder.gep(xdp, [xb])), _F32X8)
    dd = builder.fmul(_halves8(builder, wp, wb, code_bytes, first, c), xd)
    news, total = [], None
    for lane in range(8):
        xv, start = _lane_x(builder, xp, startp, b, xb, lane, None if has_min else offset, c, 8)
        lanes = dpbusd8(builder, start, _codes(builder, wp, wb, bits, lane, first, 8, c), xv, small=bits < 8)
        if block_sums:  # the block's exact sum in lane 0's accumulator, the others stay 0
            total = lanes if total is None else builder.add(total, lanes)
            news.append(accs[lane])
        else:
            news.append(builder.call(fma, [dd, builder.sitofp(lanes, _F32X8), accs[lane]]))
    if block_sums:
        news[0] = builder.call(fma, [dd, builder.sitofp(total, _F32X8), accs[0]])
    if has_min:
        xsv = _splat_to(builder, builder.load(builder.gep(xsp, [xb])), _F32X8)
        mins = _halves8(builder, wp, wb, code_bytes + 2 * R, first, c)
        news.append(builder.call(fma, [mins, xsv, accs[8]]))
    for k, res in enumerate(finish(news)):  # lane k's rows 8q.., then the summs
        ptr = builder.bitcast(builder.gep(outp, [builder.add(c(R * k), first)]), _F32X8.as_pointer())
        builder.store(res, ptr, align=4)
    end_quarters([])


def _token_group(builder, fma, wp, xp, xdp, xsp, outp, b_o, n_blk, offset, c, bits, has_min, n_tok):
    """AVX2, n_tok consecutive tokens of a batch against the tile, so that each weight load
    serves every token. A lane's accumulator depends on no other lane's, so the walk goes a
    lane pair at a time, 8 rows a pass (a loop over the 16 (quarter, pair) passes, not
    unrolled): 2 n_tok accumulators stay in registers. Each accumulator takes ggml's fmas,
    block by block, as in _quarters: the same floats. The integer sums take ggml's sign trick
    (_dot4), so a token needs no offset correction; formats with a min have offset 0 and take
    the codes as they are. out (n_tok, 9 R): token k's lane accumulators (lane, row), then its
    summs."""
    code_bytes = CODE_BYTES[bits]
    block_bytes = code_bytes + 2 * R * (2 if has_min else 1)
    i8x32 = ir.VectorType(ir.IntType(8), 32)
    zero_f = ir.Constant(_F32X8, None)
    x_at = [builder.mul(c(32 * k), n_blk) for k in range(n_tok)]
    b_at = [builder.add(b_o, builder.mul(c(k), n_blk)) for k in range(n_tok)]

    def store(res, k, slot, first):  # token k's 8 rows from `first` of accumulator slot (lane, or 8: summs)
        at = builder.add(builder.add(c(9 * R * k), builder.mul(slot, c(R))), first)
        builder.store(res, builder.bitcast(builder.gep(outp, [at]), _F32X8.as_pointer()), align=4)

    def block_x(k, b, vector_type, array):  # token k's value of block b in every lane
        return _splat_to(builder, builder.load(builder.gep(array, [builder.add(b_at[k], b)])), vector_type)

    p, _, end_passes = open_loop(builder, c(16), [])
    pair, first = builder.and_(p, c(3)), builder.mul(builder.lshr(p, c(2)), c(8))  # lanes 2 pair, 2 pair + 1
    b, accs, finish = open_loop(builder, n_blk, [zero_f] * (2 * n_tok))
    wb = builder.mul(b, c(block_bytes))
    dw = _halves8(builder, wp, wb, code_bytes, first, c)
    codes = [builder.bitcast(_codes(builder, wp, wb, bits, (pair, odd), first, 8, c), i8x32) for odd in range(2)]
    news = []
    for k in range(n_tok):
        dd = builder.fmul(dw, block_x(k, b, _F32X8, xdp))
        for odd in range(2):
            lane_x = builder.add(builder.mul(pair, c(8)), c(4 * odd))  # 4 lane: the lane's first column
            x4 = builder.load(builder.bitcast(builder.gep(xp, [builder.add(
                x_at[k], builder.add(builder.mul(b, c(32)), lane_x))]), _I32.as_pointer()), align=1)
            xv = builder.bitcast(_splat_to(builder, x4, _I32X8), i8x32)
            sums = _dot4(builder, codes[odd], xv, offset, not has_min)
            news.append(builder.call(fma, [dd, builder.sitofp(sums, _F32X8), accs[2 * k + odd]]))
    results = finish(news)
    for k in range(n_tok):
        for odd in range(2):
            store(results[2 * k + odd], k, builder.add(builder.mul(pair, c(2)), c(odd)), first)
    end_passes([])
    if has_min:
        q, _, end_quarters = open_loop(builder, c(4), [])
        first = builder.mul(q, c(8))
        b, accs, finish = open_loop(builder, n_blk, [zero_f] * n_tok)
        wb = builder.mul(b, c(block_bytes))
        mw = _halves8(builder, wp, wb, code_bytes + 2 * R, first, c)
        results = finish([builder.call(fma, [mw, block_x(k, b, _F32X8, xsp), accs[k]]) for k in range(n_tok)])
        for k in range(n_tok):
            store(results[k], k, c(8), first)
        end_quarters([])


def _token_group_512(builder, wp, xp, xdp, xsp, startp, outp, b_o, n_blk, offset, c, bits, has_min, n_tok, ahead):
    """AVX-512, n_tok consecutive tokens of a batch against the tile: the walk goes in passes of
    16 // n_tok lanes over one half of the rows (16), so that the n_tok * lanes accumulators
    stay in registers and each code load (and nibble unpacking) serves every token. Each
    accumulator takes the fmas of _one_pass, block by block: the same floats. out as
    _token_group's; ahead as _one_pass's, spread over every pass's blocks."""
    code_bytes = CODE_BYTES[bits]
    block_bytes = code_bytes + 2 * R * (2 if has_min else 1)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3), "llvm.fma.v16f32")
    zero_f = ir.Constant(_F32X16, None)
    n_lanes = 16 // n_tok
    x_at = [builder.mul(c(32 * k), n_blk) for k in range(n_tok)]
    b_at = [builder.add(b_o, builder.mul(c(k), n_blk)) for k in range(n_tok)]

    def store(res, k, slot, first):  # token k's 16 rows from `first` of accumulator slot (lane, or 8: summs)
        at = builder.add(builder.add(c(9 * R * k), builder.mul(slot, c(R))), first)
        builder.store(res, builder.bitcast(builder.gep(outp, [at]), _F32X16.as_pointer()), align=4)

    def block_value(k, b, array):  # token k's value of block b in every lane
        return _splat_to(builder, builder.load(builder.gep(array, [builder.add(b_at[k], b)])), _F32X16)

    p, _, end_passes = open_loop(builder, c(2 * 8 // n_lanes), [])
    half = builder.urem(p, c(2))
    first = builder.mul(half, c(16))  # the pass's rows
    lane0 = builder.mul(builder.udiv(p, c(2)), c(n_lanes))
    lanes_at = [builder.add(lane0, c(j)) for j in range(n_lanes)]
    b, accs, finish = open_loop(builder, n_blk, [zero_f] * (n_tok * n_lanes))
    wb = builder.mul(b, c(block_bytes))
    ask_ahead(builder, ahead, c, builder.mul(n_blk, c(2 * 8 // n_lanes)), builder.add(builder.mul(p, n_blk), b),
              AHEAD_LINES_A_BLOCK)
    dw = builder.fpext(builder.bitcast(_load(builder, wp, builder.add(wb, builder.add(c(code_bytes), builder.mul(
        first, c(2)))), _I16X16), _F16X16), _F32X16)
    codes = [_codes(builder, wp, wb, bits, (builder.udiv(lane, c(2)), j % 2), first, 16, c)
             for j, lane in enumerate(lanes_at)]  # n_lanes is even: lane0 + j has j's parity
    news = []
    for k in range(n_tok):
        dd = builder.fmul(dw, block_value(k, b, xdp))
        xb = builder.add(b_at[k], b)
        for j, lane in enumerate(lanes_at):
            xv, start = _lane_x(builder, xp, startp, b, xb, lane, None if has_min else offset, c, 16, x_at[k])
            sums = dpbusd(builder, start, codes[j], xv, small=bits < 8)
            news.append(builder.call(fma, [dd, builder.sitofp(sums, _F32X16), accs[k * n_lanes + j]]))
    results = finish(news)
    for k in range(n_tok):
        for j, lane in enumerate(lanes_at):
            store(results[k * n_lanes + j], k, lane, first)
    end_passes([])
    if has_min:
        b, accs, finish = open_loop(builder, n_blk, [zero_f] * (2 * n_tok))
        wb = builder.mul(b, c(block_bytes))
        mins = [builder.fpext(builder.bitcast(_load(builder, wp, builder.add(wb, c(code_bytes + 2 * R + 32 * h)),
                                                    _I16X16), _F16X16), _F32X16) for h in range(2)]
        results = finish([builder.call(fma, [mins[h], block_value(k, b, xsp), accs[2 * k + h]])
                          for k in range(n_tok) for h in range(2)])
        for k in range(n_tok):
            for h in range(2):
                store(results[2 * k + h], k, c(8), c(16 * h))


# A lone token's walk over 4- and 5-bit tiles (AVX-512 VNNI) prefetches the weights this far
# ahead (the tiles follow one another, so across tiles too). Its unpacking leaves the core's own
# lookahead about half the bytes in flight that the byte walk has, and the walk read 6-7 GB/s a
# core where the byte walk reads 13. Old and new alternating: Gemma 3's 18 gate/up products
# (cold) 2.94-3.03 -> 1.73-1.83 ms; a SmolLM2 sequence 1.15-1.19x, Gemma 3 1.05x. 2048 and 6144
# bytes did as well as 4096; into L1 (prefetcht0) gained nothing (1.01x); the byte walk (Q8_0
# output products, already at the memory's pace) is left to the hardware prefetcher.
WALK_AHEAD_BYTES = 4096


# A walk asks for at most this many cache lines ahead at each block (a share of a batch's next
# tile: 43 lines a token over 20 blocks for Gemma 3's Q8_0 output tiles at 8 tokens)
AHEAD_LINES_A_BLOCK = 5


def _one_pass(builder, wp, xp, xdp, xsp, startp, outp, b_o, n_blk, offset, c, bits, has_min, block_sums, ahead=None):
    """The tile's 32 rows in one walk over its blocks: 16 accumulators of 16 floats (AVX-512's
    registers; on AVX2 a lone token, and each token of a batch of 2 or 3). ahead: (pointer,
    n_lines), cache lines (the next tile's) asked for into L2 along the walk."""
    code_bytes = CODE_BYTES[bits]
    block_bytes = code_bytes + 2 * R * (2 if has_min else 1)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3), "llvm.fma.v16f32")
    zero_f = ir.Constant(_F32X16, None)
    n_acc = 16 + (2 if has_min else 0)  # [lane][half], then summs halves

    b, accs, finish = open_loop(builder, n_blk, [zero_f] * n_acc)
    wb = builder.mul(b, c(block_bytes))
    if ahead is not None:
        ask_ahead(builder, ahead, c, n_blk, b, AHEAD_LINES_A_BLOCK)
    if HAS_VNNI and bits < 8:  # each block asks for the block WALK_AHEAD_BYTES on into L2
        block_ahead = builder.add(wb, c(WALK_AHEAD_BYTES // block_bytes * block_bytes))
        for k in range(block_bytes // 64):
            prefetch_line(builder, builder.gep(wp, [builder.add(block_ahead, c(64 * k))]), locality=2)

    def halves(at):  # 16 float16 values of this block at byte `at` after the codes, as float
        v = _load(builder, wp, builder.add(wb, c(code_bytes + at)), _I16X16)
        return builder.fpext(builder.bitcast(v, _F16X16), _F32X16)

    xb = builder.add(b_o, b)
    xdv = _splat_to(builder, builder.load(builder.gep(xdp, [xb])), _F32X16)
    dd = [builder.fmul(halves(32 * h), xdv) for h in range(2)]
    news, totals = [], [None, None]
    for lane in range(8):
        xv, start = _lane_x(builder, xp, startp, b, xb, lane, None if has_min else offset, c, 16)
        for h in range(2):
            codes = _codes(builder, wp, wb, bits, lane, 16 * h, 16, c)
            lanes = (_dot4(builder, codes, xv, offset, True) if bits == 8 and not HAS_VNNI
                     else dpbusd(builder, start, codes, xv, small=bits < 8))
            if block_sums:  # the block's exact sum in lane 0's accumulators, the others stay 0
                totals[h] = lanes if totals[h] is None else builder.add(totals[h], lanes)
                news.append(accs[2 * lane + h])
            else:
                news.append(builder.call(fma, [dd[h], builder.sitofp(lanes, _F32X16), accs[2 * lane + h]]))
    if block_sums:
        for h in range(2):
            news[h] = builder.call(fma, [dd[h], builder.sitofp(totals[h], _F32X16), accs[h]])
    if has_min:
        xsv = _splat_to(builder, builder.load(builder.gep(xsp, [xb])), _F32X16)
        for h in range(2):
            news.append(builder.call(fma, [halves(2 * R + 32 * h), xsv, accs[16 + h]]))
    for k, res in enumerate(finish(news)):
        ptr = builder.bitcast(builder.gep(outp, [ir.Constant(_I64, 16 * k)]), _F32X16.as_pointer())
        builder.store(res, ptr, align=4)


def _make(bits: int, has_min: bool, block_sums: bool = False):
    @intrinsic
    def lanes_gemv(typingctx, w, w_off, x, x_off, xd, xs, x_starts, b_off, n_blk, offset, batch, ahead, ahead_at,
                   ahead_lines, out):
        """w: the tile's bytes from w_off; x (int8) from x_off; xd/xs per block and x_starts
        (lanes.lane_starts) per lane from b_off; out (9 * R,) float32. batch: a token of a
        batch (the tile in cache), which AVX2 walks in quarters (_quarters; the same floats).
        With AVX-512 VNNI the walk asks for ahead_lines cache lines of `ahead` (bytes) from
        byte ahead_at into L2 on its way."""
        sig = types.void(w, types.intp, x, types.intp, xd, xs, x_starts, types.intp, types.intp, types.int32,
                         types.boolean, ahead, types.intp, types.intp, out)

        def codegen(context, builder, signature, args):
            (w_a, w_o, x_a, x_o, xd_a, xs_a, st_a, b_o, n_blk, offset, batch, ah_a, ah_o, ah_n, out_a) = args
            a = signature.args
            wp = builder.bitcast(builder.gep(_data(context, builder, a[0], w_a), [w_o]), ir.IntType(8).as_pointer())
            xp = builder.bitcast(builder.gep(_data(context, builder, a[2], x_a), [x_o]), ir.IntType(8).as_pointer())
            xdp, xsp, startp = (_data(context, builder, a[i], v) for i, v in ((4, xd_a), (5, xs_a), (6, st_a)))
            outp = _data(context, builder, a[14], out_a)
            c = lambda v: ir.Constant(w_o.type, v)  # noqa: E731
            tile = (wp, xp, xdp, xsp, startp, outp, b_o, n_blk, offset, c, bits, has_min, block_sums)
            if HAS_VNNI:
                ap = builder.bitcast(builder.gep(_data(context, builder, a[11], ah_a), [ah_o]),
                                     ir.IntType(8).as_pointer())
                _one_pass(builder, *tile, ahead=(ap, ah_n))
                return context.get_dummy_value()
            fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X8, [_F32X8] * 3),
                                                  "llvm.fma.v8f32")
            with builder.if_else(batch) as (in_batch, alone):
                with in_batch:
                    _quarters(builder, fma8, *tile)
                with alone:
                    _one_pass(builder, *tile)
            return context.get_dummy_value()

        return sig, codegen

    return lanes_gemv


# On AVX2 a batch's tokens take _quarters: over SmolLM2's Q4_1 matrices, interleaved, 2 tokens
# 8.1 ms against 8.5 in one pass, 8 tokens 16.9 against 20.0; a lone token (memory-bound) 6.6 in
# one pass against 7.0.
gemv_4, gemv_4_min = _make(4, False), _make(4, True)
# llama.cpp's repacked Q4_0 (q4_0_8x8): one fma per block of its exact sum (out: lane 0, the rest 0)
gemv_4_blocks = _make(4, False, block_sums=True)
gemv_5, gemv_5_min = _make(5, False), _make(5, True)
gemv_8, gemv_8_min = _make(8, False), _make(8, True)


def _make_group(bits: int, has_min: bool, n_tok: int):
    @intrinsic
    def lanes_group(typingctx, w, w_off, x, x_off, xd, xs, x_starts, b_off, n_blk, offset, ahead, ahead_at,
                    ahead_lines, out):
        """n_tok tokens of a batch against the tile at w_off (_token_group_512 with AVX-512
        VNNI, else _token_group), the first's codes from x_off and its xd/xs/x_starts from b_off;
        out (n_tok * 9 R,). ahead, ahead_at, ahead_lines: as lanes_gemv's."""
        sig = types.void(w, types.intp, x, types.intp, xd, xs, x_starts, types.intp, types.intp, types.int32,
                         ahead, types.intp, types.intp, out)

        def codegen(context, builder, signature, args):
            (w_a, w_o, x_a, x_o, xd_a, xs_a, st_a, b_o, n_blk, offset, ah_a, ah_o, ah_n, out_a) = args
            a = signature.args
            wp = builder.bitcast(builder.gep(_data(context, builder, a[0], w_a), [w_o]), ir.IntType(8).as_pointer())
            xp = builder.bitcast(builder.gep(_data(context, builder, a[2], x_a), [x_o]), ir.IntType(8).as_pointer())
            xdp, xsp, startp = (_data(context, builder, a[i], v) for i, v in ((4, xd_a), (5, xs_a), (6, st_a)))
            outp = _data(context, builder, a[13], out_a)
            c = lambda v: ir.Constant(w_o.type, v)  # noqa: E731
            if HAS_VNNI:
                ap = builder.bitcast(builder.gep(_data(context, builder, a[10], ah_a), [ah_o]),
                                     ir.IntType(8).as_pointer())
                _token_group_512(builder, wp, xp, xdp, xsp, startp, outp, b_o, n_blk, offset, c, bits, has_min, n_tok,
                                 (ap, ah_n))
                return context.get_dummy_value()
            fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X8, [_F32X8] * 3),
                                                  "llvm.fma.v8f32")
            _token_group(builder, fma8, wp, xp, xdp, xsp, outp, b_o, n_blk, offset, c, bits, has_min, n_tok)
            return context.get_dummy_value()

        return sig, codegen

    return lanes_group


# Batches walk a tile GROUP_TOKENS tokens at a time (lanes.py). AVX2: two lanes a pass; over
# SmolLM2's Q4_1 matrices and its Q8_0 output product these were the fastest of (lanes, tokens)
# (2, 4), (2, 3), (1, 4), (1, 8), (2, 6), (4, 2); against a token at a time 1.3-1.7x and 1.2-1.3x.
# AVX-512 VNNI: pairs of tokens, eight lanes over half the rows a pass, for 4- and 5-bit codes
# (one unpacking serves both tokens): SmolLM2's Q4_1 matrices 1.16-1.25x a token at a time from
# 2 to 8 tokens, Q5_0/Q5_1 1.1-1.3x below 8 (from 8 the 5-bit tile is widened to bytes); fours
# were no faster, and bytes (Q8_0) were slower than a token at a time (0.6-0.8x).
GROUP_TOKENS = 2 if HAS_VNNI else 4
group_4, group_4_min = _make_group(4, False, GROUP_TOKENS), _make_group(4, True, GROUP_TOKENS)
group_5, group_5_min = _make_group(5, False, GROUP_TOKENS), _make_group(5, True, GROUP_TOKENS)
group_8, group_8_min = _make_group(8, False, GROUP_TOKENS), _make_group(8, True, GROUP_TOKENS)


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
                    builder.store(_codes(builder, wp, wb, 5, lane, 16 * h, 16, c),
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
