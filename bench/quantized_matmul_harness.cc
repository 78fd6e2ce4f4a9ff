// The quantized matmul kernel's own cost, without XLA: one thread calls a variant's Q4_1 work item
// directly on 1536 x 576 matrices (SmolLM2's gate/up shape) at 1, 4 and 16 tokens, and prints ns per
// 32-weight block and row. bench_quantized_matmul.py times the kernel as a model calls it (two
// threads, a fixed cost per call); this isolates the instructions of one block, for tuning a tile.
//
//   JAX_FFI=$(.venv/bin/python -c 'import jax; print(jax.ffi.include_dir())')
//   g++ -O3 -std=c++20 -I pallas_kernels/cpu -isystem "$JAX_FFI" bench/quantized_matmul_harness.cc -o /tmp/qm_harness
//   /tmp/qm_harness avx2 100     # variant (avx512, avx2, base: one the CPU has); matrices streamed
//
// With 1 matrix the weights stay in cache; with 100 (55 MB) they come from memory, as in a decode step.
#include "quantized_matmul.cc"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>

// The variant the kernel file's own dispatch (pick) takes: the library's selector, set from argv.
static int g_isa = -1;
extern "C" int OrcaNativeIsa() { return g_isa; }

int main(int argc, char** argv) {
  const char* names[] = {"avx512", "avx2", "base"};  // OrcaNativeIsa's numbering
  const char* isa = argc > 1 ? argv[1] : "avx2";
  const int matrices = argc > 2 ? std::atoi(argv[2]) : 1;
  for (int i = 0; i < 3; ++i)
    if (!std::strcmp(isa, names[i])) g_isa = i;
#if defined(__x86_64__)
  // A variant the CPU lacks would die on its first instruction.
  if ((g_isa == 0 && !__builtin_cpu_supports("avx512f")) || (g_isa == 1 && !__builtin_cpu_supports("avx2"))) g_isa = -1;
#else
  if (g_isa != 2) g_isa = -1;
#endif
  if (g_isa < 0 || matrices < 1) {
    std::fprintf(stderr, "usage: %s avx512|avx2|base [matrices >= 1] (a variant this CPU has)\n", argv[0]);
    return 2;
  }
  const ItemFn item = pick(Format::kQ4_1);
  const int64_t out = 1536, in = 576, blocks = in / kBlock, row_bytes = blocks * block_bytes(Format::kQ4_1);
  std::vector<uint8_t> w(static_cast<size_t>(matrices) * out * row_bytes);
  std::mt19937 rng(0);
  for (auto& byte : w) byte = static_cast<uint8_t>(rng());
  const int64_t bytes = block_bytes(Format::kQ4_1);
  for (uint8_t* block = w.data(); block < w.data() + w.size(); block += bytes) {  // f16 d = 0.0664, m = -d
    block[0] = 0x40, block[1] = 0x2c, block[2] = 0x40, block[3] = 0xac;
  }
  std::printf("Q4_1, %s variant, %d matrices of %lld x %lld, one thread\n", isa, matrices, static_cast<long long>(out),
              static_cast<long long>(in));
  for (int tokens : {1, 4, 16}) {
    std::vector<float> x(tokens * in), y(tokens * out);
    for (auto& v : x) v = std::uniform_real_distribution<float>(-1, 1)(rng);
    Problem p{x.data(), nullptr, nullptr, y.data(), tokens, in, out, row_bytes, blocks};
    double best = 1e30;
    for (int repeat = 0; repeat < 20; ++repeat) {
      const auto start = std::chrono::steady_clock::now();
      for (int m = 0; m < matrices; ++m) {
        p.w = w.data() + static_cast<size_t>(m) * out * row_bytes;
        item(p, 0, out);
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    const double block_rows = static_cast<double>(matrices) * out * blocks;
    std::printf("T=%2d: %6.2f ns per block and row (%5.2f per block, row and token), %5.1f GB/s of weights\n", tokens,
                best / block_rows * 1e9, best / block_rows / tokens * 1e9, matrices * out * row_bytes / best / 1e9);
  }
  return 0;
}
