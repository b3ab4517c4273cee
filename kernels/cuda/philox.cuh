// Philox4x64-10 exactly as numpy's np.random.Philox draws it, so a CUDA kernel and
// gradcomp.kernels.rng.uniform give the same numbers for the same 128-bit key.
//
// numpy starts from counter 0 and increments the counter *before* each block, so block b of
// the stream (64-bit outputs 4b .. 4b+3) is philox(counter = b + 1, key). Each 64-bit output
// gives two uint32, low half first, and uniform float32 number j is (u32[j] >> 8) * 2**-24.
// Float j therefore comes from block j / 8: one Philox call makes 8 consecutive floats.
#ifndef GRADCOMP_PHILOX_CUH
#define GRADCOMP_PHILOX_CUH

#include "common.cuh"

// 32 x 32 -> 64-bit product in one instruction (IMAD.WIDE.U32); NVVM turns the C form into
// a 64-bit multiply of zero-extended operands.
__device__ __forceinline__ u64 mul_wide(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
  u64 r;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
  return r;
#else
  return (u64)a * b;
#endif
}

// Full 128-bit product of a and the constant b: four 32x32->64 multiplies shared by both
// halves (mul.hi.u64 and mul.lo.u64 separately would repeat some); Philox is bound by the
// integer multiply pipe.
__device__ __forceinline__ void mulhilo64(u64 a, u64 b, u64* hi, u64* lo) {
  const u32 al = (u32)a, ah = (u32)(a >> 32), bl = (u32)b, bh = (u32)(b >> 32);
  const u64 p0 = mul_wide(al, bl), p1 = mul_wide(al, bh), p2 = mul_wide(ah, bl), p3 = mul_wide(ah, bh);
  const u64 mid = (p0 >> 32) + (u32)p1 + (u32)p2;  // < 3 * 2**32: no overflow
  *lo = (mid << 32) | (u32)p0;
  *hi = p3 + (p1 >> 32) + (p2 >> 32) + (mid >> 32);
}

__device__ __forceinline__ void philox4x64_10(u64 counter, u64 k0, u64 k1, u64 out[4]) {
  u64 c0 = counter, c1 = 0, c2 = 0, c3 = 0;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += 0x9E3779B97F4A7C15ull;
      k1 += 0xBB67AE8584CAA73Bull;
    }
    u64 hi0, lo0, hi1, lo1;
    mulhilo64(c0, 0xD2E7470EE14C6C93ull, &hi0, &lo0);
    mulhilo64(c2, 0xCA5A826395121157ull, &hi1, &lo1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// Uniform float32 numbers 8*block .. 8*block+7 of the stream with key (k0 low, k1 high).
__device__ __forceinline__ void uniform8(u64 block, u64 k0, u64 k1, float u[8]) {
  u64 r[4];
  philox4x64_10(block + 1, k0, k1, r);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u[2 * j] = (float)((u32)r[j] >> 8) * 5.9604644775390625e-08f;
    u[2 * j + 1] = (float)((u32)(r[j] >> 32) >> 8) * 5.9604644775390625e-08f;
  }
}

#endif  // GRADCOMP_PHILOX_CUH
