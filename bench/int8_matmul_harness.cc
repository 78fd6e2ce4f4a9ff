// The int8-activation matmul kernel's instructions alone, without XLA, threads or memory: one thread
// calls a variant's work items directly on one matrix small enough to stay in cache, over and over,
// and prints the best ns per 32-weight block, output row and token, per format, for 1, 16 and 64
// tokens. bench_quantized_matmul.py times the kernel as a model calls it (two threads, weights from
// memory, a machine's noise); this is for comparing two builds of a tile or an unpacking, which
// moved this figure by a few percent reproducibly where the other moved by 20% from run to run.
//
// `stream [THREADS] [avx2]` instead times one decode token through every matrix of the SmolLM2
// Q4_K_M file (Q5_0 layers, Q8_0 or Q5_0 v, Q4_K or Q6_K down, the Q8_0 LM head: 95 MB, from
// memory), in the model's order, on THREADS threads (default 2) that share each call's work items in
// contiguous halves and meet at a spinning barrier after it, as llama.cpp's threads do: what the
// kernel does with memory and the cores to itself, for comparing with the model's matmul time in
// bench/profile_decode_step.py.
//
//   JAX_FFI=$(.venv/bin/python -c 'import jax; print(jax.ffi.include_dir())')
//   g++ -O3 -std=c++20 -I pallas_kernels/cpu -isystem "$JAX_FFI" bench/int8_matmul_harness.cc -o /tmp/int8_harness -lpthread
//   /tmp/int8_harness             # avx2, and avx512vnni where the CPU has it
//   /tmp/int8_harness stream 2
#include "quantized_matmul_int8.cc"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

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
  const std::vector<float> scales(out, 0.01f);  // int8's per-row scales
  const Problem p{x.data(), w.data(), scales.data(), y.data(), tokens, in, out, row_bytes, blocks};
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
  std::printf("%-11s T=%2d  q4_0 %.3f  q4_1 %.3f  q5_0 %.3f  q5_1 %.3f  q8_0 %.3f  int8 %.3f  q4_k %.3f  q5_k %.3f  q6_k %.3f\n",
              name, tokens, ns_per_block<Format::kQ4_0, V>(576, 576, tokens, reps),
              ns_per_block<Format::kQ4_1, V>(576, 576, tokens, reps), ns_per_block<Format::kQ5_0, V>(576, 576, tokens, reps),
              ns_per_block<Format::kQ5_1, V>(576, 576, tokens, reps), ns_per_block<Format::kQ8_0, V>(576, 576, tokens, reps),
              ns_per_block<Format::kInt8, V>(576, 576, tokens, reps), ns_per_block<Format::kQ4_K, V>(512, 768, tokens, reps),
              ns_per_block<Format::kQ5_K, V>(512, 768, tokens, reps), ns_per_block<Format::kQ6_K, V>(512, 768, tokens, reps));
}

template <Variant V, Format F>
void run_item(const Problem& p, const Activations& a, int64_t first, int64_t end) {
  if constexpr (V == Variant::kAvx512Vnni) {
    avx512vnni::item<F>(p, a, first, end);
  } else {
    avx2::item<F>(p, a, first, end);
  }
}

