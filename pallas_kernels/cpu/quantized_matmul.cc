// Quantized matmul on the CPU, as an XLA typed-FFI custom call (pallas_kernels/quantized_matmul.py
// has the contract, the block layouts and the numpy reference this code must match bit for bit).
//
//   out[t, o] = sum_i x[t, i] * W[o, i]     x f32 [T, in], W quantized [out, ...], out f32 [T, out]
//
// Only the first num_rows rows of x are computed (a step's real tokens; the bucket's padding rows
// after them come out zero), so a step of 5 tokens in the 8-token bucket multiplies 5 rows.
//
// W's rows are read as stored: GGUF blocks of 32 weights (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: an f16
// scale, an f16 minimum for Q4_1 and Q5_1, Q5's 32 fifth bits, then 16 bytes of nibble pairs or 32
// int8), GGUF K-quant super-blocks of 256 weights (Q4_K, Q5_K, Q6_K: eight 32-weight sub-blocks with
// a scale each, and a minimum each or a second scale; quantized_matmul_kquants.inc), int8 rows with
// one f32 scale per row, or plain f32 rows (a float model's matrix, transposed). Each 32-weight block
// (a K-quant's sub-block) is dequantized
// into two 16-float vectors in registers (weights 0-15 and 16-31) and multiplied with the same 32
// inputs of up to kTokens tokens at once, so a weight read from memory serves several tokens; for
// more tokens a row is dequantized once into an f32 copy in L1 that every group of tokens reads.
//
// The arithmetic of one output element is fixed and independent of T, of the tiling and of the
// instruction set (batch invariance, and the reference can replay it):
//   w_lo, w_hi = dequantized block b (per weight: float(q) * d [+ m], as the reference rounds it)
//   acc = fma(x_lo, w_lo, acc);  acc = fma(x_hi, w_hi, acc)   (16 lanes, blocks in order, each
//                                                              multiply-add rounded once)
//   out = halving tree over acc's lanes (8 + 8, 4 + 4, 2 + 2, 1 + 1) [* row scale for int8]
// The fused multiply-adds are written out; the pragma keeps the compiler from fusing anything else
// (a dequantizing or summing multiply and add must round as the reference rounds them). The one
// other fused multiply-add written out is in dequantizing, where q * d is exact in f32 (an 11-bit
// f16 scale times an integer of at most 5 bits; a K-quant's sub-block scale d * sc, 17 bits, times
// a 5-bit q), so fusing changes no bit (the .inc file says more). Each
// variant's 16-float vector (vec16.h: one AVX-512 register, two AVX2 ones, GCC's generic vector on
// the baseline, whose fma is libm's) does the same lane arithmetic, so every variant gives the same bits.

#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel_for.h"
#include "quantized_matmul.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The instruction-set variant every native kernel runs (defined beside the attention kernel):
// 0 AVX-512 VNNI, 1 AVX-512, 2 AVX-VNNI, 3 AVX2, 4 baseline, as in pallas_kernels/native.py's ISAS.
// The float kernels' arithmetic gains nothing from VNNI: they run their AVX-512 or AVX2 code there.
extern "C" int OrcaNativeIsa();

