// Element types and the 16-byte pack reduction, shared by CPU and CUDA.
//
// Sums are taken in fp32 over sources in rank order 0..N-1 on every rank
// (DESIGN C9), and rounded to nearest even once, so every rank holds the
// same bits and CPU and CUDA agree.
#pragma once

#include <cstdint>
#include <cstring>

#include "channel.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace b12x {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct alignas(16) Pack {
  uint32_t words[4];
};
static_assert(sizeof(Pack) == kPackBytes);

// All ones: NaN in every supported dtype. What a call that could not finish
// leaves in its output, so a lost result never reads as a number.
B12X_HD Pack nan_pack() { return Pack{{~0u, ~0u, ~0u, ~0u}}; }

B12X_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

B12X_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Host conversions are written out bit by bit (round to nearest even; NaN
// becomes 0x7FFF, the canonical NaN of cvt.rn.bf16.f32) to match the CUDA
// intrinsics exactly.
B12X_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

B12X_HD uint16_t f32_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
#endif
}

B12X_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_f32(sign);
  // Subnormal: normalise the mantissa.
  int e = -1;
  do {
    mant <<= 1;
    ++e;
  } while ((mant & 0x400u) == 0);
  return bits_f32(sign | ((112u - e) << 23) | ((mant & 0x3ffu) << 13));
#endif
}

B12X_HD uint16_t f32_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;                 // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;                // rounds to inf
  if (abs >= 0x38800000u) {                                     // normal half
    const uint32_t r = abs - 0x38000000u;                       // rebias 127 -> 15
    return sign | static_cast<uint16_t>((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
  }
  if (abs < 0x33000000u) return sign;                           // below half of min subnormal
  // Subnormal half: shift the full mantissa into place, round to nearest even.
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const int shift = 126 - static_cast<int>(abs >> 23);          // 14..24
  const uint32_t half_ulp = 1u << (shift - 1);
  const uint32_t rest = mant & ((1u << shift) - 1u);
  uint32_t q = mant >> shift;
  if (rest > half_ulp || (rest == half_ulp && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
#endif
}

// Element access inside a pack, by storage type.
template <DType D> struct Elements;

template <> struct Elements<DType::kF32> {
  static constexpr int kCount = 4;
  static B12X_HD float get(const Pack& p, int i) { return bits_f32(p.words[i]); }
  static B12X_HD void set(Pack& p, int i, float v) { p.words[i] = f32_bits(v); }
};

template <> struct Elements<DType::kBF16> {
  static constexpr int kCount = 8;
  static B12X_HD float get(const Pack& p, int i) {
    return bf16_to_f32(static_cast<uint16_t>(p.words[i / 2] >> (16 * (i % 2))));
  }
  static B12X_HD void set(Pack& p, int i, float v) {
    const uint32_t shift = 16 * (i % 2);
    p.words[i / 2] = (p.words[i / 2] & ~(0xffffu << shift)) | (uint32_t{f32_to_bf16(v)} << shift);
  }
};

template <> struct Elements<DType::kF16> {
  static constexpr int kCount = 8;
  static B12X_HD float get(const Pack& p, int i) {
    return f16_to_f32(static_cast<uint16_t>(p.words[i / 2] >> (16 * (i % 2))));
  }
  static B12X_HD void set(Pack& p, int i, float v) {
    const uint32_t shift = 16 * (i % 2);
    p.words[i / 2] = (p.words[i / 2] & ~(0xffffu << shift)) | (uint32_t{f32_to_f16(v)} << shift);
  }
};

// Adds `src` into the fp32 accumulators `acc` (one per element of a pack).
template <DType D>
B12X_HD void accumulate(float* acc, const Pack& src) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < Elements<D>::kCount; ++i) acc[i] += Elements<D>::get(src, i);
}

template <DType D>
B12X_HD Pack round_pack(const float* acc) {
  Pack out{};
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < Elements<D>::kCount; ++i) Elements<D>::set(out, i, acc[i]);
  return out;
}

// The reduction of every backend and kernel (DESIGN C9): `staged[q]` of the
// first `world` ranks summed in fp32 in rank order 0..world-1, plus `extra`
// where given, rounded once, so every rank computes the same bits. `staged`
// holds kRanks (>= world) packs: a kernel unrolled to fewer than kMaxRanks
// sources (lamport.cuh) passes its bound.
template <DType D, int kRanks = kMaxRanks>
B12X_HD Pack sum_in_rank_order(const Pack* staged, int world, const Pack* extra = nullptr) {
  float acc[Elements<D>::kCount] = {};
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int q = 0; q < kRanks; ++q) {  // a fixed bound keeps `staged` in registers
    if (q < world) accumulate<D>(acc, staged[q]);
  }
  if (extra != nullptr) accumulate<D>(acc, *extra);
  return round_pack<D>(acc);
}

}  // namespace b12x