// One decode token through the Q4_K_M file's matrices, `threads` threads, weights from memory.
template <Variant V>
void stream(int threads) {
  struct Matrix {
    Format f;
    int64_t out, in, row_bytes;
    const uint8_t* w;
  };
  std::vector<Matrix> matrices;
  auto add = [&](Format f, int64_t out, int64_t in) {
    matrices.push_back({f, out, in, in / kBlock / sub_blocks(f) * block_bytes(f), nullptr});
  };
  for (int layer = 0; layer < 30; ++layer) {  // the file's types: v and down alternate between two
    add(Format::kQ5_0, 576, 576);
    add(Format::kQ5_0, 192, 576);
    add(layer % 2 ? Format::kQ5_0 : Format::kQ8_0, 192, 576);
    add(Format::kQ5_0, 576, 576);
    add(Format::kQ5_0, 1536, 576);
    add(Format::kQ5_0, 1536, 576);
    add(layer % 2 ? Format::kQ4_K : Format::kQ6_K, 576, 1536);
  }
  add(Format::kQ8_0, 49152, 576);
  size_t total = 0;
  for (const Matrix& m : matrices) total += m.out * m.row_bytes;
  std::vector<uint8_t> weights(total);
  std::mt19937 rng(1);
  for (auto& byte : weights) byte = rng() & 0x3F;  // small bytes: every f16 scale finite and normal
  size_t at = 0;
  for (Matrix& m : matrices) m.w = weights.data() + at, at += m.out * m.row_bytes;
  // x quantized once per layout (the model does it per call: a few hundred ns for one token).
  std::vector<float> x(1536, 0.5f), y(49152);
  std::vector<Activations> quantized(matrices.size());
  for (size_t i = 0; i < matrices.size(); ++i) {
    const Matrix& m = matrices[i];
    const Problem p{x.data(), m.w, nullptr, y.data(), 1, m.in, m.out, m.row_bytes, m.in / kBlock};
    quantized[i].reset(1, p.blocks, step_blocks(m.f));
    if constexpr (V == Variant::kAvx512Vnni) {
      avx512::quantize_row(p, 0, avx512vnni::weight_offset(m.f), quantized[i]);
    } else {
      avx2::quantize_row(p, 0, avx2::weight_offset(m.f), quantized[i]);
    }
  }
  std::atomic<int64_t> arrived{0};
  std::vector<double> ms;
  const int passes = 60;
  auto work = [&](int thread) {
    int64_t calls = 0;
    for (int pass = 0; pass < passes; ++pass) {
      const auto start = std::chrono::steady_clock::now();
      for (size_t i = 0; i < matrices.size(); ++i) {
        const Matrix& m = matrices[i];
        const Problem p{x.data(), m.w, nullptr, y.data(), 1, m.in, m.out, m.row_bytes, m.in / kBlock};
        const int64_t items = (m.out + kRowsPerItem - 1) / kRowsPerItem;
        for (int64_t item = items * thread / threads; item < items * (thread + 1) / threads; ++item) {
          const int64_t first = item * kRowsPerItem, end = std::min<int64_t>(first + kRowsPerItem, m.out);
          with_format(m.f, [&]<Format F>() {
            if constexpr (F != Format::kF32) run_item<V, F>(p, quantized[i], first, end);
          });
        }
        ++calls;  // the barrier: every thread done with this call
        arrived.fetch_add(1, std::memory_order_acq_rel);
        while (arrived.load(std::memory_order_acquire) < calls * threads) _mm_pause();
      }
      if (thread == 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
  };
  std::vector<std::thread> others;
  for (int t = 1; t < threads; ++t) others.emplace_back(work, t);
  work(0);
  for (auto& t : others) t.join();
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  std::printf("%s, %d thread(s), %zu MB a token: best %.3f ms, median %.3f ms (%.1f GB/s)\n",
              V == Variant::kAvx512Vnni ? "avx512vnni" : "avx2", threads, total >> 20, ms[0], median, total / median / 1e6);
}

int main(int argc, char** argv) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx2")) {
    std::fprintf(stderr, "this harness times the avx2 variant (and avx512vnni where the CPU has it): the CPU lacks AVX2\n");
    return 2;
  }
  const bool vnni = __builtin_cpu_supports("avx512vnni");  // an AVX2-only CPU (AMD Zen 2/3) times avx2 alone
  if (argc > 1 && std::strcmp(argv[1], "stream") == 0) {
    const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
    if ((argc > 3 && std::strcmp(argv[3], "avx2") == 0) || !vnni) {
      stream<Variant::kAvx2>(threads);
    } else {
      stream<Variant::kAvx512Vnni>(threads);
    }
    return 0;
  }
  std::printf("ns per 32-weight block, output row and token (one thread, weights in cache, best pass)\n");
  for (int tokens : {1, 16, 64}) {
    if (vnni) row<Variant::kAvx512Vnni>("avx512vnni", tokens);
    row<Variant::kAvx2>("avx2", tokens);
  }
  return 0;
#else
  std::fprintf(stderr, "x86-64 only\n");
  return 2;
#endif
}
