// CPU emulation of the small subset of CUDA that gradcomp's kernels use, for tests only.
//
// Every CUDA thread of a block runs as a fiber (ucontext) on one OS thread; blocks run one
// after another. __syncthreads() and the warp collectives (__ballot_sync, __shfl_*_sync)
// are barriers: a fiber yields there until every live thread of its block (or all 32 lanes
// of its warp) has arrived, so shared-memory algorithms run as written. A barrier reached
// by only part of a block or warp is reported as an error instead of hanging. __shared__
// variables become statics: one copy, shared by the threads of the block that runs.
// Atomics are plain read-modify-writes (one OS thread). What this cannot find: data races
// between threads that a real GPU would interleave differently.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sys/mman.h>
#include <tuple>
#include <type_traits>
#include <setjmp.h>
#include <ucontext.h>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint3 { unsigned x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
static const int warpSize = 32;
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

namespace emu {

enum State { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
enum WarpOp { OP_NONE, OP_BALLOT, OP_SHFL, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_SYNCWARP };

struct Fiber {
  ucontext_t ctx;  // only to start the fiber; switches use _setjmp/_longjmp (no syscall)
  jmp_buf jb;
  bool started;
  State state;
  uint3 tid;
  WarpOp op;
  unsigned mask;
  int arg;              // lane / delta / lane mask of a shuffle
  unsigned long long value, result;  // posted value, result of the collective
};

struct Runtime {
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;
  jmp_buf sched;
  Fiber* cur = nullptr;
  uint3 block_idx{0, 0, 0};
  dim3 grid_dim, block_dim;
  std::function<void()> body;
  const char* error = nullptr;
  char message[256];
};

inline Runtime& rt() {
  static Runtime r;
  return r;
}

inline void fail(const char* msg) {
  Runtime& r = rt();
  if (!r.error) {
    std::snprintf(r.message, sizeof r.message, "%s", msg);
    r.error = r.message;
  }
}

inline void yield() {
  if (!_setjmp(rt().cur->jb)) _longjmp(rt().sched, 1);
}

inline void sync_block() {
  rt().cur->state = WAIT_BLOCK;
  yield();
}

inline unsigned long long warp_collective(WarpOp op, unsigned mask, unsigned long long value, int arg) {
  Fiber* f = rt().cur;
  f->op = op;
  f->mask = mask;
  f->value = value;
  f->arg = arg;
  f->state = WAIT_WARP;
  yield();
  return f->result;
}

inline void fiber_main() {
  Runtime& r = rt();
  r.body();
  r.cur->state = DONE;
  _longjmp(r.sched, 1);
}

constexpr size_t kStack = 128 * 1024;

// Release the warps whose 32 lanes all wait at the same collective; true if any was released.
inline bool release_warps(std::vector<Fiber>& fs) {
  bool any = false;
  size_t n = fs.size();
  for (size_t w = 0; w < n; w += 32) {
    bool waiting = false, all = true;
    for (size_t l = w; l < w + 32; ++l) {
      if (l >= n) { all = false; continue; }
      if (fs[l].state == WAIT_WARP) waiting = true;
      else all = false;
    }
    if (!waiting) continue;
    if (!all) continue;  // decided by the caller once nothing else can run
    WarpOp op = fs[w].op;
    for (size_t l = w; l < w + 32; ++l) {
      if (fs[l].op != op || fs[l].mask != 0xffffffffu) {
        fail("warp collective: lanes of one warp reached different collectives or used a partial mask");
        return false;
      }
    }
    for (size_t l = w; l < w + 32; ++l) {
      Fiber& f = fs[l];
      int lane = int(l - w);
      int src = lane;
      switch (op) {
        case OP_BALLOT: {
          unsigned long long b = 0;
          for (int j = 0; j < 32; ++j) b |= (fs[w + j].value ? 1ull : 0ull) << j;
          f.result = b;
          break;
        }
        case OP_SHFL: src = f.arg & 31; f.result = fs[w + src].value; break;
        case OP_SHFL_UP: src = lane - f.arg; f.result = src >= 0 ? fs[w + src].value : f.value; break;
        case OP_SHFL_DOWN: src = lane + f.arg; f.result = src < 32 ? fs[w + src].value : f.value; break;
        case OP_SHFL_XOR: src = lane ^ f.arg; f.result = src < 32 ? fs[w + src].value : f.value; break;
        default: f.result = 0; break;
      }
    }
    for (size_t l = w; l < w + 32; ++l) fs[l].state = RUN;
    any = true;
  }
  return any;
}

inline const char* run_block() {
  Runtime& r = rt();
  std::vector<Fiber>& fs = r.fibers;
  for (;;) {
    bool ran = false;
    for (auto& f : fs) {
      if (f.state != RUN) continue;
      r.cur = &f;
      if (!_setjmp(r.sched)) {
        if (f.started) {
          _longjmp(f.jb, 1);
        } else {
          f.started = true;
          setcontext(&f.ctx);
        }
      }
      ran = true;
      if (r.error) return r.error;
    }
    if (ran) continue;
    if (release_warps(fs)) continue;
    if (r.error) return r.error;
    size_t live = 0, at_block = 0, at_warp = 0;
    for (auto& f : fs) {
      if (f.state == DONE) continue;
      ++live;
      if (f.state == WAIT_BLOCK) ++at_block;
      if (f.state == WAIT_WARP) ++at_warp;
    }
    if (live == 0) return nullptr;
    if (at_block == live) {
      for (auto& f : fs)
        if (f.state == WAIT_BLOCK) f.state = RUN;
      continue;
    }
    if (at_warp) {
      fail("warp collective reached by only part of a warp (exited lanes or divergent code)");
    } else {
      fail("deadlock: threads wait at different barriers");
    }
    return r.error;
  }
}

template <class... A, size_t... I>
inline void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<typename std::remove_reference<A>::type*>(args[I])...);
}

