"""Fitting a quantization scale (and min) to a group of 16 or 32 values: ggml's K-quant helpers.

Scalar ports, bit for bit (ggml-quants.c make_qx_quants, make_q3_quants, make_qkx2_quants):
each takes the group as x[x0:x0+n] and writes its integer codes to L[l0:l0+n].

Lane versions of make_qkx2_quants and make_qx_quants fit all groups of a row at once: the row
is transposed to xt[i, g] (value i of group g) and every loop runs over g innermost, so that
the compiler vectorizes across groups. Each group still sees exactly the scalar code's
operations in the scalar code's order (sums over i stay sequential per lane), so the results
are bit-identical; per-group branches become per-lane selects. One thing the lanes cannot do
is nearest_int's out-of-range path (|v| > 2^22, only reachable with absurd or non-finite
inputs): they count such values instead, and the caller then redoes the row with the scalar
code. Groups the scalar code returns from early (all zero, or constant) are marked inactive.
"""
import math

import numba as nb
import numpy as np

from .quantize_scalar import GROUP_MAX_EPS, _F, _JIT, _JIT_INLINE, _MAGIC, nearest_int

_LO = _F(8388608.0)      # nearest_int's fast path holds for v + MAGIC in [2^23, 2^24)
_HI = _F(16777216.0)
_MAGIC_I = np.int32(12582912)


# ---------------------------------------------------------------------------------------------
# scalar ports: one group
# ---------------------------------------------------------------------------------------------
@nb.njit(**_JIT)
def _make_qx_quants(n, nmax, x, x0, L, l0, rmse_type, qw, w0):
    """Symmetric codes in [0, 2*nmax) with a least-squares scale. Weights: qw[w0:w0+n] when qw
    is not empty (an importance matrix), else from rmse_type (1: x^2, 2: 1, 3: |x|, else
    sqrt|x|). Returns the scale."""
    vmax = _F(0.0)
    amax = _F(0.0)
    for i in range(n):
        ax = abs(x[x0 + i])
        if ax > amax:
            amax = ax
            vmax = x[x0 + i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[l0 + i] = 0
        return _F(0.0)
    fnmax = _F(nmax)
    iscale = _F(-nmax) / vmax
    if rmse_type == 0:
        for i in range(n):
            l = nearest_int(iscale * x[x0 + i])
            L[l0 + i] = nmax + max(-nmax, min(nmax - 1, l))
        return _F(1.0) / iscale
    sumlx = _F(0.0)
    suml2 = _F(0.0)
    for i in range(n):
        xi = x[x0 + i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * xi)))
        L[l0 + i] = l + nmax
        w = qw[w0 + i] if qw.size else _qx_weight(xi, rmse_type)
        fl = _F(l)
        sumlx += w * xi * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != 0 else _F(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + _F(0.1) * _F(step)) / vmax
        sumlx = _F(0.0)
        suml2 = _F(0.0)
        for i in range(n):
            xi = x[x0 + i]
            fl = _F(max(-nmax, min(nmax - 1, nearest_int(iscale * xi))))
            w = qw[w0 + i] if qw.size else _qx_weight(xi, rmse_type)
            sumlx += w * xi * fl
            suml2 += w * fl * fl
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                l = nearest_int(iscale * x[x0 + i])
                L[l0 + i] = nmax + max(-nmax, min(nmax - 1, l))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@nb.njit(**_JIT_INLINE)
def _qx_weight(xi, rmse_type):
    if rmse_type == 1:
        return xi * xi
    if rmse_type == 2:
        return _F(1.0)
    if rmse_type == 3:
        return abs(xi)
    return _F(math.sqrt(abs(xi)))


