// The greedy token of each row of logits, as an XLA FFI call.
//
// logits: [..., vocab] float32; out[...] = the first position of the row's largest
// value, or of its first NaN (a NaN is the maximum, NumPy's rule): what `argmax`
// gives. XLA:CPU's reductions over a 151,936-wide row took 250 us a decode step on a
// 2-core Intel Xeon (a max, then the first position equal to it); these two passes
// over the row, which the LM head has just written and the caches still hold,
// take a few microseconds.

#include <cmath>
#include <cstdint>
#include <cstdlib>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Portable: one pass for the largest value (a NaN compares false, so the pass also
// notes whether there is one), one for its first position.
int64_t first_of_max_portable(const float* row, int64_t n) {
  float largest = -INFINITY;
  bool any_nan = false;
  for (int64_t i = 0; i < n; ++i) {
    largest = row[i] > largest ? row[i] : largest;
    any_nan |= std::isnan(row[i]);
  }
  for (int64_t i = 0; i < n; ++i)
    if (any_nan ? std::isnan(row[i]) : row[i] == largest) return i;
  return 0;  // not reached: the largest value (or a NaN) is in the row
}

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f")))

// Lanes [i, i + 16) of the row, those past its end -inf.
AVX512 inline __m512 lanes(const float* row, int64_t i, int64_t n) {
  if (i + 16 <= n) return _mm512_loadu_ps(row + i);
  const __mmask16 inside = static_cast<__mmask16>((1u << (n - i)) - 1);
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), inside, row + i);
}

// The same two passes, sixteen lanes at a time.
AVX512 int64_t first_of_max_avx512(const float* row, int64_t n) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = lanes(row, i, n);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(v, top);  // a NaN in v leaves top (the second operand)
  }
  const __m512 largest = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = lanes(row, i, n);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, largest, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // not reached
}

// EQX_MODELS_KERNELS_PORTABLE set: the portable loops (the tests run them on any CPU).
const bool kAvx512 = __builtin_cpu_supports("avx512f") && std::getenv("EQX_MODELS_KERNELS_PORTABLE") == nullptr;
#endif

int64_t first_of_max(const float* row, int64_t n) {
#if defined(__x86_64__)
  if (kAvx512) return first_of_max_avx512(row, n);
#endif
  return first_of_max_portable(row, n);
}

ffi::Error GreedyRows(ffi::Buffer<ffi::F32> logits, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  auto dims = logits.dimensions();
  if (dims.size() < 1 || dims.back() == 0)
    return ffi::Error::InvalidArgument("greedy_rows: want logits [..., vocab] with a vocabulary");
  const int64_t vocab = dims.back(), rows = static_cast<int64_t>(logits.element_count()) / vocab;
  if (static_cast<int64_t>(out->element_count()) != rows)
    return ffi::Error::InvalidArgument("greedy_rows: want one output per row of logits");
  if (vocab > INT32_MAX) return ffi::Error::InvalidArgument("greedy_rows: the vocabulary does not fit int32");
  const float* x = logits.typed_data();
  int32_t* y = out->typed_data();
  for (int64_t r = 0; r < rows; ++r) y[r] = static_cast<int32_t>(first_of_max(x + r * vocab, vocab));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxGreedyRows, GreedyRows,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());
