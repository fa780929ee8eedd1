// Matrix-vector products for decode on the CPU, as an XLA FFI custom call.
//
// y_j[b, n] = sum_k x[b, k] * w_j[layer, n, k]   for b < rows (a handful), n < N_j,
// for one or more weight stacks w_j that share the input.
//
// Each weight operand is a whole stack `[layers, N, K]` plus the layer index, so
// inside `jax.lax.scan` the layer's slice is read where it lies: XLA:CPU copies a
// dynamically sliced operand before its own `dot`, which doubles the memory traffic
// of a decode step. Weights are float32 or bfloat16 (widened in registers, so the
// bytes read halve and the arithmetic stays float32); activations float32 or
// bfloat16, results float32. bfloat16 rows against bfloat16 weights on a CPU with
// AMX go to its tiles (amx.h), a prompt's rows too. Chunks of weight rows are
// spread over the helper threads of parallel_for.h.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx.h"
#include "bfloat16.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using eqx_models::to_float;
namespace amx = eqx_models::amx;

// How the activations reach the tiles: float32 as they are, float32 split into
// even/odd halves per 32 (the widening bfloat16 tile), or bfloat16 (the dot tile).
enum class Kind { kFloat32, kBf16Widen, kBf16Dot };

// Portable path: eight partial sums per output so the compiler can vectorise.
template <typename W>
void rows_portable(const float* x, int64_t ldx, const W* w, float* y, int64_t rows, int64_t n0,
                   int64_t n1, int64_t N, int64_t K) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    for (int64_t b = 0; b < rows; ++b) {
      const float* xb = x + b * ldx;
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
// Full vectors in the main loop, one masked step for a tail (a mask built and
// applied every step ran a batch-1 product at 33 GB/s instead of 43 on an AMD
// EPYC, two cores).
template <int B, int R>
AVX512 void tile_avx512(const float* x, int64_t ldx, const float* w, float* y, int64_t n, int64_t N,
                        int64_t K, int64_t ahead) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const int64_t main = K - K % 16;
  for (int64_t k = 0; k < main; k += 16) {
    // With one activation row the loop only streams weights and the hardware
    // prefetchers keep up (software prefetch: 38 vs 43 GB/s on the EPYC); with
    // several, the FMAs slow the stream enough that they lose it (8 rows: 21 vs
    // 32 GB/s with the prefetch).
    if constexpr (B > 1)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (n + ahead + r) * K + k), _MM_HINT_T0);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + (n + r) * K + k);
    for (int b = 0; b < B; ++b) {
      __m512 xv = _mm512_load_ps(x + b * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  }
  if (main < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - main)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + (n + r) * K + main);
    for (int b = 0; b < B; ++b) {
      __m512 xv = _mm512_maskz_load_ps(mask, x + b * ldx + main);
      for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) y[b * N + n + r] = _mm512_reduce_add_ps(acc[r][b]);
}

// bfloat16 weights, 32 per load: the even elements widen by a shift, the odd ones
// by masking off the low half, each against activations pre-split the same way
// (`Activations`). One load and two integer ops per 32 weights instead of a
// widening shuffle per 16.
template <int B, int R>
AVX512 void tile_bf16_pairs(const float* xs, int64_t ldx, const uint16_t* w, float* y, int64_t n,
                            int64_t N, int64_t K, int64_t ahead) {
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
      __m512 x_even = _mm512_load_ps(xs + b * ldx + k);
      __m512 x_odd = _mm512_load_ps(xs + b * ldx + k + 16);
      for (int r = 0; r < R; ++r) {
        acc[r][b] = _mm512_fmadd_ps(even[r], x_even, acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(odd[r], x_odd, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float sum = _mm512_reduce_add_ps(acc[r][b]);
      for (int64_t k = main; k < K; ++k) sum += to_float(w[(n + r) * K + k]) * xs[b * ldx + k];
      y[b * N + n + r] = sum;
    }
}

#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// bfloat16 weights against activations that are bfloat16 values themselves (those
// of a bfloat16 model are): `vdpbf16ps` multiplies 16 pairs and adds them into 16
// float32 sums in one instruction, where widening takes two integer ops and two
// FMAs per 32 weights and made the loop compute-bound (1 GB of weights, two cores
// of an AMD EPYC: 71 vs 42-59 GB/s). Products of bfloat16 values are exact in
// float32 and the sums are float32 as on the widening path; the instruction
// treats subnormal inputs and results as zero.
template <int B, int R>
AVX512_BF16 void tile_bf16_dot(const uint16_t* xs, int64_t ldx, const uint16_t* w, float* y, int64_t n,
                               int64_t N, int64_t K, int64_t ahead) {
  const int64_t main = K - K % 32;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < main; k += 32) {
    if constexpr (B > 1)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (n + ahead + r) * K + k), _MM_HINT_T0);
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w + (n + r) * K + k);
    for (int b = 0; b < B; ++b) {
      const __m512bh xv = (__m512bh)_mm512_load_si512(xs + b * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float sum = _mm512_reduce_add_ps(acc[r][b]);
      for (int64_t k = main; k < K; ++k) sum += to_float(w[(n + r) * K + k]) * to_float(xs[b * ldx + k]);
      y[b * N + n + r] = sum;
    }
}

