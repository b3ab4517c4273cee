// Sparse to dense (reference: gradcomp/kernels/sparse.py): out[idx[j]] += val[j], repeats
// summed, after checking every index.
//
// scatter_range computes min and max of the indices; scatter_add then runs only if all of
// them lie in [0, n) (it reads the range itself, so a bad index never causes a write and
// the host need not wait in between). The caller reads the range back afterwards to raise
// its error. 16-bit outputs are added with a compare-and-swap on the aligned 32-bit word.
#include "common.cuh"

template <class I>
__device__ void range_impl(const I* __restrict__ idx, i64 m, i64* __restrict__ range) {
  __shared__ i64 s_lo[32], s_hi[32];
  i64 lo = 0x7fffffffffffffffll, hi = -0x7fffffffffffffffll - 1;
  for (i64 j = thread_index(); j < m; j += thread_count()) {
    i64 v = (i64)idx[j];
    lo = min64(lo, v);
    hi = max64(hi, v);
  }
  for (int off = 16; off > 0; off >>= 1) {
    lo = min64(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    hi = max64(hi, __shfl_xor_sync(0xffffffffu, hi, off));
  }
  if (lane_id() == 0) {
    s_lo[warp_id()] = lo;
    s_hi[warp_id()] = hi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (u32 w = 1; w < (blockDim.x >> 5); ++w) {
      lo = min64(lo, s_lo[w]);
      hi = max64(hi, s_hi[w]);
    }
    atomicMin(range, lo);
    atomicMax(range + 1, hi);
  }
}

__device__ __forceinline__ void add_to(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void add_to(double* p, double v) { atomicAdd(p, v); }

template <class H>
__device__ __forceinline__ void add_half(H* p, float v) {
  u64 addr = reinterpret_cast<u64>(p);
  u32* word = reinterpret_cast<u32*>(addr & ~(u64)3);
  const u32 shift = (addr & 2) ? 16u : 0u;
  u32 old = *word, assumed;
  do {
    assumed = old;
    H h;
    h.bits = (u16)(assumed >> shift);
    u32 sum = from_f32<H>(to_f32(h) + v).bits;
    old = atomicCAS(word, assumed, (assumed & ~(0xffffu << shift)) | (sum << shift));
  } while (old != assumed);
}
__device__ __forceinline__ void add_to(f16* p, f16 v) { add_half(p, to_f32(v)); }
__device__ __forceinline__ void add_to(bf16* p, bf16 v) { add_half(p, to_f32(v)); }

template <class T, class I>
__device__ void scatter_impl(T* __restrict__ out, i64 n, const I* __restrict__ idx, const T* __restrict__ val, i64 m,
                             const i64* __restrict__ range) {
  if (range[0] < 0 || range[1] >= n) return;  // a bad index: write nothing
  for (i64 j = thread_index(); j < m; j += thread_count()) add_to(out + (i64)idx[j], val[j]);
}

#define SCATTER(T, S, I, SI)                                                                              \
  extern "C" __global__ void __launch_bounds__(BLOCK) scatter_add_##S##_##SI(                               \
      T* __restrict__ out, i64 n, const I* __restrict__ idx, const T* __restrict__ val, i64 m,            \
      const i64* __restrict__ range) {                                                                    \
    scatter_impl<T, I>(out, n, idx, val, m, range);                                                       \
  }
#define SCATTER_ALL(I, SI)  \
  SCATTER(float, f32, I, SI)  \
  SCATTER(double, f64, I, SI) \
  SCATTER(f16, f16, I, SI)    \
  SCATTER(bf16, bf16, I, SI)  \
  extern "C" __global__ void __launch_bounds__(BLOCK) scatter_range_##SI(const I* __restrict__ idx, i64 m, i64* __restrict__ range) { \
    range_impl<I>(idx, m, range);                                                                         \
  }

SCATTER_ALL(int, i32)
SCATTER_ALL(i64, i64)
