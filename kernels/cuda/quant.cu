// Quantisation (reference: gradcomp/kernels/quant.py and bits.py): per-block absmax and
// sums of squares, int8 levels with stochastic (uniform draws read from memory) or nearest
// rounding, natural (power-of-two) codes (draws read from memory or made in the kernel from
// the Philox stream of gradcomp.kernels.rng), and decoding of many ranks' payloads (int8
// levels or 2/4-bit codes) into one output.
//
// The rounding follows quant.py exactly: levels are clamp(floor(fma(x, mult_b, u)), -L, L)
// (stochastic) or clamp(rint(x * mult_b), -L, L); a natural code adds floor(u * 2**23) to
// the bits of y and keeps sign and exponent field. Element i of a b-bit code stream is in
// byte i*b/8 at bit (i*b)%8; a thread that handles 8 elements reads exactly b bytes.
#include "philox.cuh"

#define SEGMENT 1024  // elements a warp reduces at most (a block longer is split in segments)

// Segment s of a tensor cut in blocks of bs: [start, stop), spb segments per block.
__device__ __forceinline__ void segment(i64 s, i64 n, i64 bs, i64 spb, i64* start, i64* stop) {
  i64 b = s / spb, p = s - b * spb;
  *start = b * bs + p * SEGMENT;
  *stop = min64(min64(*start + SEGMENT, (b + 1) * bs), n);
}

// Bit pattern of max |x| per segment (NaN: a NaN pattern, larger than inf's). One warp per
// segment; the host takes the max over each block's segments.
template <class T>
__device__ void absmax_impl(const T* __restrict__ x, i64 n, i64 bs, i64 spb, i64 nseg, u32* __restrict__ partial) {
  const u32 lane = lane_id();
  for (i64 s = thread_index() >> 5; s < nseg; s += thread_count() >> 5) {
    i64 a, b;
    segment(s, n, bs, spb, &a, &b);
    u32 m = 0;
#pragma unroll 4
    for (i64 i = a + lane; i < b; i += 32) {
      u32 v = __float_as_uint(to_f32(x[i])) & 0x7fffffffu;
      m = v > m ? v : m;
    }
    for (int off = 16; off > 0; off >>= 1) {
      u32 o = __shfl_xor_sync(0xffffffffu, m, off);
      m = o > m ? o : m;
    }
    if (lane == 0) partial[s] = m;
  }
}

// Sum of squares per segment in float64 (no overflow or underflow of fp32 squares).
template <class T>
__device__ void sumsq_impl(const T* __restrict__ x, i64 n, i64 bs, i64 spb, i64 nseg, double* __restrict__ partial) {
  const u32 lane = lane_id();
  for (i64 s = thread_index() >> 5; s < nseg; s += thread_count() >> 5) {
    i64 a, b;
    segment(s, n, bs, spb, &a, &b);
    double acc = 0.0;
#pragma unroll 4
    for (i64 i = a + lane; i < b; i += 32) {
      double v = to_f32(x[i]);
      acc += v * v;
    }
    acc = warp_sum(acc);
    if (lane == 0) partial[s] = acc;
  }
}

__device__ __forceinline__ int level_of(float x, float m, float u, int stochastic, int levels) {
  float t = stochastic ? floorf(__fmaf_rn(x, m, u)) : rintf(__fmul_rn(x, m));
  float lim = (float)levels;
  t = t < -lim ? -lim : (t > lim ? lim : t);  // NaN stays NaN here ...
  return is_nan(t) ? 0 : (int)t;             // ... and becomes level 0 ("some valid level")
}

// Elementwise kernels work on groups of 8 consecutive elements (one Philox block, one byte
// of 1-bit codes, b bytes of b-bit codes): 8 loads or stores in flight per thread, one
// division for the block index per group, vector accesses when the pointers allow
// (load8 / store8 of common.cuh).
// Block index of element i0 and where the next block starts. 32-bit division when it fits.
__device__ __forceinline__ i64 block_of(i64 i0, i64 bs, i64* next) {
  i64 b = (i0 < 0x100000000ll && bs < 0x100000000ll) ? (i64)((u32)i0 / (u32)bs) : i0 / bs;
  *next = (b + 1) * bs;
  return b;
}

// 8 levels of group g with draws u (ignored unless stochastic) into l[8].
__device__ __forceinline__ void levels8(const float* __restrict__ x, const float* __restrict__ mult, i64 g, i64 n, i64 bs,
                                        int levels, const float u[8], int stochastic, bool vec, int l[8]) {
  float v[8];
  const i64 i0 = g << 3;
  load8(x, i0, n, vec, v);
  i64 next;
  i64 b = block_of(i0, bs, &next);
  float m = mult[b];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (i0 + j == next) {  // i advances by one, so at most one block starts per step
      ++b;
      next += bs;
      m = i0 + j < n ? mult[b] : 0.0f;
    }
    l[j] = level_of(v[j], m, u[j], stochastic, levels);
  }
}

