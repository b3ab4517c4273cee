// Selection (reference: gradcomp/kernels/select.py): exact top-k by value with ties broken
// towards lower indices, NaN largest, output ascending int64 indices; and |x| >= tau.
//
// Every value maps to a 32-bit key whose unsigned order is the value order (-0 == +0, NaN
// above +inf, all NaNs equal). Top-k finds T, the k-th largest key, and takes every key > T
// plus the first (k - #(key > T)) keys == T in index order. Stages, all on the device, none
// waiting for the host (the sizes of all buffers are known before the launch):
//
//  1. topk_sample (one block): keys of 8192 stratified sample positions, radix-selected
//     (two rounds, to 2**10 keys) to a window [lo, hi] that holds the k-th largest key with
//     overwhelming probability.
//  2. topk_pass (one read of x): a bitmap of the keys > hi ("sure"), and the (index, key)
//     of keys in [lo, hi] appended to a candidate buffer (one atomic per block and step).
//  3. The window is usable ("ok") when #sure <= k <= #sure + #window and the buffer did not
//     overflow. topk_hist (3 launches, 11 + 11 + 10 bits) radix-selects T among the
//     candidates then; otherwise among all of x (an exact fallback: 3 more reads of x, and
//     the path small tensors and large k take directly). Each block recomputes the earlier
//     rounds' choices from their global histograms, so no launch is spent on a tiny kernel.
//  4. topk_mark: candidates with key > T / == T set bits of the sure / tie bitmaps (ok), or
//     both bitmaps are rebuilt from x (fallback).
//  5. topk_count, topk_scan, topk_write: per-chunk bit counts, their prefix sums, and the
//     ascending indices of the sure bits and of the first `need` tie bits.
//
// Workspace ws (int64): WS_* below, 3 histograms of 2048 bins, then 2 counts per chunk.
#include "common.cuh"

#define WS_LO 0        // window: lowest candidate key
#define WS_HI 1        // window: keys above are sure
#define WS_SURE 2      // number of keys > hi (topk_pass)
#define WS_WINDOW 3    // number of keys in [lo, hi] (topk_pass; may exceed the buffer)
#define WS_T 4         // the k-th largest key (topk_mark)
#define WS_NEED 5      // keys == T to take (topk_mark)
#define WS_HIST 16     // 3 x 2048 bins
#define NBINS 2048
#define WS_COUNTS (WS_HIST + 3 * NBINS)  // sure and tie bit counts of each chunk
#define SAMPLE 8192    // sample size of topk_sample (keys kept in shared memory)
#define CHUNK_WORDS 2048  // bitmap words per block of topk_count / topk_write (BLOCK x 8)
#define PASS_WORDS 8   // words a warp handles per step of topk_pass
#define HIST_MIN 16384  // fewest keys a block of topk_hist histograms
#define WIDE_BLOCK 1024  // threads of the one-block kernels topk_sample and topk_scan