// `ahead`: how many rows further on to prefetch; 0 means the next tile.
template <int B, int R, Kind kind>
AVX512 void rows_avx512_fixed(const void* x, int64_t ldx, const void* weights, float* y, int64_t n0,
                              int64_t n1, int64_t N, int64_t K, int64_t ahead) {
  int64_t n = n0;
  if constexpr (kind == Kind::kFloat32) {
    const float* xs = static_cast<const float*>(x);
    const float* w = static_cast<const float*>(weights);
    for (; n + R <= n1; n += R) tile_avx512<B, R>(xs, ldx, w, y, n, N, K, ahead ? ahead : R);
    for (; n < n1; ++n) tile_avx512<B, 1>(xs, ldx, w, y, n, N, K, ahead ? ahead : 1);
  } else if constexpr (kind == Kind::kBf16Widen) {
    const float* xs = static_cast<const float*>(x);
    const uint16_t* w = static_cast<const uint16_t*>(weights);
    for (; n + R <= n1; n += R) tile_bf16_pairs<B, R>(xs, ldx, w, y, n, N, K, ahead ? ahead : R);
    for (; n < n1; ++n) tile_bf16_pairs<B, 1>(xs, ldx, w, y, n, N, K, ahead ? ahead : 1);
  } else {
    const uint16_t* xs = static_cast<const uint16_t*>(x);
    const uint16_t* w = static_cast<const uint16_t*>(weights);
    for (; n + R <= n1; n += R) tile_bf16_dot<B, R>(xs, ldx, w, y, n, N, K, ahead ? ahead : R);
    for (; n < n1; ++n) tile_bf16_dot<B, 1>(xs, ldx, w, y, n, N, K, ahead ? ahead : 1);
  }
}

// Tile heights chosen so R*B accumulators + R weight vectors fit 32 registers
// (at 8x3 the compiler spills and loses a third).
template <Kind kind>
AVX512 void rows_avx512_group(const void* x, int64_t ldx, const void* w, float* y, int64_t rows,
                              int64_t n0, int64_t n1, int64_t N, int64_t K, int64_t ahead) {
  switch (rows) {
    case 1: rows_avx512_fixed<1, 8, kind>(x, ldx, w, y, n0, n1, N, K, ahead); break;
    case 2: rows_avx512_fixed<2, 6, kind>(x, ldx, w, y, n0, n1, N, K, ahead); break;
    case 3: rows_avx512_fixed<3, 5, kind>(x, ldx, w, y, n0, n1, N, K, ahead); break;
    case 4: rows_avx512_fixed<4, 4, kind>(x, ldx, w, y, n0, n1, N, K, ahead); break;
    case 5: rows_avx512_fixed<5, 2, kind>(x, ldx, w, y, n0, n1, N, K, ahead); break;
    case 6: rows_avx512_fixed<6, 2, kind>(x, ldx, w, y, n0, n1, N, K, ahead); break;
    case 7: rows_avx512_fixed<7, 2, kind>(x, ldx, w, y, n0, n1, N, K, ahead); break;
    default: rows_avx512_fixed<8, 2, kind>(x, ldx, w, y, n0, n1, N, K, ahead); break;
  }
}