// Levels as int8 from given uniforms u (or nearest rounding): quant.quantize_levels.
extern "C" __global__ void __launch_bounds__(BLOCK) quantize_levels(const float* __restrict__ x, const float* __restrict__ mult,
                                                                    i64 n, i64 bs, int levels, const float* __restrict__ u,
                                                                    int stochastic, i8* __restrict__ q) {
  const i64 groups = (n + 7) >> 3;
  const bool vec = aligned16(x) && aligned16(u);
  for (i64 g = thread_index(); g < groups; g += thread_count()) {
    float r[8];
    if (stochastic) load8(u, g << 3, n, vec, r);
    int l[8];
    levels8(x, mult, g, n, bs, levels, r, stochastic, vec, l);
    u64 packed = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) packed |= (u64)(u8)(i8)l[j] << (8 * j);
    const i64 i0 = g << 3;
    if (i0 + 8 <= n) {
      *reinterpret_cast<u64*>(q + i0) = packed;  // q is a fresh torch allocation: aligned
    } else {
      for (int j = 0; i0 + j < n; ++j) q[i0 + j] = (i8)(packed >> (8 * j));
    }
  }
}

// Natural codes sign << 7 | field of fp32 y rounded to a power of two (quant.natural_codes),
// with uniforms from memory (keyed == 0) or from the stream (k0, k1).
extern "C" __global__ void __launch_bounds__(BLOCK) natural_codes(const float* __restrict__ y, const float* __restrict__ u,
                                                                  i64 n, u64 k0, u64 k1, int keyed, u8* __restrict__ out) {
  const i64 groups = (n + 7) >> 3;
  const bool vec = aligned16(y) && (keyed || aligned16(u));
  for (i64 g = thread_index(); g < groups; g += thread_count()) {
    const i64 i0 = g << 3;
    float r[8], v[8];
    if (keyed) uniform8((u64)g, k0, k1, r);
    else load8(u, i0, n, vec, r);
    load8(y, i0, n, vec, v);
    u64 packed = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      u32 sum = __float_as_uint(v[j]) + (u32)(int)__fmul_rn(r[j], 8388608.0f);  // the mantissa carry rounds up
      packed |= (u64)(((sum >> 23) & 0xffu) | ((sum >> 24) & 0x80u)) << (8 * j);
    }
    if (i0 + 8 <= n) {
      *reinterpret_cast<u64*>(out + i0) = packed;  // out is a fresh torch allocation: aligned
    } else {
      for (int j = 0; i0 + j < n; ++j) out[i0 + j] = (u8)(packed >> (8 * j));
    }
  }
}

// The 8 codes of group g in one payload row (bits 8: int8 levels; 2/4: fields - offset).
__device__ __forceinline__ void levels_of_row(const u8* __restrict__ c, i64 g, i64 n, int bits, int offset, bool vec, int l[8]) {
  const i64 first = g * bits;  // a group's codes are `bits` bytes from here
  const i64 nbytes = (n * bits + 7) >> 3;
  u64 w = 0;
  if (vec && first + bits <= nbytes) {
    if (bits == 8) w = *reinterpret_cast<const u64*>(c + first);
    else if (bits == 4) w = *reinterpret_cast<const u32*>(c + first);
    else w = *reinterpret_cast<const u16*>(c + first);
  } else {
    for (int j = 0; j < bits && first + j < nbytes; ++j) w |= (u64)c[first + j] << (8 * j);
  }
  const u32 mask = (1u << bits) - 1u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    u32 f = (u32)(w >> (j * bits)) & (bits == 8 ? 0xffu : mask);
    l[j] = bits == 8 ? (int)(i8)(u8)f : (int)f - offset;
  }
}

