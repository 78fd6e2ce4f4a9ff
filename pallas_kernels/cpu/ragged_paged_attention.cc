// Ragged paged attention on the CPU, as an XLA typed-FFI custom call (see pallas_kernels/native.py
// for the contract, the build and the Python wrapper). q and the output are f32; the pages f32 or
// bf16 (converted as read); the math is f32.
//
// Work item = a run of up to kRunTokens consecutive tokens of one segment x one or more KV heads. An
// item reads its segment's pages in place, a chunk of up to 16 keys (within one page) at a time, and
// per KV head:
//   1. scores of the item's query rows of that head (its tokens x the G query heads sharing the KV
//      head) against the chunk's K rows, each K row loaded once for up to four rows;
//   2. one online-softmax update per row and chunk (masked keys get probability exactly zero);
//   3. the chunk's V rows added into the rows' accumulators, held in registers for the chunk.
// A decode token (a run of one) takes all KV heads in one item when there are enough of them, so its
// pages are read whole, in order, once per step; a prefill run splits by KV head (it reuses each
// K/V row for all its tokens: compute, not memory, bounds it); a step of too few decode tokens to
// keep the threads busy splits them further, by query head within each KV head. The rows a few
// chunks on are prefetched while this one is computed: pages lie anywhere, so the hardware
// prefetcher cannot guess them. Items are spread over XLA's intra-op thread pool; the calling
// thread works too. A row's arithmetic is the same whichever item holds it.
//
// Arithmetic is on 16-float vectors (vec16.h, which says how each instruction set holds them); the
// kernel (ragged_paged_attention_kernel.inc) is compiled for AVX-512, AVX2+FMA and baseline x86-64
// (or plain, elsewhere); the best the CPU has is picked at load, and a lower one may be selected
// (OrcaNativeSelectIsa) to test or time it. No -march=native: the .so may move between machines.

// Fused multiply-adds only where the kernel writes them (see the kernel .inc): the same bits from
// the AVX-512 and AVX2 variants.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "parallel_for.h"
#include "vec16.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRunTokens = 16;  // tokens of one segment sharing an item (prefill): K/V reuse
constexpr int64_t kSplitHeadMaxBytes = 512 << 10;  // a KV head's K and V rows, for query-head items
constexpr int64_t kPrefetchKeys = 64;  // how far ahead of its use a key's rows are asked for
using orca_vec16::kLanes;  // floats per vector, and keys per chunk
// Finite, as in the Pallas kernel: exp(MASK - MASK) stays finite; masked scores are also zeroed.
constexpr float kMask = -0.7f * 3.4028234663852886e38f;

struct Item {
  int64_t start, count;  // tokens [start, start + count): one segment's, or all padding
  int64_t first_kv_head, num_kv_heads;
  // Query heads [first_query, first_query + queries) of each KV head's group; 0 queries: the whole
  // group. Only an item of one KV head takes part of its group.
  int64_t first_query = 0, queries = 0;
};

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int32_t* segment_ids;
  const int32_t* positions;
  const int32_t* block_tables;
  const int32_t* kv_lens;
  int64_t num_heads, num_kv_heads, group, head_dim;
  int64_t num_pages, page_size, num_seqs, max_pages;
  float sm_scale;
  int64_t sliding_window;  // tokens; 0: none (a token at p sees keys at positions > p - window)
  float soft_cap;          // 0: none (scores s -> cap * tanh(s / cap))
  std::vector<Item> items;
};

// Cached key rows read (keys x KV heads), over all calls: lets tests count what a sliding window
// saves. One relaxed add per work item.
std::atomic<int64_t> g_keys_read{0};

// ---- conversions -----------------------------------------------------------------------------

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ---- the kernel, once per instruction set (ragged_paged_attention_kernel.inc) -------------------

#define ORCA_KERNEL_FILE "ragged_paged_attention_kernel.inc"
#include "per_isa.h"
#undef ORCA_KERNEL_FILE

using ItemFn = void (*)(const Problem&, const Item&);

// The order is the one OrcaNativeIsa / OrcaNativeSelectIsa use (pallas_kernels/native.py, ISAS). The
// VNNI variants matter to the int8-activation matmul (quantized_matmul_int8.cc); the float kernels
// run their AVX-512 or AVX2 code there.
enum class Isa : int { kAvx512Vnni = 0, kAvx512 = 1, kAvxVnni = 2, kAvx2 = 3, kBase = 4 };
constexpr int kNumIsas = 5;