// Run kernel f on a 1-D grid of `grid` blocks of `block` threads; returns an error or NULL.
template <class... A>
const char* launch(void (*f)(A...), unsigned grid, unsigned block, void** args) {
  Runtime& r = rt();
  r.error = nullptr;
  if (block == 0 || block > 1024 || grid == 0) return "bad launch configuration";
  r.grid_dim = dim3{grid, 1, 1};
  r.block_dim = dim3{block, 1, 1};
  r.body = [f, args]() { call(f, args, std::index_sequence_for<A...>{}); };
  while (r.stacks.size() < block) {
    void* s = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s == MAP_FAILED) return "cannot allocate fiber stacks";
    r.stacks.push_back(static_cast<char*>(s));
  }
  r.fibers.assign(block, Fiber{});
  for (unsigned b = 0; b < grid; ++b) {
    r.block_idx = uint3{b, 0, 0};
    for (unsigned t = 0; t < block; ++t) {
      Fiber& fb = r.fibers[t];
      fb.state = RUN;
      fb.started = false;
      fb.tid = uint3{t, 0, 0};
      fb.op = OP_NONE;
      getcontext(&fb.ctx);
      fb.ctx.uc_stack.ss_sp = r.stacks[t];
      fb.ctx.uc_stack.ss_size = kStack;
      fb.ctx.uc_link = nullptr;
      makecontext(&fb.ctx, fiber_main, 0);
    }
    const char* err = run_block();
    if (err) return err;
  }
  return nullptr;
}

template <class T>
inline unsigned long long to_bits(T v) {
  unsigned long long b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

template <class T>
inline T from_bits(unsigned long long b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace emu

#define threadIdx (emu::rt().cur->tid)
#define blockIdx (emu::rt().block_idx)
#define blockDim (emu::rt().block_dim)
#define gridDim (emu::rt().grid_dim)

inline void __syncthreads() { emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_collective(emu::OP_SYNCWARP, mask, 0, 0); }
inline void __threadfence() {}
inline void __threadfence_block() {}

inline unsigned __ballot_sync(unsigned mask, int pred) {
  return unsigned(emu::warp_collective(emu::OP_BALLOT, mask, pred != 0, 0));
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == 0xffffffffu; }

#define EMU_SHFL(NAME, OP)                                                                  \
  template <class T>                                                                        \
  inline T NAME(unsigned mask, T v, int arg, int width = 32) {                              \
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 64 bits");                  \
    if (width != 32) emu::fail(#NAME ": only width 32 is emulated");                        \
    return emu::from_bits<T>(emu::warp_collective(OP, mask, emu::to_bits(v), arg));         \
  }
EMU_SHFL(__shfl_sync, emu::OP_SHFL)
EMU_SHFL(__shfl_up_sync, emu::OP_SHFL_UP)
EMU_SHFL(__shfl_down_sync, emu::OP_SHFL_DOWN)
EMU_SHFL(__shfl_xor_sync, emu::OP_SHFL_XOR)
#undef EMU_SHFL

template <class T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <class T> inline T atomicOr(T* p, T v) { T old = *p; *p = old | v; return old; }
template <class T> inline T atomicAnd(T* p, T v) { T old = *p; *p = old & v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; if (v < old) *p = v; return old; }
template <class T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T> inline T atomicCAS(T* p, T cmp, T v) { T old = *p; if (old == cmp) *p = v; return old; }

inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
inline double __longlong_as_double(long long u) { double d; std::memcpy(&d, &u, 8); return d; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((unsigned long long)a * b >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
// Rounding-explicit float ops: the emulation is IEEE single precision without contraction.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __double2float_rn(double d) { return float(d); }
inline float __int2float_rn(int i) { return float(i); }
inline float __ll2float_rn(long long i) { return float(i); }
inline double __ll2double_rn(long long i) { return double(i); }

using std::fabs; using std::floor; using std::ceil; using std::sqrt; using std::fmin; using std::fmax;
using std::rint; using std::trunc; using std::ldexp; using std::frexp;
using ::fabsf; using ::floorf; using ::ceilf; using ::sqrtf; using ::fminf; using ::fmaxf; using ::rintf;
using ::truncf; using ::ldexpf; using ::frexpf; using ::log2f; using ::exp2f;

// Half-precision conversions (the CUDA build uses the PTX cvt instructions).
inline float f16_bits_to_f32(unsigned short h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return float(v);
}
inline unsigned short f32_to_f16_bits(float f) {
  _Float16 v = _Float16(f);  // round to nearest even, like cvt.rn.f16.f32
  unsigned short h;
  std::memcpy(&h, &v, 2);
  return h;
}