__device__ __forceinline__ u32 key_of(float v) {
  u32 b = __float_as_uint(v);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;  // NaN: largest
  if ((b & 0x7fffffffu) == 0u) b = 0u;                         // -0 == +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Radix digits of a key: round 0 takes bits 31..21, round 1 bits 20..10, round 2 bits 9..0.
__device__ __forceinline__ int round_shift(int r) { return r == 0 ? 21 : r == 1 ? 10 : 0; }
__device__ __forceinline__ int round_bins(int r) { return r == 2 ? 1024 : 2048; }
__device__ __forceinline__ u32 digit(u32 key, int r) { return (key >> round_shift(r)) & (u32)(round_bins(r) - 1); }
// Whether key agrees with prefix on the digits of the rounds before r.
__device__ __forceinline__ bool in_prefix(u32 key, u32 prefix, int r) {
  if (r == 0) return true;
  int s = round_shift(r - 1);
  return (key >> s) == (prefix >> s);
}

// Block-cooperative: the bin holding the need-th largest element of a histogram, counted
// from the top, and how many of that bin's elements are still needed. Every thread gets
// the result. nbins must be a multiple of blockDim.x.
template <class C>
__device__ void select_bin(const C* hist, int nbins, i64 need, u32* bin_out, i64* need_out) {
  __shared__ i64 scan_scratch[33];
  __shared__ u32 s_bin;
  __shared__ i64 s_need;
  const int per = nbins / (int)blockDim.x;
  const int top = nbins - 1 - (int)threadIdx.x * per;  // this thread's bins: top, top-1, ...
  i64 mine = 0;
  for (int j = 0; j < per; ++j) mine += (i64)hist[top - j];
  if (threadIdx.x == 0) {
    s_bin = 0;
    s_need = need;
  }
  i64 total;
  i64 above = block_exclusive_scan(mine, scan_scratch, &total);  // ends with a barrier
  if (above < need && need <= above + mine) {
    for (int j = 0; j < per; ++j) {
      i64 h = (i64)hist[top - j];
      if (above + h >= need) {
        s_bin = (u32)(top - j);
        s_need = need - above;
        break;
      }
      above += h;
    }
  }
  __syncthreads();
  *bin_out = s_bin;
  *need_out = s_need;
  __syncthreads();
}

// The state of the resolution after `rounds` histogram rounds: prefix of T and what is
// still needed, and whether the candidate window is used. Same result in every block.
struct Resolve {
  bool ok;
  u32 prefix;
  i64 need;
};

__device__ Resolve resolve(const i64* ws, i64 k, i64 cw, int rounds) {
  Resolve s;
  i64 sure = ws[WS_SURE], window = ws[WS_WINDOW];
  s.ok = sure <= k && window <= cw && sure + window >= k;
  s.need = s.ok ? k - sure : k;
  s.prefix = 0;
  for (int r = 0; r < rounds; ++r) {
    u32 bin;
    if (s.need == 0) continue;  // nothing left to find: T stays "none" (see topk_mark)
    select_bin(ws + WS_HIST + r * NBINS, round_bins(r), s.need, &bin, &s.need);
    s.prefix |= bin << round_shift(r);
  }
  return s;
}

template <class T>
__device__ void sample_impl(const T* __restrict__ x, i64 n, i64 r_hi, i64 r_lo, i64* __restrict__ ws) {
  __shared__ u32 keys[SAMPLE];
  __shared__ u32 hist[NBINS];
  for (int j = threadIdx.x; j < WS_COUNTS; j += blockDim.x) ws[j] = j == WS_HI ? 0xffffffffll : 0;
  if (r_lo == 0) return;  // no sampling: the window is empty and the fallback selects
  const i64 stride = n / SAMPLE;
  for (int j = threadIdx.x; j < SAMPLE; j += blockDim.x) {
    u64 h = (u64)j * 0x9E3779B97F4A7C15ull;  // splitmix64 of j: the position within stratum j
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    keys[j] = key_of(to_f32(x[(i64)j * stride + (i64)(h % (u64)stride)]));
  }
  __syncthreads();
  // Two radix rounds give the bounds to 2**10 keys: hi is widened to the top of its bin and
  // lo to the bottom (a slightly wider window; any lo <= hi gives the exact result).
  for (int which = 0; which < 2; ++which) {
    i64 need = which == 0 ? r_hi : r_lo;  // rank from the top; 0: no such bound
    u32 prefix = which == 0 ? 0x3ffu : 0u;
    for (int r = 0; r < 2 && need > 0; ++r) {
      for (int b = threadIdx.x; b < NBINS; b += blockDim.x) hist[b] = 0;
      __syncthreads();
      for (int j = threadIdx.x; j < SAMPLE; j += blockDim.x)
        if (in_prefix(keys[j], prefix & ~0x3ffu, r)) atomicAdd(&hist[digit(keys[j], r)], 1u);
      __syncthreads();
      u32 bin;
      select_bin(hist, round_bins(r), need, &bin, &need);
      prefix |= bin << round_shift(r);
    }
    if (threadIdx.x == 0 && need > 0) ws[which == 0 ? WS_HI : WS_LO] = (i64)prefix;
    __syncthreads();
  }
}

template <class T>
__device__ void pass_impl(const T* __restrict__ x, i64 n, i64* __restrict__ ws, u32* __restrict__ bm, i64 words,
                          i64* __restrict__ cidx, u32* __restrict__ ckey, i64 cw) {
  __shared__ i64 scratch[33];
  __shared__ i64 s_base;
  const u32 lo = (u32)ws[WS_LO], hi = (u32)ws[WS_HI];
  const u32 lane = lane_id();
  const i64 step_words = (i64)(blockDim.x >> 5) * PASS_WORDS;
  const i64 steps = (words + step_words - 1) / step_words;
  i64 sure = 0;
  for (i64 s = blockIdx.x; s < steps; s += gridDim.x) {
    const i64 w0 = s * step_words + (i64)warp_id() * PASS_WORDS;
    u32 key[PASS_WORDS], win[PASS_WORDS];
    bool valid[PASS_WORDS];
#pragma unroll
    for (int u = 0; u < PASS_WORDS; ++u) {
      i64 i = ((w0 + u) << 5) + lane;
      valid[u] = i < n;
      key[u] = valid[u] ? key_of(to_f32(x[i])) : 0u;
    }
    u32 mine = 0;
    i64 count = 0;
#pragma unroll
    for (int u = 0; u < PASS_WORDS; ++u) {
      u32 s_word = __ballot_sync(0xffffffffu, valid[u] && key[u] > hi);
      win[u] = __ballot_sync(0xffffffffu, valid[u] && key[u] >= lo && key[u] <= hi);
      if (lane == (u32)u) mine = s_word;
      if (lane == 0) sure += __popc(s_word);
      count += __popc(win[u]);
    }
    if (lane < PASS_WORDS && w0 + lane < words) {
      bm[w0 + lane] = mine;          // sure bitmap
      bm[words + w0 + lane] = 0u;    // tie bitmap, filled by topk_mark
    }
    // one atomic per block and step reserves the block's candidate slots, in warp order
    i64 total;
    i64 before = block_exclusive_scan(lane == 0 ? count : (i64)0, scratch, &total);
    before = __shfl_sync(0xffffffffu, before, 0);
    if (threadIdx.x == 0) s_base = total ? (i64)atomicAdd(reinterpret_cast<u64*>(ws + WS_WINDOW), (u64)total) : 0;
    __syncthreads();
    i64 pos = s_base + before;
    __syncthreads();
#pragma unroll
    for (int u = 0; u < PASS_WORDS; ++u) {
      if ((win[u] >> lane) & 1u) {
        i64 p = pos + __popc(win[u] & ((1u << lane) - 1u));
        if (p < cw) {
          cidx[p] = ((w0 + u) << 5) + lane;
          ckey[p] = key[u];
        }
      }
      pos += __popc(win[u]);
    }
  }
  __shared__ i64 sum_scratch[32];
  sure = block_sum(sure, sum_scratch);
  if (threadIdx.x == 0 && sure) atomicAdd(reinterpret_cast<u64*>(ws + WS_SURE), (u64)sure);
}

// Histogram round r of the keys that agree with T's prefix: over the candidates when the
// window is usable, else over all of x.
template <class T>
__device__ void hist_impl(const T* __restrict__ x, i64 n, i64* __restrict__ ws, i64 k, i64 cw,
                          const u32* __restrict__ ckey, int round) {
  __shared__ u32 hist[NBINS];
  Resolve s = resolve(ws, k, cw, round);
  if (s.need == 0) return;  // uniform over the grid: T is already decided
  const int nb = round_bins(round);
  for (int b = threadIdx.x; b < nb; b += blockDim.x) hist[b] = 0;
  __syncthreads();
  const i64 m = s.ok ? ws[WS_WINDOW] : n;
  // The candidates are few: a block takes at least HIST_MIN of them, so that few blocks
  // merge their histograms into the global one (its atomics would dominate otherwise).
  const i64 active = min64(gridDim.x, max64(1, (m + HIST_MIN - 1) / HIST_MIN));
  if ((i64)blockIdx.x >= active) return;  // uniform over the block
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += active * blockDim.x) {
    u32 key = s.ok ? ckey[i] : key_of(to_f32(x[i]));
    if (in_prefix(key, s.prefix, round)) atomicAdd(&hist[digit(key, round)], 1u);
  }
  __syncthreads();
  u64* g = reinterpret_cast<u64*>(ws + WS_HIST + round * NBINS);
  for (int b = threadIdx.x; b < nb; b += blockDim.x)
    if (hist[b]) atomicAdd(g + b, (u64)hist[b]);
}

