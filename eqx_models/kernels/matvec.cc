// Matrix-vector products for decode on the CPU, as an XLA FFI custom call.
//
// y[b, n] = sum_k x[b, k] * w[layer, n, k]   for b < rows (a handful), n < N.
//
// The weight operand is the whole stack `[layers, N, K]` plus the layer index, so
// inside `jax.lax.scan` the layer's slice is read where it lies: XLA:CPU copies a
// dynamically sliced operand before its own `dot`, which doubles the memory traffic
// of a decode step. Weights are float32 or bfloat16 (widened in registers, so the
// bytes read halve and the arithmetic stays float32); activations and results are
// float32. Chunks of rows of `w` are spread over XLA's intra-op thread pool.

#include <cstdint>
#include <type_traits>
#include <vector>

#include "bfloat16.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using eqx_models::to_float;

// Portable path: eight partial sums per output so the compiler can vectorise.
template <typename W>
void rows_portable(const float* x, const W* w, float* y, int64_t rows, int64_t n0, int64_t n1,
                   int64_t N, int64_t K) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    for (int64_t b = 0; b < rows; ++b) {
      const float* xb = x + b * K;
      float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) partial[j] += to_float(row[k + j]) * xb[k + j];
      float sum = 0;
      for (; k < K; ++k) sum += to_float(row[k]) * xb[k];
      for (int j = 0; j < 8; ++j) sum += partial[j];
      y[b * N + n] = sum;
    }
  }
}

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// float32 weights: R weight rows against B activation rows at once; R*B
// accumulators stay in registers, each weight vector is loaded once, used B times.
template <int B, int R>
AVX512 void tile_avx512(const float* x, const float* w, float* y, int64_t n, int64_t N, int64_t K,
                        int64_t ahead) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xFFFF)
                                 : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (n + ahead + r) * K + k), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + (n + r) * K + k);
    for (int b = 0; b < B; ++b) {
      __m512 xv = _mm512_maskz_loadu_ps(mask, x + b * K + k);
      for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) y[b * N + n + r] = _mm512_reduce_add_ps(acc[r][b]);
}

