"""The numba loops behind :mod:`gradcomp.kernels.cpu` (imported by it on first use only: this
module imports numba). Plain loops over numpy arrays, no fast-math: IEEE results, the same
bits as the torch ops they replace; cached on disk (``cache=True``), so a process loads them
instead of compiling them.
"""
from typing import Any, Tuple

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_DEBRUIJN = 0x03F79D71B4CB0A89  # a de Bruijn sequence of order 6: (lowest bit * it) >> 58 names the bit
debruijn = np.uint64(_DEBRUIJN)
lowest = np.zeros(64, dtype=np.int64)  # de Bruijn slot -> bit position
for _i in range(64):
    lowest[((_DEBRUIJN << _i) & (2**64 - 1)) >> 58] = _i


@_jit
def lanes(v: float, mode: int) -> Tuple[float, float]:
    # what element v adds to the two sums; NaN lands in both (as torch.clamp keeps it)
    if mode == 1:
        return v, 0.0
    if mode == 2:
        return abs(v), 0.0
    return (v if not v < 0.0 else 0.0), (v if not v > 0.0 else 0.0)


@_jit
def one_lane(v: float, mode: int) -> float:
    # lanes(v, mode)[0] for modes 1 and 2, whose second sum is always 0.0 (measured on 25.5M
    # elements: the pack with |x|'s sum 28.7 -> 17.3 ms without the second sum's additions)
    return abs(v) if mode == 2 else v


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def block_word(a: Any, b: Any, x: Any, base: int, add: bool) -> Any:
    # the 64 elements from base: x = a + b first with ``add``; their signs (x >= 0) as one word
    # (inlined in numba's IR: called, the packs measured twice as slow)
    if add:
        for i in range(base, base + 64):
            x[i] = a[i] + b[i]
    word = np.uint64(0)
    for i in range(64):
        word |= np.uint64(x[base + i] >= 0) << np.uint64(i)
    return word


@numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def pack_tail(a: Any, b: Any, x: Any, bits: Any, words: int, mode: int, add: bool, p0: float,
              q0: float) -> Tuple[float, float]:
    # the elements after the last whole 64-block, one byte of bits at a time, their sums added
    # to the first lanes in order: (p0, q0) after them
    n = x.size
    for k in range(words * 8, bits.size):
        b8 = np.uint8(0)
        for i in range(8 * k, min(8 * k + 8, n)):
            if add:
                x[i] = a[i] + b[i]
            b8 |= np.uint8(x[i] >= 0) << np.uint8(i - 8 * k)
            if mode != 0:
                u, c = lanes(np.float64(x[i]), mode)
                p0 += u
                q0 += c
        bits[k] = b8
    return p0, q0


@_jit
def pack(x: Any, bits: Any, mode: int) -> Tuple[float, float]:
    return pack_sum(x, x, x, bits, mode, False)


