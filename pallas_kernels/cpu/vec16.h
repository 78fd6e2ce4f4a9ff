// The 16-float vector every native CPU kernel computes with (attention, the quantized matmuls), one
// per instruction-set variant. Included twice over:
//   - at namespace scope (ORCA_KERNEL_ISA not defined): the lane count and GCC's 16-lane vector
//     types, in namespace orca_vec16;
//   - at the top of each kernel file, inside the variant's namespace and `#pragma GCC target` region
//     (ORCA_KERNEL_ISA: 0 AVX-512, 1 AVX2, 2 baseline, as per_isa.h numbers them; the int8 kernel
//     maps its five variants onto these): that variant's vector `V` (and 16-int32 mask `VI`) and
//     the operations on it, compiled for that instruction set (GCC refuses to inline intrinsics
//     into a function compiled for less).
//
// AVX-512 and the baseline use GCC's 16-lane vector extension (one zmm register; four xmm ones on
// the baseline). AVX2 uses a pair of 8-lane vectors instead: GCC lowers 16-lane vectors for AVX2
// by splitting the arithmetic in halves but scalarising the rest (integer compares, selects,
// cross-lane shuffles, broadcasts) and spilling to the stack around every broadcast, which made
// each kernel's AVX2 variant several times slower. The pair does the same lane arithmetic in the
// same order (its cross-lane sums are the same trees), so AVX2 gives AVX-512's bits.
//
// Multiply-adds come in two kinds, and a kernel names the one its reference replays (each .cc file
// turns off the compiler's own contraction, so nothing else is fused):
//   fma(x, y, z)      x * y + z rounded once, in every variant (the baseline, which has no FMA
//                     instruction, goes lane by lane through libm's correctly rounded fmaf: slow,
//                     exact). The quantized matmuls use it: their numpy references
//                     (quantized_matmul.py's fma_f32, int8_activations.py) replay one rounding,
//                     bit for bit, in every variant.
//   mul_add(x, y, z)  x * y + z fused where the variant has the instruction (AVX-512, AVX2: the same
//                     bits as fma), multiplied then added on the baseline (two roundings, fast).
//                     The attention kernel uses it: its reference is matched to a tolerance, its
//                     AVX-512 and AVX2 variants agree bit for bit, and the baseline differs from
//                     them in the last bits (tests/pallas_kernels/test_native_isa.py).

#if !defined(ORCA_KERNEL_ISA)

#ifndef ORCA_VEC16_TYPES
#define ORCA_VEC16_TYPES
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace orca_vec16 {
constexpr int kLanes = 16;
using vf = float __attribute__((vector_size(4 * kLanes)));
using vi = int32_t __attribute__((vector_size(4 * kLanes)));
}  // namespace orca_vec16
#endif

#else

using ::orca_vec16::kLanes;
using ::orca_vec16::vf;
using ::orca_vec16::vi;

#define ORCA_INLINE __attribute__((always_inline)) inline  // (left defined for the kernel files)

#if ORCA_KERNEL_ISA == 1

using f8 = float __attribute__((vector_size(32)));
using i8 = int32_t __attribute__((vector_size(32)));

// Logical lanes 0-7 in `a`, 8-15 in `b`; H is f8 (V) or i8 (VI).
template <typename H>
struct Pair {
  H a, b;
};
using V = Pair<f8>;
using VI = Pair<i8>;

#define ORCA_PAIR_OP(OP)                                                                         \
  template <typename H>                                                                          \
  ORCA_INLINE Pair<H> operator OP(Pair<H> x, Pair<H> y) {                                        \
    return {x.a OP y.a, x.b OP y.b};                                                             \
  }                                                                                              \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>        \
  ORCA_INLINE Pair<H> operator OP(Pair<H> x, S s) {                                              \
    return {x.a OP s, x.b OP s};                                                                 \
  }                                                                                              \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>        \
  ORCA_INLINE Pair<H> operator OP(S s, Pair<H> x) {                                              \
    return {s OP x.a, s OP x.b};                                                                 \
  }