// Up to eight activation rows in one pass over the weights (aligned, they stay in
// L1/L2 next to the streamed weights: measured 8 rows at 17-19 GB/s vs 12-14 in
// two passes of four). More rows go in groups of eight over blocks of weight rows
// small enough to stay in L2 between groups, the next block prefetched meanwhile.
constexpr int64_t kMaxGroup = 8;

template <Kind kind>
AVX512 void rows_avx512(const void* x, int64_t ldx, const void* w, float* y, int64_t rows, int64_t n0,
                        int64_t n1, int64_t N, int64_t K) {
  if (rows <= kMaxGroup) return rows_avx512_group<kind>(x, ldx, w, y, rows, n0, n1, N, K, 0);
  const int64_t block = 16, x_bytes = kind == Kind::kBf16Dot ? 2 : 4;
  for (int64_t nb = n0; nb < n1; nb += block) {
    int64_t ne = nb + block < n1 ? nb + block : n1;
    for (int64_t b0 = 0; b0 < rows; b0 += kMaxGroup)
      rows_avx512_group<kind>(static_cast<const char*>(x) + b0 * ldx * x_bytes, ldx, w, y + b0 * N,
                              rows - b0 < kMaxGroup ? rows - b0 : kMaxGroup, nb, ne, N, K, block);
  }
}

// EQX_MODELS_KERNELS_PORTABLE set: the portable loops on any CPU (the tests run them
// on machines that have AVX-512 too).
const bool kHasAvx512 = std::getenv("EQX_MODELS_KERNELS_PORTABLE") == nullptr && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
const bool kHasBf16Dot = kHasAvx512 && __builtin_cpu_supports("avx512bf16");
#else
const bool kHasAvx512 = false;
const bool kHasBf16Dot = false;
#endif

// Whether every value is a bfloat16 too (its low 16 bits are zero), so that the
// dot tile computes with the activations exactly.
bool all_bfloat16(const float* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    if (bits & 0xFFFFu) return false;
  }
  return true;
}

// The activations as the tiles read them: rows 64-byte aligned (an unaligned
// 64-byte load spans two cache lines; measured at half the speed for 8 rows)
// with a stride that is not a multiple of 4 KiB (rows would share L1 sets); for
// the widening bfloat16 tile each block of 32 reordered as its 16 even then its
// 16 odd elements, the order `tile_bf16_pairs` consumes them in (a tail stays as
// is); for the dot tile, the top halves (the bfloat16 values) in order.
class Activations {
 public:
  Activations(const float* x, int64_t rows, int64_t K, Kind kind)
      : stride_(row_stride(K, kind == Kind::kBf16Dot ? 2 : 4)),
        data_(std::aligned_alloc(64, (rows * stride_ * 4 + 63) / 64 * 64 + 64)) {
    // Only the AVX-512 widening tile reads the split order; the portable loop
    // takes bfloat16 weights against activations in order.
    const int64_t main = kind == Kind::kBf16Widen && kHasAvx512 ? K - K % 32 : 0;
    for (int64_t b = 0; b < rows; ++b) {
      const float* from = x + b * K;
      if (kind == Kind::kBf16Dot) {
        uint16_t* to = static_cast<uint16_t*>(data_) + b * stride_;
        for (int64_t k = 0; k < K; ++k) {
          uint32_t bits;
          std::memcpy(&bits, from + k, sizeof(bits));
          to[k] = static_cast<uint16_t>(bits >> 16);
        }
        continue;
      }
      float* to = static_cast<float*>(data_) + b * stride_;
      for (int64_t k = 0; k < main; k += 32)
        for (int64_t i = 0; i < 16; ++i) {
          to[k + i] = from[k + 2 * i];
          to[k + 16 + i] = from[k + 2 * i + 1];
        }
      std::copy(from + main, from + K, to + main);
    }
  }
  ~Activations() { std::free(data_); }
  Activations(const Activations&) = delete;
  Activations& operator=(const Activations&) = delete;
  const void* data() const { return data_; }
  int64_t stride() const { return stride_; }  // in elements of the stored type