template <class T>
__device__ void mark_impl(const T* __restrict__ x, i64 n, i64* __restrict__ ws, i64 k, i64 cw,
                          const i64* __restrict__ cidx, const u32* __restrict__ ckey, u32* __restrict__ bm, i64 words) {
  Resolve s = resolve(ws, k, cw, 3);
  // need == 0 here means no key == T is wanted; T = max key then marks nothing above it
  const u32 t = s.need == 0 && s.ok ? 0xffffffffu : s.prefix;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    ws[WS_T] = (i64)t;
    ws[WS_NEED] = s.need;
  }
  if (s.ok) {
    const i64 m = ws[WS_WINDOW];
    for (i64 j = thread_index(); j < m; j += thread_count()) {
      u32 key = ckey[j];
      i64 i = cidx[j];
      if (key > t) atomicOr(bm + (i >> 5), 1u << (i & 31));
      else if (key == t) atomicOr(bm + words + (i >> 5), 1u << (i & 31));
    }
    return;
  }
  const u32 lane = lane_id();
  for (i64 w = thread_index() >> 5; w < words; w += thread_count() >> 5) {
    i64 i = (w << 5) + lane;
    u32 key = i < n ? key_of(to_f32(x[i])) : 0u;
    u32 above = __ballot_sync(0xffffffffu, i < n && key > t);
    u32 tie = __ballot_sync(0xffffffffu, i < n && key == t);
    if (lane == 0) {
      bm[w] = above;
      bm[words + w] = tie;
    }
  }
}