ORCA_PAIR_OP(+)
ORCA_PAIR_OP(-)
ORCA_PAIR_OP(*)
ORCA_PAIR_OP(/)
ORCA_PAIR_OP(&)
ORCA_PAIR_OP(<<)
#undef ORCA_PAIR_OP
#define ORCA_PAIR_CMP(OP)                                                                        \
  template <typename H>                                                                          \
  ORCA_INLINE VI operator OP(Pair<H> x, Pair<H> y) {                                             \
    return {x.a OP y.a, x.b OP y.b};                                                             \
  }                                                                                              \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>        \
  ORCA_INLINE VI operator OP(Pair<H> x, S s) {                                                   \
    return {x.a OP s, x.b OP s};                                                                 \
  }
ORCA_PAIR_CMP(<)
ORCA_PAIR_CMP(>)
ORCA_PAIR_CMP(>=)
#undef ORCA_PAIR_CMP
template <typename H>
ORCA_INLINE Pair<H> operator-(Pair<H> x) {
  return {-x.a, -x.b};
}

ORCA_INLINE V zero() { return {f8{}, f8{}}; }
ORCA_INLINE V splat(float f) { return {f8{} + f, f8{} + f}; }  // 0 + f, as the 16-lane variants
ORCA_INLINE V broadcast(float f) {
  const f8 h = _mm256_set1_ps(f);
  return {h, h};
}
ORCA_INLINE V fma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
ORCA_INLINE V mul_add(V x, V y, V z) { return fma(x, y, z); }
ORCA_INLINE VI iota() { return {i8{0, 1, 2, 3, 4, 5, 6, 7}, i8{8, 9, 10, 11, 12, 13, 14, 15}}; }
ORCA_INLINE V select(VI m, V x, V y) { return {m.a ? x.a : y.a, m.b ? x.b : y.b}; }
ORCA_INLINE VI to_int(V x) { return {__builtin_convertvector(x.a, i8), __builtin_convertvector(x.b, i8)}; }
ORCA_INLINE V as_float(VI x) { return {reinterpret_cast<f8>(x.a), reinterpret_cast<f8>(x.b)}; }
ORCA_INLINE float lane0(V x) { return x.a[0]; }
// (A memcpy of the whole pair went through the stack in 64-bit pieces: ~20 extra moves a block.)
ORCA_INLINE V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
// 16 bfloat16 values as floats: a bfloat16 is a float's upper 16 bits, so the widening is exact.
ORCA_INLINE V load(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
ORCA_INLINE void store(float* p, V v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}

// Lane k of the result = sum of the lanes of parts[k] (parts is scratch), in the 16-lane variants'
// tree: adjacent pairs, then quads, octets, and the two octets. Eight 8-lane vectors' octet sums
// take two rounds of horizontal adds (pairs, then quads) and one exchange of 128-bit halves.
ORCA_INLINE f8 octet_sums(const f8* v) {
  auto h = [](f8 x, f8 y) -> f8 { return _mm256_hadd_ps(x, y); };
  const f8 q0 = h(h(v[0], v[1]), h(v[2], v[3])), q1 = h(h(v[4], v[5]), h(v[6], v[7]));
  return f8(_mm256_permute2f128_ps(q0, q1, 0x20)) + f8(_mm256_permute2f128_ps(q0, q1, 0x31));
}
ORCA_INLINE V transpose_sum(V* parts) {
  f8 a[kLanes], b[kLanes];
  for (int k = 0; k < kLanes; ++k) a[k] = parts[k].a, b[k] = parts[k].b;
  return {octet_sums(a) + octet_sums(b), octet_sums(a + 8) + octet_sums(b + 8)};
}

// Every lane = max of v's lanes (max is exact: any order gives the same value).
ORCA_INLINE V all_lanes_max(V v) {
  f8 m = v.a > v.b ? v.a : v.b;
  for (const i8 swap : {i8{4, 5, 6, 7, 0, 1, 2, 3}, i8{2, 3, 0, 1, 6, 7, 4, 5}, i8{1, 0, 3, 2, 5, 4, 7, 6}}) {
    const f8 w = __builtin_shuffle(m, swap);
    m = m > w ? m : w;
  }
  return {m, m};
}

// Lane 0 + ... + lane 15 as the halving tree (lane i + lane i + 8, then + 4, + 2, + 1).
ORCA_INLINE float lanes_sum(V v) {
  const __m256 s8 = _mm256_add_ps(v.a, v.b);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#else  // AVX-512 and the baseline: GCC's 16-lane vectors

using V = vf;
using VI = vi;

ORCA_INLINE V zero() { return vf{}; }
ORCA_INLINE V splat(float f) { return vf{} + f; }
ORCA_INLINE VI iota() { return vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
ORCA_INLINE V select(VI m, V x, V y) { return m ? x : y; }
ORCA_INLINE VI to_int(V x) { return __builtin_convertvector(x, vi); }
ORCA_INLINE V as_float(VI x) { return reinterpret_cast<vf>(x); }
ORCA_INLINE float lane0(V x) { return x[0]; }

// The lane exchanges of the all-lanes reductions: lanes 8 apart, then 4, 2 and 1.
constexpr vi kExchanges[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                              {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                              {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                              {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};

#if ORCA_KERNEL_ISA == 0
ORCA_INLINE V broadcast(float f) { return _mm512_set1_ps(f); }
ORCA_INLINE V fma(V x, V y, V z) { return _mm512_fmadd_ps(x, y, z); }
ORCA_INLINE V mul_add(V x, V y, V z) { return fma(x, y, z); }
ORCA_INLINE V load(const float* p) { return _mm512_loadu_ps(p); }
// 16 bfloat16 values as floats (exact: a bfloat16 is a float's upper 16 bits).
ORCA_INLINE V load(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
ORCA_INLINE void store(float* p, V v) { _mm512_storeu_ps(p, v); }

// Lane 0 + ... + lane 15 as the halving tree (lane i + lane i + 8, then + 4, + 2, + 1).
ORCA_INLINE float lanes_sum(V v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#else
ORCA_INLINE V broadcast(float f) { return f - vf{}; }
ORCA_INLINE V fma(V x, V y, V z) {
  for (int i = 0; i < kLanes; ++i) z[i] = __builtin_fmaf(x[i], y[i], z[i]);
  return z;
}
ORCA_INLINE V mul_add(V x, V y, V z) { return x * y + z; }
ORCA_INLINE V load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// 16 bfloat16 values as floats (exact: a bfloat16 is a float's upper 16 bits).
ORCA_INLINE V load(const uint16_t* p) {
  vf v;
  for (int i = 0; i < kLanes; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&v[i], &bits, sizeof bits);
  }
  return v;
}
ORCA_INLINE void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }

// Lane 0 + ... + lane 15 as the halving tree: lane 0 after the four exchanges below is
// ((l0 + l8) + (l4 + l12)) + ..., AVX-512's and AVX2's sum.
ORCA_INLINE float lanes_sum(V v) {
  for (const vi& mask : kExchanges) v += __builtin_shuffle(v, mask);
  return v[0];
}
#endif

// Lane k of the result = sum of the lanes of parts[k] (parts is scratch): a transposing tree (15
// adds, 30 shuffles for 16 sums) instead of one horizontal reduction per vector.
ORCA_INLINE V transpose_sum(V* parts) {
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

// Every lane = max of v's lanes: four exchanges (max is exact: any order gives the same value).
ORCA_INLINE V all_lanes_max(V v) {
  for (const vi& mask : kExchanges) {
    const vf w = __builtin_shuffle(v, mask);
    v = v > w ? v : w;
  }
  return v;
}

#endif

#endif