bool cpu_has([[maybe_unused]] Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // BMI2 (pext, in the int8 matmul's Q5 unpacking) comes with every CPU that has AVX-512 BW.
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("bmi2");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == Isa::kAvx512Vnni) return avx512 && __builtin_cpu_supports("avx512vnni");
  if (isa == Isa::kAvx512) return avx512;
  if (isa == Isa::kAvxVnni) {  // CPUID.(7, 1):EAX bit 4 (GCC 11's __builtin_cpu_supports may not know it)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return avx2 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax >> 4 & 1);
  }
  if (isa == Isa::kAvx2) return avx2;
#endif
  return isa == Isa::kBase;
}

Isa best_isa() {
  for (Isa isa : {Isa::kAvx512Vnni, Isa::kAvx512, Isa::kAvxVnni, Isa::kAvx2}) {
    if (cpu_has(isa)) return isa;
  }
  return Isa::kBase;
}

// The variant every call uses: the best the CPU has, unless a test or benchmark selected a lower one
// (each call reads it once, so a switch between calls is safe).
std::atomic<Isa> g_isa{best_isa()};

template <typename KVT, int NV>
ItemFn pick_isa() {
#if defined(__x86_64__)
  const Isa isa = g_isa.load(std::memory_order_relaxed);
  if (isa == Isa::kAvx512Vnni || isa == Isa::kAvx512) return avx512::item<KVT, NV>;
  if (isa == Isa::kAvxVnni || isa == Isa::kAvx2) return avx2::item<KVT, NV>;
#endif
  return base::item<KVT, NV>;
}