@nb.njit(**_JIT)
def _make_q3_quants(n, nmax, x, x0, L, l0):
    """make_q3_quants with do_rmse: codes in [0, 2*nmax), refined by coordinate descent."""
    vmax = _F(0.0)
    amax = _F(0.0)
    for i in range(n):
        ax = abs(x[x0 + i])
        if ax > amax:
            amax = ax
            vmax = x[x0 + i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[l0 + i] = 0
        return _F(0.0)
    iscale = _F(-nmax) / vmax
    sumlx = _F(0.0)
    suml2 = _F(0.0)
    for i in range(n):
        xi = x[x0 + i]
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * xi)))
        L[l0 + i] = l
        w = xi * xi
        sumlx += w * xi * _F(l)
        suml2 += w * _F(l) * _F(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            xi = x[x0 + i]
            w = xi * xi
            li = _F(L[l0 + i])
            slx = sumlx - w * xi * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, nearest_int(xi * sl2 / slx)))
                if new_l != L[l0 + i]:
                    slx += w * xi * _F(new_l)
                    sl2 += w * _F(new_l) * _F(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[l0 + i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[l0 + i] += nmax
    return sumlx / suml2 if suml2 > 0 else _F(0.0)


@nb.njit(**_JIT)
def _make_qkx2_quants(n, nmax, x, x0, weights, L, l0, Laux, rmin, rdelta, nstep, use_mad):
    """Asymmetric codes in [0, nmax] with scale and min fitted by weighted least squares over
    nstep+1 trial scales. Returns (scale, the_min) where value ~ scale*L - the_min."""
    vmin = x[x0]
    vmax = x[x0]
    sum_w = weights[0]
    sum_x = sum_w * x[x0]
    for i in range(1, n):
        xi = x[x0 + i]
        if xi < vmin:
            vmin = xi
        if xi > vmax:
            vmax = xi
        w = weights[i]
        sum_w += w
        sum_x += w * xi
    if vmin > 0:
        vmin = _F(0.0)
    if vmax == vmin:
        for i in range(n):
            L[l0 + i] = 0
        return _F(0.0), -vmin
    fnmax = _F(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = _F(1.0) / iscale
    best_error = _F(0.0)
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[x0 + i] - vmin))))
        L[l0 + i] = l
        diff = scale * _F(l) + vmin - x[x0 + i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    if nstep < 1:
        return scale, -vmin
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * _F(step) + fnmax) / (vmax - vmin)
        sum_l = _F(0.0)
        sum_l2 = _F(0.0)
        sum_xl = _F(0.0)
        for i in range(n):
            xi = x[x0 + i]
            l = max(0, min(nmax, nearest_int(iscale * (xi - vmin))))
            Laux[i] = l
            w = weights[i]
            fl = _F(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * xi
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = _F(0.0)
                this_scale = sum_xl / sum_l2
            cur_error = _F(0.0)
            for i in range(n):
                diff = this_scale * _F(Laux[i]) + this_min - x[x0 + i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[l0 + i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@nb.njit(**_JIT)
def _make_qkx3_quants(n, nmax, x, x0, weights, L, l0, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx3_quants (the importance-matrix fits): make_qkx2_quants' search with its own
    guards (max <= min, trial codes clamped before rounding). Returns (scale, the_min)."""
    vmin = x[x0]
    vmax = x[x0]
    sum_w = weights[0]
    sum_x = sum_w * x[x0]
    for i in range(1, n):
        xi = x[x0 + i]
        if xi < vmin:
            vmin = xi
        if xi > vmax:
            vmax = xi
        sum_w += weights[i]
        sum_x += weights[i] * xi
    if vmin > 0:
        vmin = _F(0.0)
    if vmax <= vmin:
        for i in range(n):
            L[l0 + i] = 0
        return _F(0.0), -vmin
    fnmax = _F(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = _F(1.0) / iscale
    best_mad = _F(0.0)
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[x0 + i] - vmin))))
        L[l0 + i] = l
        diff = scale * _F(l) + vmin - x[x0 + i]
        best_mad += weights[i] * (abs(diff) if use_mad else diff * diff)
    if nstep < 1:
        return scale, -vmin
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * _F(step) + fnmax) / (vmax - vmin)
        sum_l = _F(0.0)
        sum_l2 = _F(0.0)
        sum_xl = _F(0.0)
        for i in range(n):
            v = iscale * (x[x0 + i] - vmin)
            l = nearest_int(v if v < fnmax else fnmax) if v > 0 else 0
            Laux[i] = l
            w = weights[i]
            fl = _F(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[x0 + i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = _F(0.0)
                this_scale = sum_xl / sum_l2
            mad = _F(0.0)
            for i in range(n):
                diff = this_scale * _F(Laux[i]) + this_min - x[x0 + i]
                mad += weights[i] * (abs(diff) if use_mad else diff * diff)
            if mad < best_mad:
                for i in range(n):
                    L[l0 + i] = Laux[i]
                best_mad = mad
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@nb.njit(**_JIT)
def _make_qp_quants(n, nmax, x, L, qw):
    """make_qp_quants: codes in [0, nmax] (stored as C's uint8) for the non-negative x (n,)
    with weights qw (n,): a scale search, then coordinate descent. Returns the scale."""
    vmax = _F(0.0)
    for i in range(n):
        vmax = vmax if vmax > x[i] else x[i]           # C's MAX()
    if vmax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return _F(0.0)
    fnmax = _F(nmax)
    iscale = fnmax / vmax
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = _F(1.0) / iscale
    best_mse = _F(0.0)
    for i in range(n):
        diff = x[i] - scale * _F(L[i])
        best_mse += qw[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (_F(0.1) * _F(step) + fnmax) / vmax
        scale_is = _F(1.0) / iscale_is
        mse = _F(0.0)
        for i in range(n):
            l = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * _F(l)
            mse += qw[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = _F(0.0)
    suml2 = _F(0.0)
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        sumlx += qw[i] * x[i] * _F(l)
        suml2 += qw[i] * _F(l) * _F(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w, li = qw[i], _F(L[i])
            slx = sumlx - w * x[i] * li
            sl2 = suml2 - w * li * li
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w * x[i] * _F(new_l)
                    sl2 += w * _F(new_l) * _F(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else _F(0.0)


# ---------------------------------------------------------------------------------------------
# lane versions: every group of a row
# ---------------------------------------------------------------------------------------------
@nb.njit(**_JIT)
def transpose_groups(x, xt):
    """x (G*n,) -> xt (n, G): xt[i, g] = x[g*n + i]."""
    n, G = xt.shape
    for g in range(G):
        for i in range(n):
            xt[i, g] = x[g * n + i]


@nb.njit(**_JIT)
def k4_weights(xt, wt, tmp):
    """Q4_K/Q5_K weights: sqrt(mean(x^2)) of the group + |x|. tmp (G,) float32 scratch."""
    n, G = xt.shape
    for g in range(G):
        tmp[g] = _F(0.0)
    for i in range(n):
        for g in range(G):
            tmp[g] += xt[i, g] * xt[i, g]
    for g in range(G):
        tmp[g] = _F(np.sqrt(tmp[g] / _F(n)))
    for i in range(n):
        for g in range(G):
            wt[i, g] = tmp[g] + abs(xt[i, g])


@nb.njit(**_JIT)
def abs_weights(xt, wt):
    """Q2_K weights: |x|."""
    n, G = xt.shape
    for i in range(n):
        for g in range(G):
            wt[i, g] = abs(xt[i, g])


@nb.njit(**_JIT_INLINE)
def _lane_int(val, active):
    """(nearest_int of the value whose val = v + MAGIC is given, 1 if that value is outside
    the fast path's range and the lane is active, else 0), without branches."""
    in_range = np.int32(val >= _LO) & np.int32(val < _HI)
    return np.int32(val) - _MAGIC_I, active & (np.int32(1) - in_range)


@nb.njit(**_JIT)
def qkx2_lanes(xt, wt, nmax, rmin, rdelta, nstep, use_mad, Lt, Laux, st, active, scale, the_min):
    """make_qkx2_quants for every group: codes to Lt (n, G), scale and the_min to (G,) arrays.
    st: (11, G) float32 and active (G,) int32 scratch. Returns the number of out-of-range
    nearest_int calls (if not 0, the results are not valid: use the scalar code)."""
    n, G = xt.shape
    vmin, vmax, sum_w, sum_x, iscale, best = st[0], st[1], st[2], st[3], st[4], st[5]
    sum_l, sum_l2, sum_xl, cur_scale, cur_min = st[6], st[7], st[8], st[9], st[10]
    fnmax = _F(nmax)
    for g in range(G):
        vmin[g] = xt[0, g]
        vmax[g] = xt[0, g]
        sum_w[g] = wt[0, g]
        sum_x[g] = wt[0, g] * xt[0, g]
    for i in range(1, n):
        for g in range(G):
            xi = xt[i, g]
            vmin[g] = xi if xi < vmin[g] else vmin[g]
            vmax[g] = xi if xi > vmax[g] else vmax[g]
            sum_w[g] += wt[i, g]
            sum_x[g] += wt[i, g] * xi
    for g in range(G):
        vmin[g] = _F(0.0) if vmin[g] > 0 else vmin[g]
        active[g] = np.int32(vmax[g] != vmin[g])
        iscale[g] = fnmax / (vmax[g] - vmin[g])
        scale[g] = _F(1.0) / iscale[g]
        best[g] = _F(0.0)
    n_bad = 0
    for i in range(n):
        for g in range(G):
            l, bad = _lane_int(iscale[g] * (xt[i, g] - vmin[g]) + _MAGIC, active[g])
            n_bad += bad
            l = max(0, min(nmax, l))
            Lt[i, g] = l
            diff = scale[g] * _F(l) + vmin[g] - xt[i, g]
            best[g] += wt[i, g] * (abs(diff) if use_mad else diff * diff)
    for step in range(nstep + 1 if nstep >= 1 else 0):
        for g in range(G):
            iscale[g] = (rmin + rdelta * _F(step) + fnmax) / (vmax[g] - vmin[g])
            sum_l[g] = _F(0.0)
            sum_l2[g] = _F(0.0)
            sum_xl[g] = _F(0.0)
        for i in range(n):
            for g in range(G):
                l, bad = _lane_int(iscale[g] * (xt[i, g] - vmin[g]) + _MAGIC, active[g])
                n_bad += bad
                l = max(0, min(nmax, l))
                Laux[i, g] = l
                w = wt[i, g]
                fl = _F(l)
                sum_l[g] += w * fl
                sum_l2[g] += w * fl * fl
                sum_xl[g] += w * fl * xt[i, g]
        for g in range(G):
            D = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g]
            this_scale = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / D
            this_min = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / D
            if this_min > 0:
                this_min = _F(0.0)
                this_scale = sum_xl[g] / sum_l2[g]
            cur_scale[g] = this_scale
            cur_min[g] = this_min
            iscale[g] = _F(1.0) if D > 0 and active[g] != 0 else _F(0.0)   # reused: "a candidate"
            sum_l[g] = _F(0.0)                                             # reused: its error
        for i in range(n):
            for g in range(G):
                diff = cur_scale[g] * _F(Laux[i, g]) + cur_min[g] - xt[i, g]
                sum_l[g] += wt[i, g] * (abs(diff) if use_mad else diff * diff)
        for g in range(G):
            if iscale[g] != 0 and sum_l[g] < best[g]:
                best[g] = sum_l[g]
                scale[g] = cur_scale[g]
                vmin[g] = cur_min[g]
            else:
                iscale[g] = _F(0.0)
        for i in range(n):
            for g in range(G):
                Lt[i, g] = Laux[i, g] if iscale[g] != 0 else Lt[i, g]
    for g in range(G):
        if active[g] == 0:
            scale[g] = _F(0.0)
            for i in range(n):
                Lt[i, g] = 0
        the_min[g] = -vmin[g]
    return n_bad


@nb.njit(**_JIT)
def qx_lanes(xt, nmax, Lt, st, scale):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, NULL) for every group: codes (0..2*nmax-1)
    to Lt (n, G), scales to (G,). st: (6, G) float32 scratch. Returns the number of
    out-of-range nearest_int calls (if not 0, use the scalar code)."""
    n, G = xt.shape
    vmax, amax, iscale, sumlx, suml2, best = st[0], st[1], st[2], st[3], st[4], st[5]
    fnmax = _F(nmax)
    for g in range(G):
        vmax[g] = _F(0.0)
        amax[g] = _F(0.0)
    for i in range(n):
        for g in range(G):
            ax = abs(xt[i, g])
            bigger = ax > amax[g]
            vmax[g] = xt[i, g] if bigger else vmax[g]
            amax[g] = ax if bigger else amax[g]
    for g in range(G):
        iscale[g] = _F(-nmax) / vmax[g]
        sumlx[g] = _F(0.0)
        suml2[g] = _F(0.0)
    n_bad = 0
    for i in range(n):
        for g in range(G):
            xi = xt[i, g]
            l, bad = _lane_int(iscale[g] * xi + _MAGIC, np.int32(amax[g] >= GROUP_MAX_EPS))
            n_bad += bad
            l = max(-nmax, min(nmax - 1, l))
            Lt[i, g] = l + nmax
            w = xi * xi
            fl = _F(l)
            sumlx[g] += w * xi * fl
            suml2[g] += w * fl * fl
    for g in range(G):
        scale[g] = sumlx[g] / suml2[g] if suml2[g] != 0 else _F(0.0)
        best[g] = scale[g] * sumlx[g]
    for step in range(-9, 10):
        if step == 0:
            continue
        for g in range(G):
            iscale[g] = -(fnmax + _F(0.1) * _F(step)) / vmax[g]
            sumlx[g] = _F(0.0)
            suml2[g] = _F(0.0)
        for i in range(n):
            for g in range(G):
                xi = xt[i, g]
                l, bad = _lane_int(iscale[g] * xi + _MAGIC, np.int32(amax[g] >= GROUP_MAX_EPS))
                n_bad += bad
                fl = _F(max(-nmax, min(nmax - 1, l)))
                w = xi * xi
                sumlx[g] += w * xi * fl
                suml2[g] += w * fl * fl
        any_better = False
        for g in range(G):
            better = suml2[g] > 0 and sumlx[g] * sumlx[g] > best[g] * suml2[g]
            if better:
                scale[g] = sumlx[g] / suml2[g]
                best[g] = scale[g] * sumlx[g]
                any_better = True
            else:
                iscale[g] = _F(0.0)          # marks "keep the codes"
        if any_better:
            for i in range(n):
                for g in range(G):
                    l = max(-nmax, min(nmax - 1, np.int32(iscale[g] * xt[i, g] + _MAGIC) - _MAGIC_I))
                    Lt[i, g] = l + nmax if iscale[g] != 0 else Lt[i, g]
    for g in range(G):
        if amax[g] < GROUP_MAX_EPS:
            scale[g] = _F(0.0)
            for i in range(n):
                Lt[i, g] = 0
    return n_bad
