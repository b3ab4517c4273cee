// Bit packing (reference: gradcomp/kernels/bits.py): codes of 1, 2 or 4 bits, element i in
// byte i*b/8 at bit offset (i*b)%8. One thread per packed byte: it reads the 8/b codes of
// that byte with one load when they are aligned, and unpacking writes them with one store.
//
// As in the reference, pack_codes with 1 bit keeps code != 0, and with 2 or 4 bits adds
// code << offset, so only codes below 2**b round-trip.
#include "common.cuh"

__device__ __forceinline__ u64 load_codes(const u8* p, int count, bool aligned) {
  if (aligned) {  // count consecutive bytes in one load
    if (count == 8) return *reinterpret_cast<const u64*>(p);
    if (count == 4) return *reinterpret_cast<const u32*>(p);
    return *reinterpret_cast<const u16*>(p);
  }
  u64 v = 0;
  for (int j = 0; j < count; ++j) v |= (u64)p[j] << (8 * j);
  return v;
}

extern "C" __global__ void __launch_bounds__(BLOCK) pack_codes(const u8* __restrict__ codes, i64 n, int bits,
                                                               u8* __restrict__ out) {
  const int per = 8 / bits;
  const i64 nbytes = (n * bits + 7) >> 3;
  const bool aligned = (reinterpret_cast<u64>(codes) & (u64)(per - 1)) == 0;
  for (i64 b = thread_index(); b < nbytes; b += thread_count()) {
    const i64 first = b * per;
    const int count = (int)min64(per, n - first);
    u64 v = load_codes(codes + first, count, aligned && count == per);
    u32 byte = 0;
    for (int j = 0; j < count; ++j) {
      u32 c = (u32)(v >> (8 * j)) & 0xffu;
      byte += (bits == 1 ? (c != 0u) : c) << (j * bits);
    }
    out[b] = (u8)byte;
  }
}

extern "C" __global__ void __launch_bounds__(BLOCK) unpack_codes(const u8* __restrict__ packed, i64 n, int bits,
                                                                 u8* __restrict__ out) {
  const int per = 8 / bits;
  const u32 mask = (1u << bits) - 1u;
  const i64 nbytes = (n * bits + 7) >> 3;
  for (i64 b = thread_index(); b < nbytes; b += thread_count()) {
    const u32 byte = packed[b];
    const i64 first = b * per;
    u64 v = 0;
    for (int j = 0; j < per; ++j) v |= (u64)((byte >> (j * bits)) & mask) << (8 * j);
    if (first + per <= n) {  // out is a fresh torch allocation: per-byte groups are aligned
      if (per == 8) *reinterpret_cast<u64*>(out + first) = v;
      else if (per == 4) *reinterpret_cast<u32*>(out + first) = (u32)v;
      else *reinterpret_cast<u16*>(out + first) = (u16)v;
    } else {
      for (int j = 0; first + j < n; ++j) out[first + j] = (u8)(v >> (8 * j));
    }
  }
}