template <typename KVT>
ItemFn pick_head_dim(int64_t head_dim) {
  if (head_dim == 64) return pick_isa<KVT, 4>();
  if (head_dim == 128) return pick_isa<KVT, 8>();
  return pick_isa<KVT, 0>();
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                                ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> segment_ids,
                                ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                                int64_t sliding_window, float soft_cap, int64_t first_page, int64_t layer_pages) {
  // Shapes are validated in Python (the wrapper names the argument); these checks keep a direct
  // caller from reading out of bounds.
  auto q_dims = q.dimensions();
  auto kv_dims = k_pages.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 4 || v_pages.dimensions().size() != 4 ||
      block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention_native: bad ranks");
  // q and out are f32 (the wrapper converts bf16 ones: a few KB, against the pages' MBs).
  const bool kv_f32 = k_pages.element_type() == ffi::F32, kv_bf16 = k_pages.element_type() == ffi::BF16;
  if (q.element_type() != ffi::F32 || out->element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("ragged_paged_attention_native: q and out must be f32");
  if ((!kv_f32 && !kv_bf16) || v_pages.element_type() != k_pages.element_type())
    return ffi::Error::InvalidArgument("ragged_paged_attention_native: k_pages and v_pages must both be f32 or bf16");

  // The layer's pages are [first_page, first_page + layer_pages) of the arrays (the layers of a
  // stage share them: orca_jax.model.attention.KVCache), and its block tables count from first_page.
  if (first_page < 0 || layer_pages < 0 || first_page + layer_pages > kv_dims[0])
    return ffi::Error::InvalidArgument("ragged_paged_attention_native: the layer's pages lie outside k_pages");
  const int64_t page_bytes = kv_dims[1] * kv_dims[2] * kv_dims[3] * (kv_f32 ? 4 : 2);
  Problem p;
  p.q = q.untyped_data();
  p.k = static_cast<const char*>(k_pages.untyped_data()) + first_page * page_bytes;
  p.v = static_cast<const char*>(v_pages.untyped_data()) + first_page * page_bytes;
  p.out = out->untyped_data();
  p.segment_ids = segment_ids.typed_data();
  p.positions = positions.typed_data();
  p.block_tables = block_tables.typed_data();
  p.kv_lens = kv_lens.typed_data();
  const int64_t num_tokens = q_dims[0];
  p.num_heads = q_dims[1];
  p.head_dim = q_dims[2];
  p.num_pages = layer_pages;
  p.page_size = kv_dims[1];
  p.num_kv_heads = kv_dims[2];
  p.num_seqs = block_tables.dimensions()[0];
  p.max_pages = block_tables.dimensions()[1];
  p.sm_scale = sm_scale;
  p.sliding_window = sliding_window;
  p.soft_cap = soft_cap;
  if (sliding_window < 0 || !(soft_cap >= 0.0f))
    return ffi::Error::InvalidArgument("ragged_paged_attention_native: sliding_window and soft_cap must be >= 0");
  if (kv_dims[3] != p.head_dim || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads ||
      static_cast<int64_t>(segment_ids.element_count()) != num_tokens ||
      static_cast<int64_t>(positions.element_count()) != num_tokens ||
      static_cast<int64_t>(kv_lens.element_count()) != p.num_seqs)
    return ffi::Error::InvalidArgument("ragged_paged_attention_native: inconsistent shapes");
  p.group = p.num_heads / p.num_kv_heads;
  if (num_tokens == 0) return ffi::Error::Success();
  if (p.num_pages == 0 || p.max_pages == 0) {  // nothing to read: every row is zeros
    std::memset(p.out, 0, out->size_bytes());
    return ffi::Error::Success();
  }

  // Runs of consecutive tokens with the same segment id; any out-of-range id counts as one.
  auto segment_of = [&](int64_t t) {
    const int32_t s = p.segment_ids[t];
    return s >= 0 && s < p.num_seqs ? s : -1;
  };
  std::vector<std::pair<int64_t, int64_t>> runs;
  int64_t lone_tokens = 0, lone_keys = 0;  // the decode tokens, and the longest context among them
  for (int64_t t = 0; t < num_tokens;) {
    int64_t n = 1;
    while (t + n < num_tokens && n < kRunTokens && segment_of(t + n) == segment_of(t)) ++n;
    runs.emplace_back(t, n);
    if (n == 1) {
      ++lone_tokens;
      if (segment_of(t) >= 0) lone_keys = std::max<int64_t>(lone_keys, p.kv_lens[segment_of(t)]);
    }
    t += n;
  }
  // A lone (decode) token takes all KV heads in one item when there are enough such tokens to keep
  // the threads busy: its pages are then read whole and in order (each key slot's heads are
  // contiguous), which the hardware prefetcher follows. Runs of several tokens reuse every K/V row
  // many times (compute-bound), so they split by KV head for more, smaller items.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const bool whole_lone_tokens = lone_tokens >= 2 * threads;
  // Too few decode tokens for whole-token items (one request: SmolLM2's 3 KV heads gave 3 items for
  // 2 threads, and a thread woken late left the caller to work through most of them): each KV head's
  // query heads are shared out over `parts` items, as far as 4 items per thread, while the head's K
  // and V rows, read by every part, still fit a core's cache (a longer context has items enough,
  // and re-reading it from memory would cost more than the threads gain). One request on AMD EPYC
  // Zen 4, in the model's steps: 40 -> 30 us a call.
  const int64_t kv_head_bytes = 2 * lone_keys * p.head_dim * (kv_f32 ? 4 : 2);
  const int64_t parts = lone_tokens == 0 || kv_head_bytes > kSplitHeadMaxBytes
                            ? 1
                            : std::clamp<int64_t>((4 * threads + lone_tokens * p.num_kv_heads - 1) /
                                                      (lone_tokens * p.num_kv_heads), 1, p.group);
  for (auto [start, count] : runs) {
    if (count == 1 && whole_lone_tokens) {
      p.items.push_back({start, count, 0, p.num_kv_heads});
    } else if (count == 1 && parts > 1) {
      for (int64_t h = 0; h < p.num_kv_heads; ++h)
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t first = p.group * part / parts, next = p.group * (part + 1) / parts;
          p.items.push_back({start, count, h, 1, first, next - first});
        }
    } else {
      for (int64_t h = 0; h < p.num_kv_heads; ++h) p.items.push_back({start, count, h, 1});
    }
  }

  ItemFn item = kv_f32 ? pick_head_dim<float>(p.head_dim) : pick_head_dim<uint16_t>(p.head_dim);
  orca_native::parallel_for(pool, static_cast<int64_t>(p.items.size()), [&](int64_t i) { item(p, p.items[i]); });
  return ffi::Error::Success();
}

// ---- writing this call's K/V into the pages ---------------------------------------------------

