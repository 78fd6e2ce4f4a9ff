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
// K/V row for all its tokens: compute, not memory, bounds it). The next chunk's rows are prefetched
// while this one is computed: pages lie anywhere, so the hardware prefetcher cannot guess them.
// Items are spread over XLA's intra-op thread pool; the calling thread works too.
//
// Arithmetic is on 16-float vectors (GCC vector extensions), lowered per instruction set: every
// kernel is compiled for AVX-512, AVX2+FMA and baseline x86-64 (or plain, elsewhere); the best the
// CPU has is picked at load, and a lower one may be selected (OrcaNativeSelectIsa) to test or time
// it. No -march=native: the .so may move between machines.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRunTokens = 16;  // tokens of one segment sharing an item (prefill): K/V reuse
constexpr int kLanes = 16;      // floats per vector, and keys per chunk
// Finite, as in the Pallas kernel: exp(MASK - MASK) stays finite; masked scores are also zeroed.
constexpr float kMask = -0.7f * 3.4028234663852886e38f;

using vf = float __attribute__((vector_size(4 * kLanes)));
using vi = int32_t __attribute__((vector_size(4 * kLanes)));
using vu = uint32_t __attribute__((vector_size(4 * kLanes)));
using vh = uint16_t __attribute__((vector_size(2 * kLanes)));