 private:
  // Whole cache lines per row, and not a multiple of 4 KiB.
  static int64_t row_stride(int64_t K, int64_t bytes) {
    const int64_t per_line = 64 / bytes, stride = (K + per_line - 1) / per_line * per_line;
    return stride * bytes % 4096 == 0 ? stride + per_line : stride;
  }

  int64_t stride_;
  void* data_;
};

// One chunk of output rows [n0, n1) of y = x @ w.T, on the best path this CPU has.
void rows_any(Kind kind, const Activations& xs, const char* w, float* y, int64_t rows, int64_t n0,
              int64_t n1, int64_t N, int64_t K) {
#if defined(__x86_64__)
  if (kHasAvx512) {
    switch (kind) {
      case Kind::kFloat32: return rows_avx512<Kind::kFloat32>(xs.data(), xs.stride(), w, y, rows, n0, n1, N, K);
      case Kind::kBf16Widen: return rows_avx512<Kind::kBf16Widen>(xs.data(), xs.stride(), w, y, rows, n0, n1, N, K);
      case Kind::kBf16Dot: return rows_avx512<Kind::kBf16Dot>(xs.data(), xs.stride(), w, y, rows, n0, n1, N, K);
    }
  }
#endif
  const float* x = static_cast<const float*>(xs.data());
  if (kind == Kind::kFloat32)
    rows_portable(x, xs.stride(), reinterpret_cast<const float*>(w), y, rows, n0, n1, N, K);
  else
    rows_portable(x, xs.stride(), reinterpret_cast<const uint16_t*>(w), y, rows, n0, n1, N, K);
}

// ~1 MiB of weights per chunk: long sequential runs per thread keep the hardware
// prefetchers going (measured on two cores: 64 KiB chunks 20-21 GB/s, 256 KiB
// 24 GB/s, 1 MiB 24-29 GB/s, torch's sgemv 24-25 GB/s in the same runs).
int64_t chunk_rows(int64_t K, int64_t bytes_per_weight) {
  int64_t rows = (1024 * 1024) / (K * bytes_per_weight);
  return rows < 8 ? 8 : rows;
}

// Rows of bfloat16 activations from which AMX tiles take the product (where the
// CPU has them). One layer-loop of 28 [3072, 1024] weights, two cores of a Xeon:
// 8 rows 9.3 ms on the tiles against 11.0 with `tile_bf16_dot`, 5 rows 10.8
// against 13.8, 4 rows level (9.1 / 9.3), 16 rows 9.7 against 22.2.
constexpr int64_t kAmxMinRows = 5;

// A multiple of 32 weight rows, about 512 KiB: the chunk every block of 32
// activation rows sweeps in turn stays in L2.
int64_t amx_chunk_rows(int64_t K) {
  const int64_t rows = (512 * 1024) / (K * 2) / 32 * 32;
  return rows < 32 ? 32 : rows;
}

// One weight stack of a call and where its chunks start in the shared task list.
struct Projection {
  const char* weights;  // this layer's [N, K] slice
  float* out;
  int64_t N, first_chunk = 0, chunk = 0;
};