namespace {

using namespace orca_qmm;

// 32-weight blocks a tile's loop takes at a time (their scales converted first: on AVX2, and for the
// K-quants everywhere); a multiple of 4 and of a K-quant super-block's 8.
constexpr int64_t kScaleChunk = 32;

// The kernel, once per instruction set (see quantized_matmul_kernel.inc).
#define ORCA_KERNEL_FILE "quantized_matmul_kernel.inc"
#include "per_isa.h"
#undef ORCA_KERNEL_FILE

using ItemFn = void (*)(const Problem&, int64_t, int64_t);

// The variant the native library runs (numbered as OrcaNativeIsa).
template <Format F>
ItemFn pick_isa() {
#if defined(__x86_64__)
  const int isa = OrcaNativeIsa();
  if (isa <= 1) return avx512::item<F>;
  if (isa <= 3) return avx2::item<F>;
#endif
  return base::item<F>;
}

// One matrix's problem `p` from its buffers, or the error naming what is inconsistent. Shapes are
// validated in Python (the wrapper names the argument); these checks keep a direct caller from
// reading out of bounds.
ffi::Error make_problem(ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer w, ffi::AnyBuffer scales,
                        ffi::Result<ffi::AnyBuffer> out, int32_t format, bool int8_activations, Problem& p) {
  if (format < 0 || format >= kNumFormats) return ffi::Error::InvalidArgument("quantized_matmul_native: unknown format");
  const Format f = static_cast<Format>(format);
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] % kBlock)
    return ffi::Error::InvalidArgument("quantized_matmul_native: x must be [T, in], in a multiple of 32; w [out, bytes]");
  p.tokens = x_dims[0];
  p.in = x_dims[1];
  p.out_features = w_dims[0];
  p.blocks = p.in / kBlock;
  const bool f32 = f == Format::kF32;
  p.row_bytes = w_dims[1] * (f32 ? 4 : 1);
  const bool int8 = f == Format::kInt8;
  if (p.blocks % sub_blocks(f) || p.row_bytes != p.blocks / sub_blocks(f) * block_bytes(f) ||
      (f32 ? w.element_type() != ffi::DataType::F32 : ffi::ByteWidth(w.element_type()) != 1) ||
      scales.element_type() != ffi::DataType::F32 || out->element_type() != ffi::DataType::F32 ||
      (int8 && static_cast<int64_t>(scales.element_count()) != p.out_features) ||
      out->dimensions().size() != 2 || out->dimensions()[0] != p.tokens || out->dimensions()[1] != p.out_features)
    return ffi::Error::InvalidArgument("quantized_matmul_native: inconsistent shapes");
  if (f32 && int8_activations)
    return ffi::Error::InvalidArgument("quantized_matmul_native: int8 activations need quantized weights, not f32 rows");
  p.x = x.typed_data();
  p.w = static_cast<const uint8_t*>(w.untyped_data());
  p.scales = static_cast<const float*>(scales.untyped_data());
  p.out = static_cast<float*>(out->untyped_data());
  return ffi::Error::Success();
}

// x times one or more matrices (a layer's q, k and v, or gate and up, share x): the arguments after
// x and num_rows are (w, scales) per matrix, the results out per matrix, `formats` one per matrix.
// One call for all of them quantizes x once (int8 activations) and shares every matrix's rows out
// over the threads at once, instead of paying a call, a quantization and a wake-up of the pool per
// matrix; each output element is computed exactly as a call of its matrix alone would.
ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> num_rows,
                           ffi::RemainingArgs weights, ffi::RemainingRets outs, ffi::Span<const int32_t> formats,
                           int32_t int8_activations) {
  const size_t count = formats.size();
  if (count == 0 || weights.size() != 2 * count || outs.size() != count)
    return ffi::Error::InvalidArgument("quantized_matmul_native: give (weights, scales) and a result per format");
  if (num_rows.element_count() != 1)
    return ffi::Error::InvalidArgument("quantized_matmul_native: num_rows must hold one int32");
  std::vector<Problem> problems;
  std::vector<Format> fs;
  for (size_t m = 0; m < count; ++m) {
    auto w = weights.get<ffi::AnyBuffer>(2 * m);
    auto scales = weights.get<ffi::AnyBuffer>(2 * m + 1);
    auto out = outs.get<ffi::AnyBuffer>(m);
    if (!w.has_value() || !scales.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("quantized_matmul_native: unreadable weights, scales or result");
    Problem p;
    if (ffi::Error error = make_problem(x, *w, *scales, *out, formats[m], int8_activations != 0, p); error.failure())
      return error;
    // Rows from num_rows on are a step's bucket padding: not computed, zeros (finite for what follows).
    const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, p.tokens);
    std::fill(p.out + rows * p.out_features, p.out + p.tokens * p.out_features, 0.0f);
    p.tokens = rows;
    problems.push_back(p);
    fs.push_back(static_cast<Format>(formats[m]));
  }
  if (problems[0].tokens == 0) return ffi::Error::Success();
  if (int8_activations) {
    int8_activations_matmul(pool, problems, fs, OrcaNativeIsa());
    return ffi::Error::Success();
  }
  std::vector<ItemFn> runs;
  for (Format f : fs) runs.push_back(with_format(f, []<Format F>() { return pick_isa<F>(); }));
  const std::vector<Item> items = work_items(problems);
  orca_native::parallel_for(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    runs[item.problem](problems[item.problem], item.first, item.end);
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* OrcaQuantizedMatmul(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(OrcaQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, in]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_rows []: rows of x to compute
                                  // per matrix: w [out, row bytes] u8 or s8, or f32 [out, in]; scales f32 [out] (int8) or [0]
                                  .RemainingArgs()
                                  .RemainingRets()  // per matrix: out f32 [T, out]
                                  .Attr<ffi::Span<const int32_t>>("formats")
                                  .Attr<int32_t>("int8_activations"));  // 1: x quantized (quantized_matmul_int8.cc)