// bfloat16 weights, 32 per load: the even elements widen by a shift, the odd ones
// by masking off the low half, each against activations pre-split the same way
// (`split_pairs`). One load and two integer ops per 32 weights instead of a
// widening shuffle per 16.
template <int B, int R>
AVX512 void tile_bf16_pairs(const float* xs, const uint16_t* w, float* y, int64_t n, int64_t N,
                            int64_t K, int64_t ahead) {
  const int64_t main = K - K % 32;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < main; k += 32) {
    __m512 even[R], odd[R];
    // The same line of rows `ahead` further on: the hardware prefetchers lose track
    // of R interleaved streams through a page (measured: 17 -> 21 GB/s, two cores).
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (n + ahead + r) * K + k), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      __m512i pairs = _mm512_loadu_si512(w + (n + r) * K + k);
      even[r] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      odd[r] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
    }
    for (int b = 0; b < B; ++b) {
      __m512 x_even = _mm512_loadu_ps(xs + b * K + k);
      __m512 x_odd = _mm512_loadu_ps(xs + b * K + k + 16);
      for (int r = 0; r < R; ++r) {
        acc[r][b] = _mm512_fmadd_ps(even[r], x_even, acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(odd[r], x_odd, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float sum = _mm512_reduce_add_ps(acc[r][b]);
      for (int64_t k = main; k < K; ++k) sum += to_float(w[(n + r) * K + k]) * xs[b * K + k];
      y[b * N + n + r] = sum;
    }
}

// `ahead`: how many rows further on to prefetch; 0 means the next tile.
template <int B, int R, typename W>
AVX512 void rows_avx512_fixed(const float* x, const W* w, float* y, int64_t n0, int64_t n1,
                              int64_t N, int64_t K, int64_t ahead) {
  int64_t n = n0;
  if constexpr (std::is_same_v<W, uint16_t>) {
    for (; n + R <= n1; n += R) tile_bf16_pairs<B, R>(x, w, y, n, N, K, ahead ? ahead : R);
    for (; n < n1; ++n) tile_bf16_pairs<B, 1>(x, w, y, n, N, K, ahead ? ahead : 1);
  } else {
    for (; n + R <= n1; n += R) tile_avx512<B, R>(x, w, y, n, N, K, ahead ? ahead : R);
    for (; n < n1; ++n) tile_avx512<B, 1>(x, w, y, n, N, K, ahead ? ahead : 1);
  }
}

// Tile heights chosen so R*B accumulators + R weight vectors fit 32 registers.
template <typename W>
AVX512 void rows_avx512_group(const float* x, const W* w, float* y, int64_t rows, int64_t n0,
                              int64_t n1, int64_t N, int64_t K, int64_t ahead) {
  switch (rows) {
    case 1: rows_avx512_fixed<1, 8, W>(x, w, y, n0, n1, N, K, ahead); break;
    case 2: rows_avx512_fixed<2, 6, W>(x, w, y, n0, n1, N, K, ahead); break;
    case 3: rows_avx512_fixed<3, 5, W>(x, w, y, n0, n1, N, K, ahead); break;
    default: rows_avx512_fixed<4, 4, W>(x, w, y, n0, n1, N, K, ahead); break;
  }
}

// Activations in groups of at most four rows: four rows of a large K already fill
// most of L1, more would evict each other. With more than one group, rows are
// taken in blocks that stay in L2 between groups, and the next block is
// prefetched meanwhile, so memory still delivers each weight once and early.
template <typename W>
AVX512 void rows_avx512(const float* x, const W* w, float* y, int64_t rows, int64_t n0,
                        int64_t n1, int64_t N, int64_t K) {
  if (rows <= 4) return rows_avx512_group<W>(x, w, y, rows, n0, n1, N, K, 0);
  const int64_t block = 16;
  for (int64_t nb = n0; nb < n1; nb += block) {
    int64_t ne = nb + block < n1 ? nb + block : n1;
    for (int64_t b0 = 0; b0 < rows; b0 += 4)
      rows_avx512_group<W>(x + b0 * K, w, y + b0 * N, rows - b0 < 4 ? rows - b0 : 4, nb, ne, N, K, block);
  }
}

const bool kHasAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
#else
const bool kHasAvx512 = false;
#endif

template <typename W>
void rows_any(const float* x, const W* w, float* y, int64_t rows, int64_t n0, int64_t n1,
              int64_t N, int64_t K) {
#if defined(__x86_64__)
  if (kHasAvx512) return rows_avx512<W>(x, w, y, rows, n0, n1, N, K);
#endif
  rows_portable<W>(x, w, y, rows, n0, n1, N, K);
}

// Reorders each block of 32 activations as its 16 even then its 16 odd elements,
// the order `tile_bf16_pairs` consumes them in; a tail shorter than 32 stays as is.
std::vector<float> split_pairs(const float* x, int64_t rows, int64_t K) {
  std::vector<float> out(x, x + rows * K);
  const int64_t main = K - K % 32;
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t k = 0; k < main; k += 32)
      for (int64_t i = 0; i < 16; ++i) {
        out[b * K + k + i] = x[b * K + k + 2 * i];
        out[b * K + k + 16 + i] = x[b * K + k + 2 * i + 1];
      }
  return out;
}

// ~1 MiB of weights per chunk: long sequential runs per thread keep the hardware
// prefetchers going (measured on two cores: 64 KiB chunks 20-21 GB/s, 256 KiB
// 24 GB/s, 1 MiB 24-29 GB/s, torch's sgemv 24-25 GB/s in the same runs).
int64_t chunk_rows(int64_t K, int64_t bytes_per_weight) {
  int64_t rows = (1024 * 1024) / (K * bytes_per_weight);
  return rows < 8 ? 8 : rows;
}

ffi::Error StackedMatvec(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto w_dims = w.dimensions();
  auto x_dims = x.dimensions();
  if (w_dims.size() != 3 || x_dims.size() < 1)
    return ffi::Error::InvalidArgument("stacked_matvec: want x [..., K] and w [layers, N, K]");
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (!bf16 && w.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("stacked_matvec: weights must be float32 or bfloat16");
  const int64_t layers = w_dims[0], N = w_dims[1], K = w_dims[2];
  if (x_dims.back() != K)
    return ffi::Error::InvalidArgument("stacked_matvec: x and w disagree on the inner size");
  const int64_t rows = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument("stacked_matvec: layer index out of range");

  const int64_t bytes = bf16 ? 2 : 4;
  const float* xs = x.typed_data();
  std::vector<float> x_pairs;
  if (bf16 && kHasAvx512) {
    x_pairs = split_pairs(xs, rows, K);
    xs = x_pairs.data();
  }
  const char* weights = static_cast<const char*>(w.untyped_data()) + index * N * K * bytes;
  float* out = y->typed_data();
  const int64_t chunk = chunk_rows(K > 0 ? K : 1, bytes);
  eqx_models::parallel_for((N + chunk - 1) / chunk, [&](int64_t c) {
    const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    if (bf16)
      rows_any(xs, reinterpret_cast<const uint16_t*>(weights), out, rows, n0, n1, N, K);
    else
      rows_any(xs, reinterpret_cast<const float*>(weights), out, rows, n0, n1, N, K);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxStackedMatvec, StackedMatvec,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