struct Item {
  int64_t start, count;  // tokens [start, start + count): one segment's, or all padding
  int64_t first_kv_head, num_kv_heads;
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

// `n` values (f32 or bf16) from `src` into f32 `dst`, zero-padded to a whole number of vectors.
template <typename T>
__attribute__((always_inline)) inline void to_f32(const T* __restrict src, float* __restrict dst, int64_t n,
                                                  int64_t padded) {
  if constexpr (sizeof(T) == sizeof(float)) {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (n % kLanes == 0) {
    for (int64_t i = 0; i < n; i += kLanes) {
      vh h;
      std::memcpy(&h, src + i, sizeof h);
      const vf f = reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
      std::memcpy(dst + i, &f, sizeof f);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  }
  std::fill(dst + n, dst + padded, 0.0f);
}

__attribute__((always_inline)) inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

__attribute__((always_inline)) inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// ---- vector helpers --------------------------------------------------------------------------

// Lane k of the result = sum of the lanes of parts[k]: a transposing tree (15 adds, 30 shuffles for
// 16 dot products) instead of one horizontal reduction per dot product.
__attribute__((always_inline)) inline vf transpose_sum(vf* parts) {
  // At level b, lane i of group g = i / 2b takes lanes of x (i % 2b < b) or y, b apart.
  static constexpr vi lo[4] = {
      {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
      {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
      {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}};
  static constexpr vi hi[4] = {
      {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
      {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
      {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};
  int n = kLanes;
  for (int level = 0; level < 4; ++level, n /= 2)
    for (int j = 0; j < n / 2; ++j)
      parts[j] = __builtin_shuffle(parts[2 * j], parts[2 * j + 1], lo[level]) +
                 __builtin_shuffle(parts[2 * j], parts[2 * j + 1], hi[level]);
  return parts[0];
}

// Every lane of the result = max (sum) of v's lanes: four shuffle steps.
__attribute__((always_inline)) inline vf all_lanes_max(vf v) {
  static constexpr vi swap[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                                 {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                                 {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                                 {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
  for (const vi& mask : swap) {
    const vf w = __builtin_shuffle(v, mask);
    v = v > w ? v : w;
  }
  return v;
}

__attribute__((always_inline)) inline float lanes_sum(vf v) {
  static constexpr vi swap[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                                 {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                                 {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                                 {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
  for (const vi& mask : swap) v += __builtin_shuffle(v, mask);
  return v[0];
}

// exp(x) for x <= 0 as plain arithmetic (libm's expf is a scalar call per score): 2^n * e^r with
// |r| <= ln2/2 and a degree-6 polynomial, about 2 ulp.
__attribute__((always_inline)) inline vf exp_nonpositive(vf x) {
  x = x < -87.0f ? vf{} - 87.0f : x;  // e^-87 ~ 1.6e-38: still a normal float
  const float round = 12582912.0f;    // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.44269504088896341f + round) - round;
  const vf r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  vf p = vf{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * reinterpret_cast<vf>(bits);
}

// tanh(x) in plain arithmetic: an odd polynomial near 0 (where 1 - e^-2|x| would cancel), else
// (1 - e) / (1 + e) with e = e^-2|x|; within a few ulp of tanh.
__attribute__((always_inline)) inline vf tanh_vec(vf x) {
  const vf ax = x < 0.0f ? -x : x;
  const vf e = exp_nonpositive(-2.0f * ax);
  const vf far = (1.0f - e) / (1.0f + e);
  const vf x2 = ax * ax;  // Taylor to x^9: error below 3e-12 for |x| < 0.1
  const vf near = ax * (1.0f + x2 * (-1.0f / 3 + x2 * (2.0f / 15 + x2 * (-17.0f / 315 + x2 * (62.0f / 2835)))));
  const vf t = ax < 0.1f ? near : far;
  return x < 0.0f ? -t : t;
}

// ---- one work item ---------------------------------------------------------------------------

// Per-thread buffers, grown on demand and kept between calls (no allocation on the hot path).
struct Scratch {
  std::vector<float> q, acc, keys, values, zeros;
  std::vector<float> row_max, row_sum;
  std::vector<int64_t> limit, lowest, active;
  std::vector<int32_t> visible_start, visible_end;
};

// Online-softmax state of the item's rows.
struct Rows {
  float* q;        // [rows, width], scaled by sm_scale
  float* acc;      // [rows, width]
  float* row_max;  // [rows]
  float* row_sum;  // [rows]
};

// One chunk of 16 keys at positions `key_pos` (rows past the chunk's end point at zeros) for RB query
// rows of one KV head: each K and V row is loaded once for the RB rows. Row b sees the keys at
// positions [starts[b], ends[b]); scores are soft-capped when `soft_cap` > 0.
template <int RB, int NV>
__attribute__((always_inline)) inline void attend_chunk(Rows st, const int64_t* rows, const int32_t* starts,
                                                        const int32_t* ends, vi key_pos, float soft_cap,
                                                        const float* const* key_rows,
                                                        const float* const* value_rows, int64_t nv,
                                                        const char* const* prefetch, int64_t prefetch_bytes) {
  const int64_t width = nv * kLanes;
  vi visible[RB];
  for (int b = 0; b < RB; ++b) visible[b] = (key_pos < ends[b]) & (key_pos >= starts[b]);
  // 1. Scores: per key, RB dot products as vectors of partial sums, then one transposing sum each.
  vf parts[RB][kLanes];
  for (int j = 0; j < kLanes; ++j) {
    for (int64_t byte = 0; byte < prefetch_bytes; byte += 64) {
      __builtin_prefetch(prefetch[2 * j] + byte);
      __builtin_prefetch(prefetch[2 * j + 1] + byte);
    }
    vf dot[RB] = {};
    for (int64_t c = 0; c < nv; ++c) {
      const vf key = load(key_rows[j] + c * kLanes);
      for (int b = 0; b < RB; ++b) dot[b] += load(st.q + rows[b] * width + c * kLanes) * key;
    }
    for (int b = 0; b < RB; ++b) parts[b][j] = dot[b];
  }
  // 2. Online softmax per row; masked keys get probability exactly zero.
  alignas(64) float probs[RB][kLanes];
  float correction[RB];
  for (int b = 0; b < RB; ++b) {
    const int64_t r = rows[b];
    vf scores = transpose_sum(parts[b]);
    if (soft_cap > 0.0f) scores = soft_cap * tanh_vec(scores / soft_cap);
    scores = visible[b] ? scores : vf{} + kMask;
    const vf new_max = all_lanes_max(scores) > st.row_max[r] ? all_lanes_max(scores) : vf{} + st.row_max[r];
    const vf p = visible[b] ? exp_nonpositive(scores - new_max) : vf{};
    correction[b] = exp_nonpositive(vf{} + (st.row_max[r] - new_max[0]))[0];
    st.row_sum[r] = st.row_sum[r] * correction[b] + lanes_sum(p);
    st.row_max[r] = new_max[0];
    store(probs[b], p);
  }
  // 3. Values: the RB rows' accumulators in registers, a few vectors of the head at a time.
  constexpr int64_t kSpan = NV == 0 ? 1 : NV < 4 ? NV : 4;
  for (int64_t c0 = 0; c0 < nv; c0 += kSpan) {
    vf acc[RB][kSpan];
    for (int b = 0; b < RB; ++b)
      for (int64_t c = 0; c < kSpan; ++c) acc[b][c] = load(st.acc + rows[b] * width + (c0 + c) * kLanes) * correction[b];
    for (int j = 0; j < kLanes; ++j)
      for (int64_t c = 0; c < kSpan; ++c) {
        const vf value = load(value_rows[j] + (c0 + c) * kLanes);
        for (int b = 0; b < RB; ++b) acc[b][c] += probs[b][j] * value;
      }
    for (int b = 0; b < RB; ++b)
      for (int64_t c = 0; c < kSpan; ++c) store(st.acc + rows[b] * width + (c0 + c) * kLanes, acc[b][c]);
  }
}

// One work item: `count` consecutive tokens of one segment (or of padding) from `start`, against
// KV heads [first_kv_head, first_kv_head + num_kv_heads). NV: vectors per head (head dim / 16) when
// known at compile time, else 0 (any head dim, rows zero-padded to whole vectors).
template <typename KVT, int NV>
__attribute__((always_inline)) inline void attend_item(const Problem& p, const Item& item) {
  static thread_local Scratch s;
  const int64_t dh = p.head_dim, nv = NV ? NV : (dh + kLanes - 1) / kLanes, width = nv * kLanes;
  const int64_t group = p.group, heads = item.num_kv_heads, tokens = item.count;
  // Row r = (token i * heads + head h) * group + g: a token's rows are its query heads
  // first_kv_head * group onwards, contiguous in q and in the output.
  const int64_t rows = tokens * heads * group, row_heads = heads * group;
  const int64_t first_q_head = item.first_kv_head * group;
  auto q_offset = [&](int64_t i) { return ((item.start + i) * p.num_heads + first_q_head) * dh; };
  float* out = static_cast<float*>(p.out);

  const int32_t seg = p.segment_ids[item.start];
  int64_t end = 0;  // one past the last key position any row of the item sees
  int64_t begin = 0;  // the first key position any row sees (> 0 under a sliding window)
  if (seg >= 0 && seg < p.num_seqs) {
    const int64_t kv_len = std::min<int64_t>(p.kv_lens[seg], p.max_pages * p.page_size);
    s.limit.resize(tokens);
    s.lowest.resize(tokens);
    begin = kv_len;
    for (int64_t i = 0; i < tokens; ++i) {
      const int64_t position = p.positions[item.start + i];
      s.limit[i] = std::min<int64_t>(position + 1, kv_len);
      s.lowest[i] = p.sliding_window > 0 ? std::max<int64_t>(position - p.sliding_window + 1, 0) : 0;
      end = std::max(end, s.limit[i]);
      begin = std::min(begin, s.lowest[i]);
    }
  }
  if (end <= 0) {  // padding, or nothing visible: zeros
    for (int64_t i = 0; i < tokens; ++i) std::memset(out + q_offset(i), 0, row_heads * dh * sizeof(float));
    return;
  }

  s.q.resize(rows * width);
  s.acc.assign(rows * width, 0.0f);
  s.row_max.assign(rows, kMask);
  s.row_sum.assign(rows, 0.0f);
  s.keys.resize(kLanes * width);
  s.values.resize(kLanes * width);
  s.zeros.assign(width, 0.0f);
  s.active.resize(rows);
  s.visible_start.resize(rows);
  s.visible_end.resize(rows);
  const float* q = static_cast<const float*>(p.q);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t j = 0; j < row_heads; ++j) {
      float* row = s.q.data() + (i * row_heads + j) * width;
      to_f32(q + q_offset(i) + j * dh, row, dh, width);
      for (int64_t d = 0; d < dh; ++d) row[d] *= p.sm_scale;
    }

  const KVT* k_pages = static_cast<const KVT*>(p.k);
  const KVT* v_pages = static_cast<const KVT*>(p.v);
  const int64_t row_stride = p.num_kv_heads * dh;  // between consecutive keys of a page
  const int64_t head_bytes = dh * static_cast<int64_t>(sizeof(KVT));  // of one key row
  const int32_t* table = p.block_tables + seg * p.max_pages;
  // f32 rows of whole vectors are read in place; others are converted per chunk (once for all rows).
  constexpr bool kInPlace = sizeof(KVT) == sizeof(float) && NV > 0;
  const float* key_rows[kLanes];
  const float* value_rows[kLanes];

  // A chunk is up to 16 keys of one page; returns the index of its first key's row of the item's
  // first KV head.
  auto chunk_at = [&](int64_t base, int64_t& keys) {
    const int64_t page_slot = base / p.page_size, offset = base % p.page_size;
    keys = std::min({static_cast<int64_t>(kLanes), end - base, p.page_size - offset});
    const int64_t page = std::clamp<int64_t>(table[page_slot], 0, p.num_pages - 1);
    return (page * p.page_size + offset) * row_stride + item.first_kv_head * dh;
  };
  // Keys before `begin` are outside every row's window: their pages are not read.
  g_keys_read.fetch_add((end - begin) * heads, std::memory_order_relaxed);
  int64_t keys = 0, first_slot = chunk_at(begin, keys);
  for (int64_t base = begin; base < end;) {
    // Ask for the next chunk's rows now: its page is anywhere in memory (no stream for the
    // hardware prefetcher to follow), and this chunk's compute hides the latency.
    int64_t next_keys = 0, next_slot = 0;
    if (base + keys < end) {
      next_slot = chunk_at(base + keys, next_keys);
    }
    vi key_pos;
    for (int j = 0; j < kLanes; ++j) key_pos[j] = static_cast<int32_t>(base + j);

    for (int64_t h = 0; h < heads; ++h) {
      // Ask for the next chunk's rows of this head now: its page is anywhere in memory (no
      // stream for the hardware prefetcher to follow), and this head's compute hides the latency.
      // (spread over the first row block's keys, so the requests go out at the pace of the compute).
      const char* prefetch[2 * kLanes];
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t slot = next_slot + std::min(j, std::max<int64_t>(next_keys - 1, 0)) * row_stride + h * dh;
        prefetch[2 * j] = reinterpret_cast<const char*>(k_pages + slot);
        prefetch[2 * j + 1] = reinterpret_cast<const char*>(v_pages + slot);
      }
      const int64_t prefetch_bytes = head_bytes;
      for (int64_t j = 0; j < kLanes; ++j) {
        const KVT* k_row = k_pages + first_slot + j * row_stride + h * dh;
        const KVT* v_row = v_pages + first_slot + j * row_stride + h * dh;
        if (j >= keys) {
          key_rows[j] = value_rows[j] = s.zeros.data();
        } else if constexpr (kInPlace) {
          key_rows[j] = reinterpret_cast<const float*>(k_row);
          value_rows[j] = reinterpret_cast<const float*>(v_row);
        } else {
          key_rows[j] = s.keys.data() + j * width;
          value_rows[j] = s.values.data() + j * width;
          to_f32(k_row, s.keys.data() + j * width, dh, width);
          to_f32(v_row, s.values.data() + j * width, dh, width);
        }
      }
      // The rows that see some key of this chunk (a causal prefill's early tokens see none).
      int64_t active = 0;
      for (int64_t i = 0; i < tokens; ++i) {
        if (s.limit[i] <= base || s.lowest[i] >= base + keys) continue;
        const auto visible_end = static_cast<int32_t>(std::min(s.limit[i], base + keys));
        for (int64_t g = 0; g < group; ++g) {
          s.active[active] = (i * heads + h) * group + g;
          s.visible_start[active] = static_cast<int32_t>(s.lowest[i]);
          s.visible_end[active++] = visible_end;
        }
      }
      const Rows st{s.q.data(), s.acc.data(), s.row_max.data(), s.row_sum.data()};
      for (int64_t b = 0; b < active; b += 4) {
        const int64_t* r = s.active.data() + b;
        const int32_t* starts = s.visible_start.data() + b;
        const int32_t* ends = s.visible_end.data() + b;
        switch (std::min<int64_t>(active - b, 4)) {
          case 4: attend_chunk<4, NV>(st, r, starts, ends, key_pos, p.soft_cap, key_rows, value_rows, nv, prefetch, b ? 0 : prefetch_bytes); break;
          case 3: attend_chunk<3, NV>(st, r, starts, ends, key_pos, p.soft_cap, key_rows, value_rows, nv, prefetch, b ? 0 : prefetch_bytes); break;
          case 2: attend_chunk<2, NV>(st, r, starts, ends, key_pos, p.soft_cap, key_rows, value_rows, nv, prefetch, b ? 0 : prefetch_bytes); break;
          default: attend_chunk<1, NV>(st, r, starts, ends, key_pos, p.soft_cap, key_rows, value_rows, nv, prefetch, b ? 0 : prefetch_bytes); break;
        }
      }
    }
    base += keys;
    keys = next_keys;
    first_slot = next_slot;
  }

  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t j = 0; j < row_heads; ++j) {
      const int64_t r = i * row_heads + j;
      const float inv = s.row_sum[r] > 0.0f ? 1.0f / s.row_sum[r] : 0.0f;  // no key at all: zeros
      const float* acc = s.acc.data() + r * width;
      float* dst = out + q_offset(i) + j * dh;
      for (int64_t d = 0; d < dh; ++d) dst[d] = acc[d] * inv;
    }
}

using ItemFn = void (*)(const Problem&, const Item&);

// Each (dtype, head dim) variant compiled for three instruction sets; the dispatch picks one.
#if defined(__x86_64__)
#define ORCA_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,prefer-vector-width=512")))
#define ORCA_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ORCA_ISA_VARIANTS(X) X(avx512, ORCA_TARGET_AVX512) X(avx2, ORCA_TARGET_AVX2) X(base, )
#else
#define ORCA_ISA_VARIANTS(X) X(base, )
#endif

#define ORCA_DEFINE_ISA(NAME, TARGET)                                                  \
  template <typename KVT, int NV>                                          \
  TARGET void item_##NAME(const Problem& p, const Item& item) {                         \
    attend_item<KVT, NV>(p, item);                                                 \
  }
ORCA_ISA_VARIANTS(ORCA_DEFINE_ISA)

// The order is the one OrcaNativeIsa / OrcaNativeSelectIsa use (pallas_kernels/native.py, ISAS).
enum class Isa : int { kAvx512 = 0, kAvx2 = 1, kBase = 2 };

bool cpu_has([[maybe_unused]] Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == Isa::kAvx512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == Isa::kBase;
}

Isa best_isa() {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2}) {
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
  if (isa == Isa::kAvx512) return item_avx512<KVT, NV>;
  if (isa == Isa::kAvx2) return item_avx2<KVT, NV>;
#endif
  return item_base<KVT, NV>;
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
                                int64_t sliding_window, float soft_cap) {
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

  Problem p;
  p.q = q.untyped_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.out = out->untyped_data();
  p.segment_ids = segment_ids.typed_data();
  p.positions = positions.typed_data();
  p.block_tables = block_tables.typed_data();
  p.kv_lens = kv_lens.typed_data();
  const int64_t num_tokens = q_dims[0];
  p.num_heads = q_dims[1];
  p.head_dim = q_dims[2];
  p.num_pages = kv_dims[0];
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
  int64_t lone_tokens = 0;
  for (int64_t t = 0; t < num_tokens;) {
    int64_t n = 1;
    while (t + n < num_tokens && n < kRunTokens && segment_of(t + n) == segment_of(t)) ++n;
    runs.emplace_back(t, n);
    lone_tokens += n == 1;
    t += n;
  }
  // A lone (decode) token takes all KV heads in one item when there are enough such tokens to keep
  // the threads busy: its pages are then read whole and in order (each key slot's heads are
  // contiguous), which the hardware prefetcher follows. Runs of several tokens reuse every K/V row
  // many times (compute-bound), so they split by KV head for more, smaller items.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const bool whole_lone_tokens = lone_tokens >= 2 * threads;
  for (auto [start, count] : runs) {
    if (count == 1 && whole_lone_tokens) {
      p.items.push_back({start, count, 0, p.num_kv_heads});
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
                   ffi::Result<ffi::AnyBuffer> v_out) {
  auto kv_dims = k_pages.dimensions();
  const bool f32 = k_pages.element_type() == ffi::F32, bf16 = k_pages.element_type() == ffi::BF16;
  if (kv_dims.size() != 4 || (!f32 && !bf16) || v_pages.element_type() != k_pages.element_type() ||
      k_out->untyped_data() != k_pages.untyped_data() || v_out->untyped_data() != v_pages.untyped_data())
    return ffi::Error::InvalidArgument("write_kv_native: pages must be f32 or bf16 and aliased by the outputs");
  const int64_t row = kv_dims[2] * kv_dims[3], num_slots = kv_dims[0] * kv_dims[1];
  const int64_t num_tokens = slot_mapping.element_count();
  if (static_cast<int64_t>(k.element_count()) != num_tokens * row ||
      static_cast<int64_t>(v.element_count()) != num_tokens * row)
    return ffi::Error::InvalidArgument("write_kv_native: k and v must be [T, K, Dh] of the pages' K and Dh");
  const int32_t* slots = slot_mapping.typed_data();
  for (auto [src, dst] : {std::pair{k.typed_data(), k_out->untyped_data()}, {v.typed_data(), v_out->untyped_data()}}) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0 || slot >= num_slots) continue;  // out of the cache: nothing to write
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
  return isa >= 0 && isa <= 2 && cpu_has(static_cast<Isa>(isa));
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
                                  .Ret<ffi::AnyBuffer>());  // v_pages, aliased

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
                                  .Attr<float>("soft_cap"));  // 0: none
