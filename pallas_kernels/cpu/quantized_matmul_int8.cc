// The quantized matmul with int8 activations (llama.cpp's method), called by quantized_matmul.cc's
// handler when its `int8_activations` attribute is set: x's rows are quantized to 8 bits per
// 32-value block, then multiplied by the weights' integers with integer dot products and scaled in
// f32. pallas_kernels/int8_activations.py states the arithmetic and replays it in numpy; this code
// must equal it bit for bit, in every variant: the integer lanes are exact, and the float operations
// (each written out, nothing fused but the fused multiply-adds written) are the same in every variant.

#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel_for.h"
#include "quantized_matmul.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace orca_qmm {
namespace {

// x quantized, per token and pair of blocks (blocks 2p and 2p + 1), in lane order: lane 8h + 4e + k
// covers weights 16h + 4k .. + 3 of block 2p + e. An odd count's last pair has a zero second block.
struct Activations {
  int64_t pairs = 0, groups = 0;  // groups: of 16 blocks (the minimums' unit)
  std::vector<int8_t> q;           // [T, pairs, 64]: byte 4 lane + i = q_x of the lane's weight i
  std::vector<int32_t> init;       // [T, pairs, 16]: -offset * (sum of the lane's 4 q_x), where lanes start
  std::vector<float> d;            // [T, pairs, 16]: the lane's block's d_x
  std::vector<float> block_sums;   // [T, groups * 16]: f32(float(sum of the block's 32 q_x) * d_x), zeros after the last
};

int32_t q_offset(Format f) {
  return f == Format::kQ4_0 ? 8 : f == Format::kQ5_0 ? 16 : f == Format::kQ6_K ? 32 : 0;
}

}  // namespace

// The kernel, once per instruction set, numbered as pallas_kernels/native.py's ISAS.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c,prefer-vector-width=512")
namespace avx512vnni {
#define ORCA_Q8_ISA 0
#include "quantized_matmul_int8_kernel.inc"
#undef ORCA_Q8_ISA
}  // namespace avx512vnni
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
namespace avx512 {
#define ORCA_Q8_ISA 1
#include "quantized_matmul_int8_kernel.inc"
#undef ORCA_Q8_ISA
}  // namespace avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")
namespace avxvnni {
#define ORCA_Q8_ISA 2
#include "quantized_matmul_int8_kernel.inc"
#undef ORCA_Q8_ISA
}  // namespace avxvnni
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define ORCA_Q8_ISA 3
#include "quantized_matmul_int8_kernel.inc"
#undef ORCA_Q8_ISA
}  // namespace avx2
#pragma GCC pop_options
#endif
namespace base {
#define ORCA_Q8_ISA 4
#include "quantized_matmul_int8_kernel.inc"
#undef ORCA_Q8_ISA
}  // namespace base

namespace {

using ItemFn = void (*)(const Problem&, const Activations&, int64_t, int64_t);
using QuantizeFn = void (*)(const Problem&, int64_t, int32_t, Activations&);

QuantizeFn pick_quantize(int isa) {
#if defined(__x86_64__)
  if (isa <= 1) return avx512::quantize_row;
  if (isa <= 3) return avx2::quantize_row;
#endif
  return base::quantize_row;
}

template <Format F>
ItemFn pick_isa(int isa) {
#if defined(__x86_64__)
  switch (isa) {
    case 0: return avx512vnni::item<F>;
    case 1: return avx512::item<F>;
    case 2: return avxvnni::item<F>;
    case 3: return avx2::item<F>;
    default: break;
  }
#endif
  return base::item<F>;
}

}  // namespace

void int8_activations_matmul(xla::ffi::ThreadPool& pool, const std::vector<Problem>& problems,
                             const std::vector<Format>& fs, int isa) {
  const Problem& first = problems[0];  // every problem has the same x
  // x quantized once per distinct offset (the matrices of one layer share one, mostly): a few KB per
  // token, on the calling thread, before the rows are shared out.
  std::vector<int32_t> offsets;
  std::vector<Activations> quantized;
  std::vector<size_t> of_problem;
  const QuantizeFn quantize = pick_quantize(isa);
  for (Format f : fs) {
    const int32_t offset = q_offset(f);
    const size_t known = std::find(offsets.begin(), offsets.end(), offset) - offsets.begin();
    of_problem.push_back(known);
    if (known < offsets.size()) continue;
    offsets.push_back(offset);
    Activations& a = quantized.emplace_back();
    a.pairs = (first.blocks + 1) / 2;
    const size_t lanes = static_cast<size_t>(first.tokens * a.pairs * kLanes);
    a.q.assign(4 * lanes, 0);
    a.init.assign(lanes, 0);
    a.d.assign(lanes, 0.0f);
    a.groups = (first.blocks + 15) / 16;
    a.block_sums.assign(static_cast<size_t>(first.tokens * a.groups * kLanes), 0.0f);
    for (int64_t t = 0; t < first.tokens; ++t) quantize(first, t, offset, a);
  }
  // (f32 rows have no int8 path: the handler refuses them before calling this.)
  std::vector<ItemFn> runs;
  for (Format f : fs)
    runs.push_back(with_format(f, [isa]<Format F>() -> ItemFn {
      if constexpr (F == Format::kF32) {
        return nullptr;
      } else {
        return pick_isa<F>(isa);
      }
    }));
  const std::vector<Item> items = work_items(problems);
  orca_native::parallel_for(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    runs[item.problem](problems[item.problem], quantized[of_problem[item.problem]], item.first, item.end);
  });
}

}  // namespace orca_qmm
