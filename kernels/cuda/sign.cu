// Sign compression (reference: gradcomp/kernels/sign.py): pack the bits x >= 0 with the sums
// a compressor needs, and decode bits to two values (optionally adding into an output).
//
// Bit i lives in byte i/8 at bit i%8; a warp packs 32 consecutive elements into one 32-bit
// word with __ballot_sync (lane j -> bit j, little-endian bytes). Sums are accumulated in
// float64 per thread, reduced per block in a fixed order, and each block writes its partial
// sums; sign_reduce (one block) adds the partials in a fixed order, so results do not depend
// on scheduling. Zero counts as positive and NaN as negative, as in the reference.
#include "common.cuh"

#define NSUMS 2  // partial sums per block: s0, s1
#define WORDS_PER_STEP 4  // 32-bit words a warp packs per loop step: 4 loads in flight per lane

enum Stats { STATS_NONE = 0, STATS_SUM = 1, STATS_ABS = 2, STATS_SPLIT = 3 };

__device__ __forceinline__ void store_word(u8* bits, i64 nbytes, i64 w, u32 word) {
  i64 byte = w << 2;
  if (byte + 4 <= nbytes) {
    *reinterpret_cast<u32*>(bits + byte) = word;  // bits is a fresh torch allocation: aligned
  } else {
    for (int j = 0; byte + j < nbytes; ++j) bits[byte + j] = (u8)(word >> (8 * j));
  }
}

// x -> bits and per-block partial sums (NSUMS doubles per block).
template <class T>
__device__ void pack_impl(const T* __restrict__ x, i64 n, u8* __restrict__ bits, double* __restrict__ partial,
                          int stats) {
  __shared__ double scratch[32];
  double s0 = 0.0, s1 = 0.0;
  const i64 words = (n + 31) >> 5, nbytes = (n + 7) >> 3;
  const u32 lane = lane_id();
  const i64 nwarps = thread_count() >> 5;
  for (i64 w0 = (thread_index() >> 5) * WORDS_PER_STEP; w0 < words; w0 += nwarps * WORDS_PER_STEP) {
    float v[WORDS_PER_STEP];
#pragma unroll
    for (int u = 0; u < WORDS_PER_STEP; ++u) {
      i64 i = ((w0 + u) << 5) + lane;
      v[u] = 0.0f;
      if (i < n) v[u] = to_f32(x[i]);
    }
    u32 mine = 0;
#pragma unroll
    for (int u = 0; u < WORDS_PER_STEP; ++u) {
      bool valid = ((w0 + u) << 5) + lane < n;
      u32 word = __ballot_sync(0xffffffffu, valid && v[u] >= 0.0f);
      if (lane == (u32)u) mine = word;
      if (valid) {
        double d = v[u];
        if (stats == STATS_SUM) s0 += d;
        else if (stats == STATS_ABS) s0 += fabs(d);
        else if (stats == STATS_SPLIT) {
          s0 += d < 0.0 ? 0.0 : d;  // clamp(min=0) and clamp(max=0) keep NaN
          s1 += d > 0.0 ? 0.0 : d;
        }
      }
    }
    if (lane < WORDS_PER_STEP && w0 + lane < words) store_word(bits, nbytes, w0 + lane, mine);
  }
  s0 = block_sum(s0, scratch);
  s1 = block_sum(s1, scratch);
  if (threadIdx.x == 0) {
    double* p = partial + (i64)blockIdx.x * NSUMS;
    p[0] = s0;
    p[1] = s1;
  }
}

// Sum of the partials of `nparts` blocks, in a fixed order; valid in thread 0.
__device__ void reduce_partials(const double* __restrict__ partial, int nparts, double tot[NSUMS]) {
  __shared__ double scratch[32];
#pragma unroll
  for (int j = 0; j < NSUMS; ++j) {
    double s = 0.0;
    for (int p = threadIdx.x; p < nparts; p += blockDim.x) s += partial[(i64)p * NSUMS + j];
    tot[j] = block_sum(s, scratch);
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK) sign_reduce(const double* __restrict__ partial, int nparts,
                                                                double* __restrict__ sums, int nsums) {
  double tot[NSUMS];
  reduce_partials(partial, nparts, tot);
  if (threadIdx.x == 0)
    for (int j = 0; j < nsums; ++j) sums[j] = tot[j];
}

// bits -> pos/neg per element, written or added (in fp32, rounded once) into out. A thread
// decodes one byte: 8 elements, stored with 16-byte accesses when out is aligned.
template <class T>
__device__ void unpack_impl(const u8* __restrict__ bits, i64 n, T* __restrict__ out, float pos, float neg, int accumulate) {
  const i64 groups = (n + 7) >> 3;
  const bool vec = aligned16(out);
  for (i64 g = thread_index(); g < groups; g += thread_count()) {
    const u32 byte = bits[g];
    const i64 i0 = g << 3;
    float v[8], prev[8];
    if (accumulate) load8(out, i0, n, vec, prev);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float d = (byte >> j) & 1u ? pos : neg;
      v[j] = accumulate ? prev[j] + d : d;
    }
    store8(out, i0, n, vec, v);
  }
}

#define SIGN_KERNELS(T, S)                                                                                   \
  extern "C" __global__ void __launch_bounds__(BLOCK) sign_pack_##S(const T* __restrict__ x, i64 n,          \
                                                                    u8* __restrict__ bits,                   \
                                                                    double* __restrict__ partial, int stats) { \
    pack_impl<T>(x, n, bits, partial, stats);                                                                \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(BLOCK) sign_unpack_##S(                                       \
      const u8* __restrict__ bits, i64 n, T* __restrict__ out, float pos, float neg, int accumulate) {       \
    unpack_impl<T>(bits, n, out, pos, neg, accumulate);                                                      \
  }

SIGN_KERNELS(float, f32)
SIGN_KERNELS(f16, f16)
SIGN_KERNELS(bf16, bf16)

// Number of set bits of a byte array (onebit's count of x >= 0).
extern "C" __global__ void __launch_bounds__(BLOCK) count_set_bits(const u8* __restrict__ bits, i64 nbytes, i64* __restrict__ total) {
  __shared__ i64 scratch[32];
  i64 c = 0;
  for (i64 i = thread_index(); i < nbytes; i += thread_count()) c += __popc((u32)bits[i]);
  c = block_sum(c, scratch);
  if (threadIdx.x == 0) atomicAdd(reinterpret_cast<u64*>(total), (u64)c);
}
