// What the two quantized matmul kernels share (quantized_matmul.cc: activations in float32;
// quantized_matmul_int8.cc: activations quantized to int8): the weight formats, the problem, and the
// exact f16 decoding (the K-quant headers' decoding is in k_quant_headers.inc, compiled per variant).
// pallas_kernels/quantized_matmul.py has the contract.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace orca_qmm {

using orca_vec16::kLanes;
using orca_vec16::vf;
using orca_vec16::vi;
constexpr int kBlock = 32;  // weights per block
constexpr int kRowsPerItem = 32;  // work item: output rows one thread takes at a time (both kernels)

using vb = uint8_t __attribute__((vector_size(kLanes)));
using vsb = int8_t __attribute__((vector_size(kLanes)));

// Numbered as FORMATS in pallas_kernels/quantized_matmul.py. kF32 is not quantized: a float model's
// matrix as f32 rows [out, in] (its kernel transposed), read as they are.
enum class Format : int {
  kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kInt8 = 3, kF32 = 4, kQ5_0 = 5, kQ5_1 = 6, kQ4_K = 7, kQ5_K = 8, kQ6_K = 9
};
constexpr int kNumFormats = 10;

// pick.template operator()<F>() for the F that f names: the one switch from a format number to a
// kernel's instantiation, for both matmul kernels (`pick` a lambda template<Format F>).
template <typename Pick>
auto with_format(Format f, Pick pick) {
  switch (f) {
    case Format::kQ4_0: return pick.template operator()<Format::kQ4_0>();
    case Format::kQ4_1: return pick.template operator()<Format::kQ4_1>();
    case Format::kQ8_0: return pick.template operator()<Format::kQ8_0>();
    case Format::kQ5_0: return pick.template operator()<Format::kQ5_0>();
    case Format::kQ5_1: return pick.template operator()<Format::kQ5_1>();
    case Format::kQ4_K: return pick.template operator()<Format::kQ4_K>();
    case Format::kQ5_K: return pick.template operator()<Format::kQ5_K>();
    case Format::kQ6_K: return pick.template operator()<Format::kQ6_K>();
    case Format::kInt8: return pick.template operator()<Format::kInt8>();
    default: return pick.template operator()<Format::kF32>();
  }
}

constexpr bool is_k_quant(Format f) { return f == Format::kQ4_K || f == Format::kQ5_K || f == Format::kQ6_K; }
// 32-weight blocks in one stored block: a K-quant super-block holds 8 (256 weights).
constexpr int64_t sub_blocks(Format f) { return is_k_quant(f) ? 8 : 1; }

constexpr int64_t block_bytes(Format f) {
  switch (f) {
    case Format::kQ4_0: return 18;
    case Format::kQ4_1: return 20;
    case Format::kQ8_0: return 34;
    case Format::kQ5_0: return 22;
    case Format::kQ5_1: return 24;
    case Format::kQ4_K: return 144;
    case Format::kQ5_K: return 176;
    case Format::kQ6_K: return 210;
    case Format::kInt8: return kBlock;
    default: return 4 * kBlock;
  }
}

// IEEE half to float, exact for every value (normal, subnormal, zero, inf, NaN): a normal half's
// exponent is rebiased by a multiply by 2^-112; a subnormal one is built as (1 + m / 2^10) * 2^-14
// minus 2^-14, exact in f32.
inline float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  auto from_bits = [](uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  auto to_bits = [](float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return bits;
  };
  const float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  return from_bits(sign | (two_w < (1u << 27) ? to_bits(denormalized) : to_bits(normalized)));
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct Problem {
  const float* x;       // [T, in]
  const uint8_t* w;     // [out, row_bytes] (f32 rows for kF32)
  const float* scales;  // [out] (int8 only)
  float* out;           // [T, out]
  int64_t tokens, in, out_features, row_bytes, blocks;  // blocks: of 32 weights (8 per K-quant super-block)
};

}  // namespace orca_qmm


namespace orca_qmm {
// A work item: rows [first, end) of problems[problem], at most kRowsPerItem of them.
struct Item {
  int64_t problem, first, end;
};

// Every problem's rows cut into items, problem after problem (all threads share them out at once).
inline std::vector<Item> work_items(const std::vector<Problem>& problems) {
  std::vector<Item> items;
  for (size_t m = 0; m < problems.size(); ++m)
    for (int64_t first = 0; first < problems[m].out_features; first += kRowsPerItem)
      items.push_back({static_cast<int64_t>(m), first, std::min<int64_t>(first + kRowsPerItem, problems[m].out_features)});
  return items;
}

// The matmuls with int8 activations (quantized_matmul_int8.cc) of problems (of one x; formats fs,
// not kF32), with the instruction-set variant `isa` (numbered as pallas_kernels/native.py's ISAS).
void int8_activations_matmul(xla::ffi::ThreadPool& pool, const std::vector<Problem>& problems,
                             const std::vector<Format>& fs, int isa);
}  // namespace orca_qmm