@_jit
def pack_sum(a: Any, b: Any, x: Any, bits: Any, mode: int, add: bool) -> Tuple[float, float]:
    # with ``add``, x = a + b first, 64 elements at a time (still in L1 when they are packed):
    # error feedback's sum and the pack in one pass over memory; without, x alone is read
    if mode == 3:
        return pack_split(a, b, x, bits, add)
    n = x.size
    words = n // 64
    w = bits[:words * 8].view(np.uint64)
    # 8 float64 lanes per sum, added in a fixed order: the same sums on every machine; written
    # out as scalars, which stay in registers (an array of 8 lanes measured ~20 % slower)
    p0 = p1 = p2 = p3 = p4 = p5 = p6 = p7 = 0.0
    q0 = q1 = q2 = q3 = q4 = q5 = q6 = q7 = 0.0
    for j in range(words):
        base = 64 * j
        w[j] = block_word(a, b, x, base, add)
        if mode == 1 or mode == 2:  # one sum: the other stays +0.0 (adding +0.0 would not move it)
            for i in range(base, base + 64, 8):
                p0 += one_lane(np.float64(x[i]), mode)
                p1 += one_lane(np.float64(x[i + 1]), mode)
                p2 += one_lane(np.float64(x[i + 2]), mode)
                p3 += one_lane(np.float64(x[i + 3]), mode)
                p4 += one_lane(np.float64(x[i + 4]), mode)
                p5 += one_lane(np.float64(x[i + 5]), mode)
                p6 += one_lane(np.float64(x[i + 6]), mode)
                p7 += one_lane(np.float64(x[i + 7]), mode)
        elif mode != 0:
            for i in range(base, base + 64, 8):
                u, c = lanes(np.float64(x[i]), mode)
                p0 += u
                q0 += c
                u, c = lanes(np.float64(x[i + 1]), mode)
                p1 += u
                q1 += c
                u, c = lanes(np.float64(x[i + 2]), mode)
                p2 += u
                q2 += c
                u, c = lanes(np.float64(x[i + 3]), mode)
                p3 += u
                q3 += c
                u, c = lanes(np.float64(x[i + 4]), mode)
                p4 += u
                q4 += c
                u, c = lanes(np.float64(x[i + 5]), mode)
                p5 += u
                q5 += c
                u, c = lanes(np.float64(x[i + 6]), mode)
                p6 += u
                q6 += c
                u, c = lanes(np.float64(x[i + 7]), mode)
                p7 += u
                q7 += c
    p0, q0 = pack_tail(a, b, x, bits, words, mode, add, p0, q0)
    return ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7))


@_jit
def pack_split(a: Any, b: Any, x: Any, bits: Any, add: bool) -> Tuple[float, float]:
    # pack_sum's mode 3 (the positive and the negative parts' sums), the same additions in the
    # same order, its 8 lanes per sum in two small arrays walked by an inner loop of 8 (on 25.5M
    # elements 40.2 -> 34.6 ms against pack_sum's scalar lanes, which suit its one-sum modes)
    n = x.size
    words = n // 64
    w = bits[:words * 8].view(np.uint64)
    p = np.zeros(8)
    q = np.zeros(8)
    for j in range(words):
        base = 64 * j
        w[j] = block_word(a, b, x, base, add)
        for g in range(base, base + 64, 8):
            for k in range(8):
                v = np.float64(x[g + k])
                p[k] += v if not v < 0.0 else 0.0
                q[k] += v if not v > 0.0 else 0.0
    p[0], q[0] = pack_tail(a, b, x, bits, words, 3, add, p[0], q[0])
    return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7])), \
        ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]))


@_jit
def decode(bits: Any, table: Any, out: Any, accumulate: bool) -> None:
    n = out.size
    full = n // 8
    for j in range(full):
        row = table[bits[j]]
        base = 8 * j
        if accumulate:
            for i in range(8):
                out[base + i] += row[i]
        else:
            for i in range(8):
                out[base + i] = row[i]
    if full * 8 < n:
        row = table[bits[full]]
        for i in range(full * 8, n):
            if accumulate:
                out[i] += row[i - full * 8]
            else:
                out[i] = row[i - full * 8]


@_jit
def at_least(bits: Any, key: Any, mask: Any, out: Any) -> int:
    # 64 branch-free compares into a word (a loop the compiler vectorises), then only its
    # set bits, lowest first (de Bruijn: the position of the lowest set bit)
    n = bits.size
    found = 0
    words = n // 64
    for j in range(words):
        base = 64 * j
        w = np.uint64(0)
        for i in range(64):
            w |= np.uint64((bits[base + i] & mask) >= key) << np.uint64(i)
        found = positions(w, base, out, found)
    for i in range(64 * words, n):
        if (bits[i] & mask) >= key:
            found = positions(np.uint64(1), i, out, found)
    return found


@_jit
def positions(w: Any, base: int, out: Any, found: int) -> int:
    # the set bits of word w, lowest first, as base + bit into out from out[found] on (those
    # beyond its size only counted); the new count
    cap = out.size
    while w:
        low = w & (~w + np.uint64(1))
        if found < cap:
            out[found] = base + lowest[(low * debruijn) >> np.uint64(58)]
        found += 1
        w ^= low
    return found