// Many ranks' quantised payloads into one output: out = weight * ((out if accumulate) +
// sum_r level_r * scale_r[block]), fp32 in rank order, one rounding (each rank's scale
// rounded to out's dtype first, as dequantize_levels does). codes: rows x row_bytes;
// scales: rows x row_scales. One row, no accumulation and weight 1: quant.dequantize_levels.
template <class T>
__device__ void dequantize_impl(const u8* __restrict__ codes, i64 row_bytes, int rows, int bits, int offset,
                                const float* __restrict__ scales, i64 row_scales, i64 bs, i64 n, T* __restrict__ out,
                                float weight, int accumulate) {
  const i64 groups = (n + 7) >> 3;
  // row r starts at codes + r * row_bytes: vector loads need every row start aligned too
  const bool vec_in = (reinterpret_cast<u64>(codes) & 7u) == 0 && (row_bytes & 7) == 0;
  const bool vec_out = aligned16(out);
  for (i64 g = thread_index(); g < groups; g += thread_count()) {
    const i64 i0 = g << 3;
    i64 next;
    const i64 b0 = block_of(i0, bs, &next);
    float acc[8];
    for (int r = 0; r < rows; ++r) {
      int l[8];
      levels_of_row(codes + (i64)r * row_bytes, g, n, bits, offset, vec_in, l);
      const float* sr = scales + (i64)r * row_scales;
      i64 b = b0, nx = next;
      float s = to_f32(from_f32<T>(sr[b]));
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (i0 + j == nx) {
          ++b;
          nx += bs;
          s = i0 + j < n ? to_f32(from_f32<T>(sr[b])) : 0.0f;
        }
        float v = __fmul_rn((float)l[j], s);
        acc[j] = r == 0 ? v : acc[j] + v;
      }
    }
    if (accumulate) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = to_f32(out[i0 + j < n ? i0 + j : i0]) + acc[j];
    }
    if (weight != 1.0f) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = acc[j] * weight;
    }
    store8<T>(out, i0, n, vec_out, acc);
  }
}

// Natural codes of many ranks through their 256-entry tables (rows x 256, fp32), 8 codes
// per thread (one 8-byte load per row when the rows are aligned).
template <class T>
__device__ void natural_decode_impl(const u8* __restrict__ codes, i64 n, int rows, const float* __restrict__ tables,
                                    T* __restrict__ out, float weight, int accumulate) {
  const i64 groups = (n + 7) >> 3;
  const bool vec_in = (reinterpret_cast<u64>(codes) & 7u) == 0 && (n & 7) == 0;
  const bool vec_out = aligned16(out);
  for (i64 g = thread_index(); g < groups; g += thread_count()) {
    const i64 i0 = g << 3;
    float acc[8];
    for (int r = 0; r < rows; ++r) {
      const u8* c = codes + (i64)r * n;
      u64 w = 0;
      if (vec_in) w = *reinterpret_cast<const u64*>(c + i0);
      else
        for (int j = 0; j < 8 && i0 + j < n; ++j) w |= (u64)c[i0 + j] << (8 * j);
      const float* t = tables + r * 256;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v = t[(w >> (8 * j)) & 0xffu];
        acc[j] = r == 0 ? v : acc[j] + v;
      }
    }
    if (accumulate) {
      float prev[8];
      load8(out, i0, n, vec_out, prev);
      for (int j = 0; j < 8; ++j) acc[j] = prev[j] + acc[j];
    }
    if (weight != 1.0f)
      for (int j = 0; j < 8; ++j) acc[j] = acc[j] * weight;
    store8(out, i0, n, vec_out, acc);
  }
}

#define QUANT_KERNELS(T, S)                                                                                  \
  extern "C" __global__ void __launch_bounds__(BLOCK) block_absmax_##S(const T* __restrict__ x, i64 n, i64 bs,  \
                                                                       i64 spb, i64 nseg, u32* __restrict__ p) { \
    absmax_impl<T>(x, n, bs, spb, nseg, p);                                                                  \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(BLOCK) block_sumsq_##S(const T* __restrict__ x, i64 n, i64 bs, \
                                                                      i64 spb, i64 nseg,                     \
                                                                      double* __restrict__ p) {              \
    sumsq_impl<T>(x, n, bs, spb, nseg, p);                                                                   \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(BLOCK) dequantize_sum_##S(                                     \
      const u8* __restrict__ codes, i64 row_bytes, int rows, int bits, int offset,                           \
      const float* __restrict__ scales, i64 row_scales, i64 bs, i64 n, T* __restrict__ out, float weight,    \
      int accumulate) {                                                                                      \
    dequantize_impl<T>(codes, row_bytes, rows, bits, offset, scales, row_scales, bs, n, out, weight,         \
                       accumulate);                                                                          \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(BLOCK) natural_decode_sum_##S(                                \
      const u8* __restrict__ codes, i64 n, int rows, const float* __restrict__ tables, T* __restrict__ out,  \
      float weight, int accumulate) {                                                                        \
    natural_decode_impl<T>(codes, n, rows, tables, out, weight, accumulate);                                 \
  }

QUANT_KERNELS(float, f32)
QUANT_KERNELS(f16, f16)
QUANT_KERNELS(bf16, bf16)
