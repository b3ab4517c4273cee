// Uniform float32 numbers of the counter-based stream of gradcomp.kernels.rng (numpy's
// Philox4x64-10, bit for bit). Each thread makes one Philox block: 8 consecutive numbers.
#include "philox.cuh"

extern "C" __global__ void __launch_bounds__(BLOCK) philox_uniform(float* __restrict__ out, i64 n, u64 k0, u64 k1) {
  i64 blocks = (n + 7) >> 3;
  for (i64 b = thread_index(); b < blocks; b += thread_count()) {
    float u[8];
    uniform8((u64)b, k0, k1, u);
    i64 base = b << 3;
    if (base + 8 <= n) {
      // out comes from torch's allocator (aligned), so 8 floats at 32*b bytes are 16-aligned
      f32x4* o = reinterpret_cast<f32x4*>(out + base);
      o[0] = f32x4{u[0], u[1], u[2], u[3]};
      o[1] = f32x4{u[4], u[5], u[6], u[7]};
    } else {
      for (int j = 0; base + j < n; ++j) out[base + j] = u[j];
    }
  }
}