@_jit
def at_least_sum(a: Any, b: Any, x: Any, t: float, out: Any) -> int:
    # x = a + b, 64 at a time, and at_least's positions of the sum (|x| >= t or NaN, t >= 0),
    # compared as floats: for t >= 0 the same set as at_least's compare of the bits
    n = x.size
    found = 0
    words = n // 64
    for j in range(words):
        base = 64 * j
        for i in range(base, base + 64):
            x[i] = a[i] + b[i]
        w = np.uint64(0)
        for i in range(64):
            w |= np.uint64(not abs(x[base + i]) < t) << np.uint64(i)
        found = positions(w, base, out, found)
    for i in range(64 * words, n):
        x[i] = a[i] + b[i]
        if not abs(x[i]) < t:
            found = positions(np.uint64(1), i, out, found)
    return found


@_jit
def take_and_clear(flat: Any, idx: Any, values: Any) -> None:
    for j in range(idx.size):
        v = flat[idx[j]]
        values[j] = v
        flat[idx[j]] = v - v


@_jit
def decode_mean(bits: Any, tables: Any, out: Any, divisor: Any) -> None:
    # out = (((row_0 + row_1) + ...) + row_{R-1}) / divisor: the sum in rank order, as decoding
    # each payload into out in turn and dividing once gives it; a byte's 8 elements at a time
    n = out.size
    full = n // 8
    ranks = bits.shape[0]
    for j in range(full):
        base = 8 * j
        b0 = bits[0, j]
        if ranks == 2:  # the common case, with its row reads unrolled
            b1 = bits[1, j]
            for i in range(8):
                out[base + i] = (tables[0, b0, i] + tables[1, b1, i]) / divisor
            continue
        for i in range(8):
            out[base + i] = tables[0, b0, i]
        for r in range(1, ranks):
            br = bits[r, j]
            for i in range(8):
                out[base + i] += tables[r, br, i]
        for i in range(8):
            out[base + i] /= divisor
    for k in range(8 * full, n):
        v = tables[0, bits[0, full], k - 8 * full]
        for r in range(1, ranks):
            v += tables[r, bits[r, full], k - 8 * full]
        out[k] = v / divisor


@_jit
def decode_pair(b0: Any, b1: Any, lut: Any, out: Any) -> None:
    # two ranks' sign bits into their mean: an element's value depends on its two bits only,
    # so a 16 x 16 table of nibble pairs (4 values each, 4 KB) gives 4 elements per look-up
    # (built by the caller with the arithmetic of decode_mean: the same bits)
    n = out.size
    full = n // 8
    for j in range(full):
        x0 = np.int64(b0[j])
        x1 = np.int64(b1[j])
        lo = ((x0 & 15) << 4) | (x1 & 15)
        hi = (x0 & 240) | (x1 >> 4)
        base = 8 * j
        for i in range(4):
            out[base + i] = lut[lo, i]
        for i in range(4):
            out[base + 4 + i] = lut[hi, i]
    for k in range(8 * full, n):
        i = k - 8 * full
        shift = 4 * (i >> 2)
        x0 = (np.int64(b0[full]) >> shift) & 15
        x1 = (np.int64(b1[full]) >> shift) & 15
        out[k] = lut[(x0 << 4) | x1, i & 3]


@_jit
def sparse_mean(indices: Any, values: Any, starts: Any, out: Any, divisor: Any) -> int:
    # out is zero; payload r holds indices[starts[r]:starts[r + 1]] (strictly increasing) and
    # values alike. A merge of the R sorted runs visits each position once, adds its values in
    # rank order onto 0 (as scattering each payload into zeros in turn does) and divides.
    # Returns how many of the values written are not finite.
    ranks = starts.size - 1
    pos = starts[:-1].copy()
    bad = 0
    while True:
        low = -1
        for r in range(ranks):
            if pos[r] < starts[r + 1] and (low < 0 or indices[pos[r]] < low):
                low = indices[pos[r]]
        if low < 0:
            return bad
        acc = out[low]  # +0.0
        for r in range(ranks):
            if pos[r] < starts[r + 1] and indices[pos[r]] == low:
                acc += values[pos[r]]
                pos[r] += 1
        v = acc / divisor
        out[low] = v
        if not np.isfinite(v):
            bad += 1
