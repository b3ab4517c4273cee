// Shared by every gradcomp kernel: fixed-width types, fp16/bf16 load and store, warp and
// block reductions and scans. No system header is included: NVRTC compiles these sources
// without the CUDA runtime headers. Kernels need blockDim.x to be a multiple of 32, at most
// 1024, and every thread of a block to reach each block-wide helper (no early return).
#ifndef GRADCOMP_COMMON_CUH
#define GRADCOMP_COMMON_CUH

// Threads per block of every kernel (but the one-block kernels of select.cu): each declares
// it in __launch_bounds__, and the launchers (kernels/_launch_*.py) read it from here.
#define BLOCK 256

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;

// 16-byte vectors for 128-bit loads and stores (our own, so no CUDA header is assumed).
struct alignas(16) f32x4 { float x, y, z, w; };
struct alignas(16) u32x4 { u32 x, y, z, w; };

// 16-bit floats travel as their bit patterns; arithmetic is always done in fp32.
struct f16 { u16 bits; };
struct bf16 { u16 bits; };

#ifdef __CUDA_ARCH__  // the CPU emulation used by the tests supplies these two
__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
#endif

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(f16 v) { return f16_bits_to_f32(v.bits); }
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float((u32)v.bits << 16); }

// Round to the storage type to nearest even, as torch does (NaN stays NaN).
template <class T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ f16 from_f32<f16>(float v) {
  f16 r;
  r.bits = f32_to_f16_bits(v);
  return r;
}
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) {
  u32 b = __float_as_uint(v);
  bf16 r;
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    r.bits = 0x7fc0;
  } else {
    r.bits = (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
  return r;
}

__device__ __forceinline__ bool is_nan(float v) { return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u; }
__device__ __forceinline__ bool is_finite(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 max64(i64 a, i64 b) { return a > b ? a : b; }

// First global thread index and number of threads of a 1-D grid, in 64 bits.
__device__ __forceinline__ i64 thread_index() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 thread_count() { return (i64)gridDim.x * blockDim.x; }
__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31u; }
__device__ __forceinline__ u32 warp_id() { return threadIdx.x >> 5; }

template <class T> __device__ __forceinline__ T warp_sum(T v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;  // complete in lane 0
}

// Sum over the block in a fixed order (deterministic); the result is valid in thread 0.
// scratch: 32 shared elements. Ends with a barrier, so scratch may be reused at once.
template <class T> __device__ T block_sum(T v, T* scratch) {
  v = warp_sum(v);
  if (lane_id() == 0) scratch[warp_id()] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x >> 5) ? scratch[threadIdx.x] : T(0);
  if (warp_id() == 0) v = warp_sum(v);
  __syncthreads();
  return v;
}

// Exclusive prefix sum over the block in thread order; *total gets the block's sum in every
// thread. scratch: 33 shared elements. Ends with a barrier.
template <class T> __device__ T block_exclusive_scan(T v, T* scratch, T* total) {
  T inc = v;
  for (int off = 1; off < 32; off <<= 1) {
    T up = __shfl_up_sync(0xffffffffu, inc, off);
    if ((int)lane_id() >= off) inc += up;
  }
  if (lane_id() == 31) scratch[warp_id()] = inc;
  __syncthreads();
  if (warp_id() == 0) {
    T w = threadIdx.x < (blockDim.x >> 5) ? scratch[threadIdx.x] : T(0);
    T winc = w;
    for (int off = 1; off < 32; off <<= 1) {
      T up = __shfl_up_sync(0xffffffffu, winc, off);
      if ((int)lane_id() >= off) winc += up;
    }
    scratch[threadIdx.x] = winc - w;
    if (threadIdx.x == 31) scratch[32] = winc;
  }
  __syncthreads();
  T result = scratch[warp_id()] + inc - v;
  *total = scratch[32];
  __syncthreads();
  return result;
}