// Threshold: bit i set where |x[i]| >= t or x[i] is NaN (the tie bitmap stays empty).
template <class T>
__device__ void threshold_impl(const T* __restrict__ x, i64 n, float t, u32* __restrict__ bm, i64 words) {
  const u32 lane = lane_id();
  for (i64 w = thread_index() >> 5; w < words; w += thread_count() >> 5) {
    i64 i = (w << 5) + lane;
    bool keep = false;
    if (i < n) {
      float v = to_f32(x[i]);
      keep = !(fabsf(v) < t);  // written as not(<) so that NaN is kept
    }
    u32 word = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) {
      bm[w] = word;
      bm[words + w] = 0u;
    }
  }
}

#define SELECT_KERNELS(T, S)                                                                                    \
  extern "C" __global__ void __launch_bounds__(WIDE_BLOCK) topk_sample_##S(const T* __restrict__ x, i64 n, i64 r_hi,  \
                                                                           i64 r_lo, i64* __restrict__ ws) {    \
    sample_impl<T>(x, n, r_hi, r_lo, ws);                                                                       \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(BLOCK) topk_pass_##S(const T* __restrict__ x, i64 n,             \
                                                                    i64* __restrict__ ws, u32* __restrict__ bm, \
                                                                    i64 words, i64* __restrict__ cidx,          \
                                                                    u32* __restrict__ ckey, i64 cw) {           \
    pass_impl<T>(x, n, ws, bm, words, cidx, ckey, cw);                                                          \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(BLOCK) topk_hist_##S(const T* __restrict__ x, i64 n,             \
                                                                    i64* __restrict__ ws, i64 k, i64 cw,        \
                                                                    const u32* __restrict__ ckey, int round) {  \
    hist_impl<T>(x, n, ws, k, cw, ckey, round);                                                                 \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(BLOCK) topk_mark_##S(                                            \
      const T* __restrict__ x, i64 n, i64* __restrict__ ws, i64 k, i64 cw, const i64* __restrict__ cidx,        \
      const u32* __restrict__ ckey, u32* __restrict__ bm, i64 words) {                                          \
    mark_impl<T>(x, n, ws, k, cw, cidx, ckey, bm, words);                                                       \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(BLOCK) threshold_mark_##S(const T* __restrict__ x, i64 n, float t, \
                                                                         u32* __restrict__ bm, i64 words) {     \
    threshold_impl<T>(x, n, t, bm, words);                                                                      \
  }

SELECT_KERNELS(float, f32)
SELECT_KERNELS(f16, f16)
SELECT_KERNELS(bf16, bf16)

