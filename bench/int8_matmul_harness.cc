// The int8-activation matmul kernel's instructions alone, without XLA, threads or memory: one thread
// calls a variant's work items directly on one matrix small enough to stay in cache, over and over,
// and prints the best ns per 32-weight block, output row and token, per format, for 1, 16 and 64
// tokens. bench_quantized_matmul.py times the kernel as a model calls it (two threads, weights from
// memory, a machine's noise); this is for comparing two builds of a tile or an unpacking, which
// moved this figure by a few percent reproducibly where the other moved by 20% from run to run.
//
//   JAX_FFI=$(.venv/bin/python -c 'import jax; print(jax.ffi.include_dir())')
//   g++ -O3 -std=c++20 -I pallas_kernels/cpu -isystem "$JAX_FFI" bench/int8_matmul_harness.cc -o /tmp/int8_harness
//   /tmp/int8_harness             # both x86 variants this file times need AVX-512 VNNI and AVX2
#include "quantized_matmul_int8.cc"

#include <chrono>
#include <cstdio>
#include <random>

using namespace orca_qmm;

enum class Variant { kAvx512Vnni, kAvx2 };

// Best ns per block, row and token over `reps` passes of every work item of an out x in matrix.
template <Format F, Variant V>
double ns_per_block(int64_t out, int64_t in, int64_t tokens, int reps) {
  const int64_t blocks = in / kBlock, row_bytes = blocks / sub_blocks(F) * block_bytes(F);
  std::mt19937 rng(1);
  std::vector<uint8_t> w(out * row_bytes);
  for (auto& byte : w) byte = rng() & 0x3F;  // small bytes: every f16 scale finite and normal
  std::vector<float> x(tokens * in), y(tokens * out);
  for (auto& v : x) v = static_cast<float>(rng() % 1000) / 500.0f - 1.0f;
  const Problem p{x.data(), w.data(), nullptr, y.data(), tokens, in, out, row_bytes, blocks};
  Activations a;
  a.reset(tokens, blocks, step_blocks(F));
  for (int64_t t = 0; t < tokens; ++t) {
    if constexpr (V == Variant::kAvx512Vnni) {
      avx512::quantize_row(p, t, avx512vnni::weight_offset(F), a);
    } else {
      avx2::quantize_row(p, t, avx2::weight_offset(F), a);
    }
  }
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t first = 0; first < out; first += kRowsPerItem) {
      const int64_t end = std::min<int64_t>(first + kRowsPerItem, out);
      if constexpr (V == Variant::kAvx512Vnni) {
        avx512vnni::item<F>(p, a, first, end);
      } else {
        avx2::item<F>(p, a, first, end);
      }
    }
    best = std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count());
  }
  return best / static_cast<double>(out * blocks * tokens);
}

template <Variant V>
void row(const char* name, int tokens) {
  // SmolLM2's 576-wide layers; the K-quants, whose rows are multiples of 256 weights, 768 wide.
  const int reps = tokens > 16 ? 60 : 200;
  std::printf("%-11s T=%2d  q4_0 %.3f  q4_1 %.3f  q5_0 %.3f  q8_0 %.3f  q4_k %.3f  q5_k %.3f  q6_k %.3f\n", name,
              tokens, ns_per_block<Format::kQ4_0, V>(576, 576, tokens, reps),
              ns_per_block<Format::kQ4_1, V>(576, 576, tokens, reps), ns_per_block<Format::kQ5_0, V>(576, 576, tokens, reps),
              ns_per_block<Format::kQ8_0, V>(576, 576, tokens, reps), ns_per_block<Format::kQ4_K, V>(512, 768, tokens, reps),
              ns_per_block<Format::kQ5_K, V>(512, 768, tokens, reps), ns_per_block<Format::kQ6_K, V>(512, 768, tokens, reps));
}

int main() {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx2")) {
    std::fprintf(stderr, "this harness times the avx512vnni and avx2 variants: the CPU lacks one\n");
    return 2;
  }
  std::printf("ns per 32-weight block, output row and token (one thread, weights in cache, best pass)\n");
  for (int tokens : {1, 16, 64}) {
    row<Variant::kAvx512Vnni>("avx512vnni", tokens);
    row<Variant::kAvx2>("avx2", tokens);
  }
  return 0;
#else
  std::fprintf(stderr, "x86-64 only\n");
  return 2;
#endif
}