// ---- groups of 8 consecutive elements: 16-byte accesses when the pointer allows ----------
__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<u64>(p) & 15u) == 0; }

// 8 values of type T at out[i0..] (fp32 in v), 16-byte stores when out is aligned.
template <class T> __device__ __forceinline__ void store8(T* __restrict__ out, i64 i0, i64 n, bool vec, const float v[8]);
template <> __device__ __forceinline__ void store8<float>(float* __restrict__ out, i64 i0, i64 n, bool vec, const float v[8]) {
  if (vec && i0 + 8 <= n) {
    f32x4* p = reinterpret_cast<f32x4*>(out + i0);
    p[0] = f32x4{v[0], v[1], v[2], v[3]};
    p[1] = f32x4{v[4], v[5], v[6], v[7]};
  } else {
    for (int j = 0; j < 8 && i0 + j < n; ++j) out[i0 + j] = v[j];
  }
}
template <class H> __device__ __forceinline__ void store8_half(H* __restrict__ out, i64 i0, i64 n, bool vec, const float v[8]) {
  if (vec && i0 + 8 <= n) {
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = (u32)from_f32<H>(v[2 * j]).bits | ((u32)from_f32<H>(v[2 * j + 1]).bits << 16);
    *reinterpret_cast<u32x4*>(out + i0) = u32x4{w[0], w[1], w[2], w[3]};
  } else {
    for (int j = 0; j < 8 && i0 + j < n; ++j) out[i0 + j] = from_f32<H>(v[j]);
  }
}
template <> __device__ __forceinline__ void store8<f16>(f16* __restrict__ out, i64 i0, i64 n, bool vec, const float v[8]) {
  store8_half(out, i0, n, vec, v);
}
template <> __device__ __forceinline__ void store8<bf16>(bf16* __restrict__ out, i64 i0, i64 n, bool vec, const float v[8]) {
  store8_half(out, i0, n, vec, v);
}

// 8 values of type T from p[i0..] as fp32 (zeros past n).
template <class T> __device__ __forceinline__ void load8(const T* __restrict__ p, i64 i0, i64 n, bool vec, float v[8]) {
  for (int j = 0; j < 8; ++j) v[j] = i0 + j < n ? to_f32(p[i0 + j]) : 0.0f;
}
template <> __device__ __forceinline__ void load8<float>(const float* __restrict__ p, i64 i0, i64 n, bool vec, float v[8]) {
  if (vec && i0 + 8 <= n) {
    const f32x4* q = reinterpret_cast<const f32x4*>(p + i0);
    f32x4 a = q[0], b = q[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    for (int j = 0; j < 8; ++j) v[j] = i0 + j < n ? p[i0 + j] : 0.0f;
  }
}
template <class H> __device__ __forceinline__ void load8_half(const H* __restrict__ p, i64 i0, i64 n, bool vec, float v[8]) {
  if (vec && i0 + 8 <= n) {
    u32x4 w = *reinterpret_cast<const u32x4*>(p + i0);
    const u32 words[4] = {w.x, w.y, w.z, w.w};
    for (int j = 0; j < 4; ++j) {
      H lo, hi;
      lo.bits = (u16)words[j];
      hi.bits = (u16)(words[j] >> 16);
      v[2 * j] = to_f32(lo);
      v[2 * j + 1] = to_f32(hi);
    }
  } else {
    for (int j = 0; j < 8; ++j) v[j] = i0 + j < n ? to_f32(p[i0 + j]) : 0.0f;
  }
}
template <> __device__ __forceinline__ void load8<f16>(const f16* __restrict__ p, i64 i0, i64 n, bool vec, float v[8]) {
  load8_half(p, i0, n, vec, v);
}
template <> __device__ __forceinline__ void load8<bf16>(const bf16* __restrict__ p, i64 i0, i64 n, bool vec, float v[8]) {
  load8_half(p, i0, n, vec, v);
}

#endif  // GRADCOMP_COMMON_CUH