// y_j = x @ w_j[layer].T for every stack w_j: projections of the same input (q/k/v,
// gate/up) go as one job, so the helpers stream the weights back to back with one
// hand-off, and only the job's last chunk leaves a core idle.
ffi::Error StackedMatvec(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer,
                         ffi::RemainingArgs stacks, ffi::RemainingRets outs) {
  auto x_dims = x.dimensions();
  if (x_dims.size() < 1 || stacks.size() == 0 || stacks.size() != outs.size())
    return ffi::Error::InvalidArgument("stacked_matvec: want x [..., K], the layer, and one output per stack");
  const bool x_bf16 = x.element_type() == ffi::DataType::BF16;
  if (!x_bf16 && x.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("stacked_matvec: x must be float32 or bfloat16");
  const int64_t K = x_dims.back();
  const int64_t rows = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  const int64_t index = layer.typed_data()[0];
  std::vector<Projection> projections;
  bool bf16 = false, tiles_fit = K % amx::kBlock == 0;
  for (size_t j = 0; j < stacks.size(); ++j) {
    auto w = stacks.get<ffi::AnyBuffer>(j);
    auto y = outs.get<ffi::Buffer<ffi::F32>>(j);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("stacked_matvec: stacks and outputs must be arrays, outputs float32");
    auto w_dims = w->dimensions();
    if (w_dims.size() != 3 || w_dims[2] != K)
      return ffi::Error::InvalidArgument("stacked_matvec: every stack must be [layers, N, K] with x's K");
    const bool this_bf16 = w->element_type() == ffi::DataType::BF16;
    if (!this_bf16 && w->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("stacked_matvec: weights must be float32 or bfloat16");
    if (j > 0 && this_bf16 != bf16)
      return ffi::Error::InvalidArgument("stacked_matvec: the stacks of one call must share a dtype");
    bf16 = this_bf16;
    if (index < 0 || index >= w_dims[0])
      return ffi::Error::InvalidArgument("stacked_matvec: layer index out of range");
    const int64_t N = w_dims[1], bytes = bf16 ? 2 : 4;
    tiles_fit = tiles_fit && N % amx::kRows == 0;
    projections.push_back({static_cast<const char*>(w->untyped_data()) + index * N * K * bytes,
                           (*y)->typed_data(), N});
  }

  if (rows == 0) return ffi::Error::Success();  // nothing to write (the loops below take 0 rows for 8)

  // Chunks of each projection's rows, numbered across the projections.
  auto split = [&](auto rows_per_chunk) {
    int64_t chunks = 0;
    for (Projection& p : projections) {
      p.first_chunk = chunks;
      p.chunk = rows_per_chunk;
      chunks += (p.N + p.chunk - 1) / p.chunk;
    }
    return chunks;
  };
  auto projection_of = [&](int64_t c) -> const Projection& {
    size_t j = projections.size() - 1;
    while (projections[j].first_chunk > c) --j;
    return projections[j];
  };

  // bfloat16 activations come as they are: given them widened to float32, XLA
  // may drop a rounding to bfloat16 and its widening as a pair, and the values
  // that arrive are no longer bfloat16.
  if (bf16 && x_bf16 && tiles_fit && rows >= kAmxMinRows && amx::available()) {
    const amx::PackedRows packed(static_cast<const uint16_t*>(x.untyped_data()), rows, K);
    if (!packed.allocated()) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "stacked_matvec: out of memory");
    const int64_t chunks = split(amx_chunk_rows(K));
    eqx_models::parallel_for(chunks, [&](int64_t c) {
      const Projection& p = projection_of(c);
      const int64_t n0 = (c - p.first_chunk) * p.chunk, n1 = n0 + p.chunk < p.N ? n0 + p.chunk : p.N;
      amx::product(packed, reinterpret_cast<const uint16_t*>(p.weights), p.out, n0, n1, p.N, K);
    });
    return ffi::Error::Success();
  }

  std::vector<float> widened;
  if (x_bf16) {
    const uint16_t* bits = static_cast<const uint16_t*>(x.untyped_data());
    widened.resize(rows * K);
    for (int64_t i = 0; i < rows * K; ++i) widened[i] = to_float(bits[i]);
  }
  const float* x_values = x_bf16 ? widened.data() : static_cast<const float*>(x.untyped_data());
  const Kind kind = !bf16                                                                ? Kind::kFloat32
                    : kHasBf16Dot && (x_bf16 || all_bfloat16(x_values, rows * K)) ? Kind::kBf16Dot
                                                                                         : Kind::kBf16Widen;
  const Activations xs(x_values, rows, K, kind);
  const int64_t chunks = split(chunk_rows(K > 0 ? K : 1, bf16 ? 2 : 4));
  eqx_models::parallel_for(chunks, [&](int64_t c) {
    const Projection& p = projection_of(c);
    const int64_t n0 = (c - p.first_chunk) * p.chunk, n1 = n0 + p.chunk < p.N ? n0 + p.chunk : p.N;
    rows_any(kind, xs, p.weights, p.out, rows, n0, n1, p.N, K);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxStackedMatvec, StackedMatvec,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

// Whether this CPU has AMX bfloat16 tiles and this process may use them (asking
// Linux for them, once, where the CPU has them).
extern "C" int EqxBf16Tiles() { return eqx_models::amx::available() ? 1 : 0; }