// Set bits of the sure and tie bitmaps in each chunk of CHUNK_WORDS words.
extern "C" __global__ void __launch_bounds__(BLOCK) topk_count(const u32* __restrict__ bm, i64 words, i64* __restrict__ ws) {
  __shared__ i64 scratch[32];
  const i64 w0 = (i64)blockIdx.x * CHUNK_WORDS + (i64)threadIdx.x * (CHUNK_WORDS / BLOCK);
  i64 s = 0, t = 0;
  for (int j = 0; j < CHUNK_WORDS / BLOCK; ++j) {
    i64 w = w0 + j;
    if (w < words) {
      s += __popc(bm[w]);
      t += __popc(bm[words + w]);
    }
  }
  s = block_sum(s, scratch);
  t = block_sum(t, scratch);
  if (threadIdx.x == 0) {
    ws[WS_COUNTS + 2 * (i64)blockIdx.x] = s;
    ws[WS_COUNTS + 2 * (i64)blockIdx.x + 1] = t;
  }
}

// Exclusive prefix sums of the chunk counts, in place (one block; the total is appended).
extern "C" __global__ void __launch_bounds__(WIDE_BLOCK) topk_scan(i64* __restrict__ ws, i64 chunks) {
  __shared__ i64 scratch[33];
  i64* c = ws + WS_COUNTS;
  i64 carry_s = 0, carry_t = 0;
  for (i64 base = 0; base < chunks + 1; base += blockDim.x) {
    i64 j = base + threadIdx.x;
    i64 s = j < chunks ? c[2 * j] : 0, t = j < chunks ? c[2 * j + 1] : 0;
    i64 ts, tt;
    i64 es = block_exclusive_scan(s, scratch, &ts);
    i64 et = block_exclusive_scan(t, scratch, &tt);
    if (j <= chunks) {
      c[2 * j] = carry_s + es;
      c[2 * j + 1] = carry_t + et;
    }
    carry_s += ts;
    carry_t += tt;
  }
}

// Ascending indices of the sure bits and of the first `need` tie bits (need: ws[WS_NEED],
// or all tie bits when need < 0). Writes at most k indices.
extern "C" __global__ void __launch_bounds__(BLOCK) topk_write(const u32* __restrict__ bm, i64 words,
                                                               const i64* __restrict__ ws, i64 use_need, i64 k,
                                                               i64* __restrict__ out) {
  __shared__ i64 scratch[33];
  const i64 need = use_need ? ws[WS_NEED] : 0x7fffffffffffffffll;
  const i64 sure_before = ws[WS_COUNTS + 2 * (i64)blockIdx.x];
  const i64 tie_before = ws[WS_COUNTS + 2 * (i64)blockIdx.x + 1];
  const int per = CHUNK_WORDS / BLOCK;
  const i64 w0 = (i64)blockIdx.x * CHUNK_WORDS + (i64)threadIdx.x * per;
  u32 s[CHUNK_WORDS / BLOCK], t[CHUNK_WORDS / BLOCK];
  i64 ns = 0, nt = 0;
  for (int j = 0; j < per; ++j) {
    i64 w = w0 + j;
    s[j] = w < words ? bm[w] : 0u;
    t[j] = w < words ? bm[words + w] : 0u;
    ns += __popc(s[j]);
    nt += __popc(t[j]);
  }
  i64 unused;
  i64 tie_rank = tie_before + block_exclusive_scan(nt, scratch, &unused);  // global rank of my first tie
  i64 take = min64(max64(need - tie_rank, 0), nt);                          // my ties that are taken
  i64 pos = sure_before + min64(tie_before, need) + block_exclusive_scan(ns + take, scratch, &unused);
  for (int j = 0; j < per; ++j) {
    u32 ties = t[j];
    u32 sel = s[j];
    while (ties && take > 0) {  // keep the lowest `take` tie bits
      u32 low = ties & (~ties + 1u);
      sel |= low;
      ties ^= low;
      --take;
    }
    while (sel) {
      int b = __ffs((int)sel) - 1;
      sel &= sel - 1u;
      if (pos < k) out[pos] = ((w0 + j) << 5) + b;
      ++pos;
    }
  }
}