// f32 to bf16, rounding to nearest even (as XLA's convert does for finite values).
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Token t's K/V rows ([K * Dh] f32) into slot slot_mapping[t] of the pages, in place: the outputs
// alias the page arguments. XLA:CPU scatters into a bf16 array by converting the whole array to f32
// and back (25 ms a layer for SmolLM2's 1 GiB cache), so bf16 pages are written here instead.
ffi::Error WriteKV(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> k_out,
                   ffi::Result<ffi::AnyBuffer> v_out, int64_t first_page, int64_t layer_pages) {
  auto kv_dims = k_pages.dimensions();
  const bool f32 = k_pages.element_type() == ffi::F32, bf16 = k_pages.element_type() == ffi::BF16;
  if (kv_dims.size() != 4 || (!f32 && !bf16) || v_pages.element_type() != k_pages.element_type() ||
      k_out->untyped_data() != k_pages.untyped_data() || v_out->untyped_data() != v_pages.untyped_data())
    return ffi::Error::InvalidArgument("write_kv_native: pages must be f32 or bf16 and aliased by the outputs");
  if (first_page < 0 || layer_pages < 0 || first_page + layer_pages > kv_dims[0])
    return ffi::Error::InvalidArgument("write_kv_native: the layer's pages lie outside the page arrays");
  // Slots count from the layer's first page (as ragged_paged_attention's block tables do).
  const int64_t row = kv_dims[2] * kv_dims[3], num_slots = layer_pages * kv_dims[1], first_slot = first_page * kv_dims[1];
  const int64_t num_tokens = slot_mapping.element_count();
  if (static_cast<int64_t>(k.element_count()) != num_tokens * row ||
      static_cast<int64_t>(v.element_count()) != num_tokens * row)
    return ffi::Error::InvalidArgument("write_kv_native: k and v must be [T, K, Dh] of the pages' K and Dh");
  const int32_t* slots = slot_mapping.typed_data();
  for (auto [src, dst] : {std::pair{k.typed_data(), k_out->untyped_data()}, {v.typed_data(), v_out->untyped_data()}}) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (slots[t] < 0 || slots[t] >= num_slots) continue;  // out of the layer's pages: nothing to write
      const int64_t slot = first_slot + slots[t];
      const float* from = src + t * row;
      if (f32) {
        std::memcpy(static_cast<float*>(dst) + slot * row, from, row * sizeof(float));
      } else {
        uint16_t* to = static_cast<uint16_t*>(dst) + slot * row;
        for (int64_t i = 0; i < row; ++i) to[i] = f32_to_bf16(from[i]);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// The exported symbols (the library is built with -fvisibility=hidden, so nothing else in it can
// clash with the process's other copies of the FFI helpers).
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* OrcaRaggedPagedAttention(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* OrcaWriteKV(XLA_FFI_CallFrame*);

// The instruction set the kernels run with (Isa's numbering), and a switch to another the CPU has,
// for tests and benchmarks that compare the variants: returns 0, changing nothing, if it lacks it.
extern "C" __attribute__((visibility("default"))) int OrcaNativeIsa() { return static_cast<int>(g_isa.load()); }
extern "C" __attribute__((visibility("default"))) int64_t OrcaNativeKeysRead() { return g_keys_read.load(); }
extern "C" __attribute__((visibility("default"))) int OrcaNativeCpuHas(int isa) {
  return isa >= 0 && isa < kNumIsas && cpu_has(static_cast<Isa>(isa));
}
extern "C" __attribute__((visibility("default"))) int OrcaNativeSelectIsa(int isa) {
  if (!OrcaNativeCpuHas(isa)) return 0;
  g_isa.store(static_cast<Isa>(isa));
  return 1;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OrcaWriteKV, WriteKV,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [T, K, Dh]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Ret<ffi::AnyBuffer>()  // k_pages, aliased
                                  .Ret<ffi::AnyBuffer>()  // v_pages, aliased
                                  .Attr<int64_t>("first_page")  // the layer's pages: [first_page,
                                  .Attr<int64_t>("layer_pages"));  //   first_page + layer_pages)

XLA_FFI_DEFINE_HANDLER_SYMBOL(OrcaRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k_pages
                                  .Arg<ffi::AnyBuffer>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // segment_ids
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")  // 0: none
                                  .Attr<float>("soft_cap")  // 0: none
                                  .Attr<int64_t>("first_page")  // the layer's pages: [first_page,
                                  .Attr<int64_t>("layer_pages"));  //   first_page + layer_pages)
