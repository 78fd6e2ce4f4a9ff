// The quantized matmul with int8 activations (llama.cpp's method), called by quantized_matmul.cc's
// handler when its `int8_activations` attribute is set: x's rows are quantized to 8 bits per
// 32-value block, then multiplied by the weights' integers with integer dot products and scaled in
// f32. pallas_kernels/int8_activations.py states the arithmetic and replays it in numpy; this code
// must equal it bit for bit, in every variant: the integer lanes are exact, and the float operations
// (each written out, nothing fused but the fused multiply-adds written) are the same in every variant.

#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "quantized_matmul.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace orca_qmm {
namespace {

// Blocks per step (G): Q6_K, whose block halves have scales of their own, takes pairs (its lanes
// each sum 4 products); every other format's block shares one scale between its halves, so a lane
// sums 4 products of each half as int32 before the float step, and 4 blocks fill the 16 lanes: the
// conversion, scale multiply and fma run once per 128 weights instead of 64 (the one-token loop is
// bound by these instructions, not by memory).
constexpr int step_blocks(Format f) { return f == Format::kQ6_K ? 2 : 4; }

// x quantized, per token and step of G blocks (blocks Gs .. Gs + G - 1), in lane order: byte
// 16G h + 16e + i is q_x of weight 16h + i of block Gs + e, and lane l sums the products of bytes
// 4l + i and, for G = 4, 64 + 4l + i (i < 4). Steps past the last block have zero blocks.
struct Activations {
  int blocks_per_step = 2;         // G
  int64_t steps = 0, groups = 0;   // groups: of 16 blocks (the minimums' unit)
  std::vector<int8_t> q;           // [T, steps, 32 G]
  std::vector<int32_t> init;       // [T, steps, 16]: -offset * (sum of the lane's q_x), where lanes start
  std::vector<float> d;            // [T, steps, 16]: the lane's block's d_x
  std::vector<float> block_sums;   // [T, groups * 16]: f32(float(sum of the block's 32 q_x) * d_x), zeros after the last

  // Laid out, zeroed, for `tokens` rows of `blocks` blocks in steps of G (keeping the capacity).
  void reset(int64_t tokens, int64_t blocks, int G) {
    blocks_per_step = G;
    steps = (blocks + G - 1) / G;
    const size_t lanes = static_cast<size_t>(tokens * steps * kLanes);
    q.assign(2 * G * lanes, 0);
    init.assign(lanes, 0);
    d.assign(lanes, 0.0f);
    groups = (blocks + 15) / 16;
    block_sums.assign(static_cast<size_t>(tokens * groups * kLanes), 0.0f);
  }
};

// Calls of at least this many tokens quantize x over the pool's threads.
constexpr int64_t kTokensQuantizedInParallel = 64;

}  // namespace

// The kernel, once per instruction set, numbered as pallas_kernels/native.py's ISAS.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,avx2,bmi2,fma,f16c,prefer-vector-width=512")
namespace avx512vnni {
#define ORCA_Q8_ISA 0
#include "quantized_matmul_int8_kernel.inc"
#undef ORCA_Q8_ISA
}  // namespace avx512vnni
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,bmi2,fma,f16c,prefer-vector-width=512")
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

// The offset of format f's weight integers in variant isa (the kernel's weight_offset).
int32_t q_offset(Format f, int isa) {
#if defined(__x86_64__)
  switch (isa) {
    case 0: return avx512vnni::weight_offset(f);
    case 1: return avx512::weight_offset(f);
    case 2: return avxvnni::weight_offset(f);
    case 3: return avx2::weight_offset(f);
    default: break;
  }
#endif
  return base::weight_offset(f);
}

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
  // x quantized once per distinct offset and step (the matrices of one layer share them, mostly): a
  // few KB per token, on the calling thread, or shared out over the pool for a prompt chunk's many
  // tokens (on one thread, quantizing 512 tokens took about a tenth of the call; a decode step's few
  // are not worth waking a pool thread for). The buffers are the calling thread's own and keep their capacity from
  // call to call: allocated anew, a prompt chunk's were fresh pages from the kernel on every call.
  // (Named through a reference: the lambdas below, run on pool threads, must see this thread's.)
  thread_local std::vector<Activations> buffers;
  std::vector<Activations>& quantized = buffers;
  std::vector<std::pair<int32_t, int>> layouts;
  std::vector<size_t> of_problem;
  const QuantizeFn quantize = pick_quantize(isa);
  for (Format f : fs) {
    const std::pair<int32_t, int> layout{q_offset(f, isa), step_blocks(f)};
    const size_t known = std::find(layouts.begin(), layouts.end(), layout) - layouts.begin();
    of_problem.push_back(known);
    if (known < layouts.size()) continue;
    layouts.push_back(layout);
    if (quantized.size() < layouts.size()) quantized.emplace_back();
    Activations& a = quantized[known];
    a.reset(first.tokens, first.blocks, layout.second);
    auto quantize_token = [&](int64_t t) { quantize(first, t, layout.first, a); };
    if (first.tokens >= kTokensQuantizedInParallel) {
      orca_native::parallel_for(pool, first.tokens, quantize_token);
    } else {
      for (int64_t t = 0; t < first.tokens; ++t) quantize_token(t);
    }
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
