// Products with group-quantized weights for decode (and, with AVX-512 VNNI, for
// prompts), as an XLA FFI call.
//
// y_j[b, n] = sum_g scale_j[layer, n, g] * sum_{k in group g} q_j(layer, n, k) x[b, k]
//
// for activation rows b and one or more weight stacks j that share x. Each
// stack is the whole `[layers, N, K * bits / 8]` array of integers plus its scales
// `[layers, N, K / group]` (float16 or bfloat16) and the layer index: the layer's
// integers are read where they lie and widened in registers, so a step reads the
// quantized bytes once and writes no float copy of any weight.
//   int8: q = the signed byte.
//   int4: q = nibble - 8; byte i of a group holds element i (low nibble) and
//         element i + group / 2 (high nibble), llama.cpp's Q4_0 order.
//   affine int4 (attribute `affine`): each stack has a third array, one bias per
//         group (same shape and dtype as the scales), and w = nibble * scale + bias:
//         the bias multiplies the group's sum of activations, added at the end.
// Two ways with the activations (attribute `int8_activations`):
//   0: float32 activations, float32 sums: the float32 product with the dequantized
//      weight, up to the order of additions.
//   1: activations quantized too, per block of 32 inputs of a row (llama.cpp's Q8_0:
//      xq = round(x * 127 / max|x|), dx = max|x| / 127), and the products summed in
//      integers (AVX-512 VNNI `vpdpbusd`, 32 products in one instruction; on AVX2
//      `vpmaddubsw` + `vpmaddwd`), each
//      block's integer sum scaled by dw * dx in float32. This is the product of the
//      dequantized weight with the dequantized activations; it reads the same bytes
//      with about a third of the instructions.
// Attribute `tiled` (int8 with int8 activations, AVX-512 VNNI): each stack's
// integers are `[layers, N / 16, K / 32, 512]`, already in the order the tiles
// multiply them (see tiles_vnni), bytes q + 128, and its scales `[layers, N / 16,
// K / group, 16]`, each tile's 16 rows side by side per group.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "bfloat16.h"
#include "parallel_for.h"
#include "prefetch.h"
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using eqx_models::prefetch_lines;
using eqx_models::to_float;

// IEEE half to float, exact (normals, subnormals, infinities, NaN).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One stack of a call, this layer's part of it.
struct Weights {
  const uint8_t* packed;    // [N, K * bits / 8]
  const uint16_t* scales;   // [N, K / group]
  const uint16_t* biases;   // [N, K / group] (affine int4), else null
  bool half;                // float16 scales and biases (else bfloat16)
  bool tiled;               // `packed` holds [N / 16, K / 32, 512] packed tiles
  float* out;               // [rows, N]
  int64_t N, first_chunk, chunk;

  float scale(int64_t n, int64_t g, int64_t groups) const { return widened(scales[n * groups + g]); }
  float bias(int64_t n, int64_t g, int64_t groups) const { return widened(biases[n * groups + g]); }
  float widened(uint16_t value) const { return half ? half_to_float(value) : to_float(value); }
};

// Per activation row, the sum of each group's inputs (what an affine weight's
// biases multiply), or empty for symmetric weights.
std::vector<float> group_sums(const float* x, int64_t rows, int64_t K, int64_t group, bool affine) {
  if (!affine) return {};
  std::vector<float> sums(rows * (K / group), 0.0f);
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t k = 0; k < K; ++k) sums[b * (K / group) + k / group] += x[b * K + k];
  return sums;
}

void rows_portable(const Weights& w, const float* x, const float* x_sums, int64_t rows, int64_t n0, int64_t n1,
                   int64_t K, int bits, int64_t group) {
  const int64_t groups = K / group, row_bytes = K * bits / 8, half = group / 2;
  const int zero = w.biases ? 0 : 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.packed + n * row_bytes;
    for (int64_t b = 0; b < rows; ++b) {
      const float* xb = x + b * K;
      float total = 0;
      for (int64_t g = 0; g < groups; ++g) {
        float sum = 0;
        if (bits == 8) {
          const int8_t* q = reinterpret_cast<const int8_t*>(row) + g * group;
          for (int64_t i = 0; i < group; ++i) sum += static_cast<float>(q[i]) * xb[g * group + i];
        } else {
          const uint8_t* q = row + g * half;
          for (int64_t i = 0; i < half; ++i) {
            sum += static_cast<float>((q[i] & 0xF) - zero) * xb[g * group + i];
            sum += static_cast<float>((q[i] >> 4) - zero) * xb[g * group + half + i];
          }
        }
        total += w.scale(n, g, groups) * sum;
        if (w.biases) total += w.bias(n, g, groups) * x_sums[b * groups + g];
      }
      w.out[b * w.N + n] = total;
    }
  }
}

constexpr int64_t kBlock = 32;  // inputs per activation scale

// The activations of one call quantized per block of 32: integers, one scale per
// block, and per weight group the term that undoes the weights' offset (the kernels
// read int8 weights as unsigned q + 128 and int4 ones as their nibble, q + 8):
// offset_sum[b, g] = offset * sum over g's blocks of dx * sum(xq). Affine int4
// weights are their nibbles with offset 1: offset_sum is then the group's sum of
// the (rounded) inputs, which the biases multiply.
struct QuantizedActivations {
  std::vector<int8_t> q;          // [rows, K]
  std::vector<float> scale;       // [rows, K / 32]
  std::vector<float> offset_sum;  // [rows, K / group]
  // Per block, minus the offset times the block's integer sum: where the tiles
  // (tiles_vnni) start each block's integer sum, so it comes out free of the offset.
  std::vector<int32_t> start;     // [rows, K / 32]
  // int4 in groups of 32: each run of four blocks again, as the four blocks' first
  // halves then their second halves: the order in which one 64-byte load of four
  // groups unpacks (see row_vnni). Whole runs of four only; the rest is in `q`.
  std::vector<int8_t> quads;      // [rows, K] or empty
  int64_t rows, K;

  QuantizedActivations(const float* x, int64_t rows, int64_t K, int64_t group, int offset)
      : q(rows * K), scale(rows * (K / kBlock)), offset_sum(rows * (K / group), 0.0f), start(rows * (K / kBlock)),
        rows(rows), K(K) {
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t j = 0; j < K / kBlock; ++j) {
        const float* xs = x + b * K + j * kBlock;
        int8_t* out = q.data() + b * K + j * kBlock;
        const float amax = block_max(xs);
        const float inverse = amax > 0 ? 127.0f / amax : 0.0f;
        const int32_t sum = round_block(xs, inverse, out);
        const float dx = amax / 127.0f;
        scale[b * (K / kBlock) + j] = dx;
        start[b * (K / kBlock) + j] = offset == 1 ? 0 : -offset * sum;  // affine nibbles carry no offset
        offset_sum[b * (K / group) + j * kBlock / group] += static_cast<float>(offset) * dx * static_cast<float>(sum);
      }
    if (offset != 128 && group == kBlock && K >= 4 * kBlock) {
      quads.resize(rows * K);
      for (int64_t b = 0; b < rows; ++b)
        for (int64_t j = 0; j + 4 * kBlock <= K; j += 4 * kBlock) {
          const int8_t* from = q.data() + b * K + j;
          int8_t* to = quads.data() + b * K + j;
          for (int k = 0; k < 4; ++k)
            for (int i = 0; i < 16; ++i) {
              to[16 * k + i] = from[32 * k + i];            // block k, inputs 0..15
              to[64 + 16 * k + i] = from[32 * k + 16 + i];  // block k, inputs 16..31
            }
        }
    }
  }

  // These run once per call for every input: scalar they cost ~10% of an int8
  // decode step (a layer's four calls round ~7K inputs), so 16 lanes at a time
  // where the CPU has them, with the same rounding (to nearest, ties to even).
  static float block_max(const float* xs);
  static int32_t round_block(const float* xs, float inverse, int8_t* out);
};

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw"))) float block_max_avx512(const float* xs) {
  const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xs)), b = _mm512_abs_ps(_mm512_loadu_ps(xs + 16));
  return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}

__attribute__((target("avx512f,avx512bw"))) int32_t round_block_avx512(const float* xs, float inverse, int8_t* out) {
  const __m512 scale = _mm512_set1_ps(inverse);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i a = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xs), scale), kNearest));
  const __m512i b = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xs + 16), scale), kNearest));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(b));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}

// EQX_MODELS_KERNELS_AVX2 set: the AVX2 paths even where AVX-512 is there (the tests
// run them on any x86-64 CPU); EQX_MODELS_KERNELS_PORTABLE: the portable loops.
const bool kAvx512Allowed =
    std::getenv("EQX_MODELS_KERNELS_PORTABLE") == nullptr && std::getenv("EQX_MODELS_KERNELS_AVX2") == nullptr;
const bool kRoundAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && kAvx512Allowed;
#endif

float QuantizedActivations::block_max(const float* xs) {
#if defined(__x86_64__)
  if (kRoundAvx512) return block_max_avx512(xs);
#endif
  float amax = 0;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xs[i]));
  return amax;
}

int32_t QuantizedActivations::round_block(const float* xs, float inverse, int8_t* out) {
#if defined(__x86_64__)
  if (kRoundAvx512) return round_block_avx512(xs, inverse, out);
#endif
  int32_t sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    out[i] = static_cast<int8_t>(std::nearbyint(xs[i] * inverse));
    sum += out[i];
  }
  return sum;
}

// Integer sums, portable: y[b, n] = sum_g dw_g (sum_j in g dx_j sum_i wq_i xq_i).
void rows_portable_int(const Weights& w, const QuantizedActivations& a, int64_t n0, int64_t n1, int bits,
                       int64_t group) {
  const int64_t K = a.K, groups = K / group, blocks = K / kBlock, row_bytes = K * bits / 8, half = group / 2;
  const int zero = w.biases ? 0 : 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.packed + n * row_bytes;
    for (int64_t b = 0; b < a.rows; ++b) {
      const int8_t* xq = a.q.data() + b * K;
      float total = 0;
      for (int64_t g = 0; g < groups; ++g) {
        float in_group = 0;
        for (int64_t j = g * group / kBlock; j < (g + 1) * group / kBlock; ++j) {
          int32_t sum = 0;
          for (int64_t k = j * kBlock; k < (j + 1) * kBlock; ++k) {
            int32_t wq;
            if (bits == 8) {
              wq = reinterpret_cast<const int8_t*>(row)[k];
            } else {
              const int64_t i = k - g * group;
              const uint8_t byte = row[g * half + (i < half ? i : i - half)];
              wq = (i < half ? byte & 0xF : byte >> 4) - zero;
            }
            sum += wq * xq[k];
          }
          in_group += a.scale[b * blocks + j] * static_cast<float>(sum);
        }
        total += w.scale(n, g, groups) * in_group;
        if (w.biases) total += w.bias(n, g, groups) * a.offset_sum[b * groups + g];
      }
      w.out[b * w.N + n] = total;
    }
  }
}

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

AVX512 inline float scale_of(const Weights& w, int64_t n, int64_t g, int64_t groups) {
  const uint16_t s = w.scales[n * groups + g];
  return w.half ? _cvtsh_ss(s) : to_float(s);
}

// R weight rows against B activation rows: per group, R*B partial sums in
// registers, scaled into R*B totals at the group's end.
template <int B, int R>
AVX512 void tile_int8(const Weights& w, const float* x, int64_t n, int64_t K, int64_t group) {
  const int64_t groups = K / group;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) part[r][b] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
      __m512 wv[R];
      for (int r = 0; r < R; ++r) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.packed + (n + r) * K + k));
        wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      }
      for (int b = 0; b < B; ++b) {
        const __m512 xv = _mm512_loadu_ps(x + b * K + k);
        for (int r = 0; r < R; ++r) part[r][b] = _mm512_fmadd_ps(wv[r], xv, part[r][b]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(scale_of(w, n + r, g, groups));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(part[r][b], s, acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) w.out[b * w.N + n + r] = _mm512_reduce_add_ps(acc[r][b]);
}

// Affine: the nibbles are the integers and each group's bias times the group's
// input sum (`x_sums`) is added, in scalars beside the vector sums.
template <int B, int R, bool Affine>
AVX512 void tile_int4(const Weights& w, const float* x, const float* x_sums, int64_t n, int64_t K, int64_t group) {
  const int64_t groups = K / group, half = group / 2, row_bytes = K / 2;
  const __m512i low_nibble = _mm512_set1_epi32(0xF), zero = _mm512_set1_epi32(Affine ? 0 : 8);
  __m512 acc[R][B];
  float bias_terms[R][B] = {};
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][B];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) part[r][b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < half; i += 16) {
      __m512 lo[R], hi[R];
      for (int r = 0; r < R; ++r) {
        const __m128i bytes =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.packed + (n + r) * row_bytes + g * half + i));
        const __m512i wide = _mm512_cvtepu8_epi32(bytes);
        lo[r] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(wide, low_nibble), zero));
        hi[r] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(wide, 4), zero));
      }
      for (int b = 0; b < B; ++b) {
        const float* xg = x + b * K + g * group + i;
        const __m512 x_lo = _mm512_loadu_ps(xg), x_hi = _mm512_loadu_ps(xg + half);
        for (int r = 0; r < R; ++r) {
          part[r][b] = _mm512_fmadd_ps(lo[r], x_lo, part[r][b]);
          part[r][b] = _mm512_fmadd_ps(hi[r], x_hi, part[r][b]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(scale_of(w, n + r, g, groups));
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(part[r][b], s, acc[r][b]);
      if constexpr (Affine) {
        const float bias = w.bias(n + r, g, groups);
        for (int b = 0; b < B; ++b) bias_terms[r][b] += bias * x_sums[b * groups + g];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) w.out[b * w.N + n + r] = _mm512_reduce_add_ps(acc[r][b]) + bias_terms[r][b];
}

template <int B, int R8, int R4>
AVX512 void rows_fixed(const Weights& w, const float* x, const float* x_sums, int64_t n0, int64_t n1, int64_t K,
                       int bits, int64_t group) {
  int64_t n = n0;
  if (bits == 8) {
    for (; n + R8 <= n1; n += R8) tile_int8<B, R8>(w, x, n, K, group);
    for (; n < n1; ++n) tile_int8<B, 1>(w, x, n, K, group);
  } else if (w.biases) {
    for (; n + R4 <= n1; n += R4) tile_int4<B, R4, true>(w, x, x_sums, n, K, group);
    for (; n < n1; ++n) tile_int4<B, 1, true>(w, x, x_sums, n, K, group);
  } else {
    for (; n + R4 <= n1; n += R4) tile_int4<B, R4, false>(w, x, x_sums, n, K, group);
    for (; n < n1; ++n) tile_int4<B, 1, false>(w, x, x_sums, n, K, group);
  }
}

// Tile heights that keep the totals, partial sums and widened weights within the
// 32 vector registers.
AVX512 void rows_avx512(const Weights& w, const float* x, const float* x_sums, int64_t rows, int64_t n0,
                        int64_t n1, int64_t K, int bits, int64_t group) {
  for (int64_t b0 = 0; b0 < rows; b0 += 8) {
    const float* xs = x + b0 * K;
    const float* sums = x_sums ? x_sums + b0 * (K / group) : nullptr;
    Weights shifted = w;
    shifted.out = w.out + b0 * w.N;
    switch (rows - b0 < 8 ? rows - b0 : 8) {
      case 1: rows_fixed<1, 8, 6>(shifted, xs, sums, n0, n1, K, bits, group); break;
      case 2: rows_fixed<2, 4, 4>(shifted, xs, sums, n0, n1, K, bits, group); break;
      case 3: rows_fixed<3, 3, 2>(shifted, xs, sums, n0, n1, K, bits, group); break;
      case 4: rows_fixed<4, 3, 2>(shifted, xs, sums, n0, n1, K, bits, group); break;
      case 5: rows_fixed<5, 1, 1>(shifted, xs, sums, n0, n1, K, bits, group); break;
      case 6: rows_fixed<6, 1, 1>(shifted, xs, sums, n0, n1, K, bits, group); break;
      case 7: rows_fixed<7, 1, 1>(shifted, xs, sums, n0, n1, K, bits, group); break;
      default: rows_fixed<8, 1, 1>(shifted, xs, sums, n0, n1, K, bits, group); break;
    }
  }
}

// The sum of all lanes of the U accumulators of activation row b.
template <int U, int B>
__attribute__((target("avx2"))) inline float lane_sum(const __m256 (&acc)[U][B], int b) {
  __m256 total = acc[0][b];
  for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[u][b]);
  const __m128 half_sum = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  __m128 sum = _mm_add_ps(half_sum, _mm_movehl_ps(half_sum, half_sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}

#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

// Block `i` (32 inputs) of group `g` of weight row `row`, as unsigned bytes
// q + offset in input order.
template <int Bits>
AVX512_VNNI inline __m256i weight_block(const uint8_t* row, int64_t g, int64_t i, int64_t group) {
  if constexpr (Bits == 8) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * group + i * kBlock));
    return _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));  // q + 128
  } else {
    const int64_t half = group / 2;
    const uint8_t* bytes = row + g * half;
    if (half == 16) {  // the block is the whole group: low nibbles, then high ones
      const __m128i low_nibbles = _mm_set1_epi8(0x0F);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
      const __m128i lo = _mm_and_si128(b, low_nibbles), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low_nibbles);
      return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
    const __m256i nibbles = _mm256_set1_epi8(0x0F);
    const int64_t start = i * kBlock;
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + (start < half ? start : start - half)));
    return start < half ? _mm256_and_si256(b, nibbles) : _mm256_and_si256(_mm256_srli_epi16(b, 4), nibbles);
  }
}

// `count` 16-bit floats (float16 if `half`, else bfloat16) as float32.
AVX512_VNNI inline void widen(const uint16_t* from, bool half, int64_t count, float* to) {
  int64_t g = 0;
  for (; g + 16 <= count; g += 16) {  // 16 at a time
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + g));
    _mm512_storeu_ps(to + g, half ? _mm512_cvtph_ps(raw)
                                  : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
  }
  for (; g < count; ++g) to[g] = half ? _cvtsh_ss(from[g]) : to_float(from[g]);
}

// Blocks `block` and `block + 1` (even, of one group) of a weight row as unsigned
// bytes q + offset in input order: int8 blocks lie in order; an int4 group of 64
// is one 32-byte load (its low nibbles the first block, its high ones the
// second), and a pair of blocks of a group of 128 the low or high nibbles of one
// 64-byte load.
template <int Bits>
AVX512_VNNI inline __m512i block_pair(const uint8_t* row, int64_t block, int64_t per_group, int64_t shift) {
  if constexpr (Bits == 8) {
    const __m512i bytes = _mm512_loadu_si512(row + block * kBlock);
    return _mm512_xor_si512(bytes, _mm512_set1_epi8(static_cast<char>(0x80)));  // q + 128
  } else {
    const int64_t g = block >> shift, i = block - g * per_group;
    const uint8_t* bytes = row + g * per_group * (kBlock / 2);
    if (per_group == 2) {
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
      const __m256i low = _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(both, 4), _mm256_set1_epi8(0x0F));
      return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    }
    const int64_t half = per_group / 2;
    const __m512i wide = _mm512_loadu_si512(bytes + (i < half ? i : i - half) * kBlock);
    const __m512i nibbles = _mm512_set1_epi8(0x0F);
    return i < half ? _mm512_and_si512(wide, nibbles) : _mm512_and_si512(_mm512_srli_epi16(wide, 4), nibbles);
  }
}

// Four groups of 32 (int4) from one 64-byte load: the low nibbles are the four
// groups' first halves, the high ones their second halves; `xs` (the activations'
// `quads`) holds the inputs in that order, so each group's products land in four
// lanes of its own, which its dw * dx scales.
template <int B>
AVX512_VNNI inline void quad_step(const uint8_t* row, const int8_t* xs, const float* both, int64_t blocks, int64_t K,
                                  int64_t first, __m512 (&acc)[B]) {
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  const __m512i by_group = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i bytes = _mm512_loadu_si512(row + first * 16);
  const __m512i lo = _mm512_and_si512(bytes, nibbles);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibbles);
  for (int b = 0; b < B; ++b) {
    const int8_t* x = xs + b * K + first * kBlock;
    __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
    sums = _mm512_dpbusd_epi32(sums, hi, _mm512_loadu_si512(x + 64));
    const __m512 scales = _mm512_permutexvar_ps(by_group, _mm512_castps128_ps512(_mm_loadu_ps(both + b * blocks + first)));
    acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scales, acc[b]);
  }
}

// Two blocks (`block` even) in one 512-bit product: lanes 0-7 the first, 8-15 the second.
template <int Bits, int B>
AVX512_VNNI inline void pair_step(const uint8_t* row, const int8_t* xq, const float* both, int64_t blocks, int64_t K,
                                  int64_t block, int64_t per_group, int64_t shift, __m512 (&acc)[B]) {
  const __m512i by_block = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i wv = block_pair<Bits>(row, block, per_group, shift);
  for (int b = 0; b < B; ++b) {
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(xq + b * K + block * kBlock));
    const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(both + b * blocks + block)));
    acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(by_block, _mm512_castps128_ps512(two)), acc[b]);
  }
}

// One weight row against B rows of quantized activations: `vpdpbusd` sums the
// products of two blocks (quad_step: four int4 groups of 32) into integer lanes,
// which one multiply-add scales by each block's dw * dx into the row's float sums;
// U steps at a time keep independent sums in flight. The weights' offset (or the
// affine biases) comes in at the end through `offset_sum`. One row at a time
// streams each row's bytes in order, which the hardware prefetchers follow (eight
// interleaved rows, as the float tiles take them, ran at a third of the speed).
template <int Bits, int B>
AVX512_VNNI void row_vnni(const Weights& w, const QuantizedActivations& a, int64_t b0, int64_t n, int64_t group,
                          float* scratch) {
  constexpr int U = B >= 4 ? 1 : 4 / B;
  const int64_t K = a.K, groups = K / group, blocks = K / kBlock, row_bytes = K * Bits / 8;
  const int64_t per_group = group / kBlock, shift = per_group == 1 ? 0 : per_group == 2 ? 1 : 2;
  const uint8_t* row = w.packed + n * row_bytes;
  float* dw = scratch;                    // [groups]
  float* bias = scratch + groups;         // [groups] (affine)
  float* both = scratch + 2 * groups;     // [B, blocks]: dw * dx
  // int4: the row four ahead into the cache while this one is summed (the hardware
  // prefetchers alone kept int4 rows at ~13 GB/s here, int8 ones at ~19; with
  // this, int4 at ~17; no gain for int8). A prefetch past the end does not fault.
  if constexpr (Bits == 4)
    for (int64_t offset = 0; offset < row_bytes; offset += 64)
      _mm_prefetch(reinterpret_cast<const char*>(row + 4 * row_bytes + offset), _MM_HINT_T0);
  widen(w.scales + n * groups, w.half, groups, dw);
  if (w.biases) widen(w.biases + n * groups, w.half, groups, bias);
  for (int b = 0; b < B; ++b) {
    const float* dx = a.scale.data() + (b0 + b) * blocks;
    float* out = both + b * blocks;
    if (per_group == 1) {
      int64_t j = 0;
      for (; j + 16 <= blocks; j += 16)
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_loadu_ps(dw + j), _mm512_loadu_ps(dx + j)));
      for (; j < blocks; ++j) out[j] = dw[j] * dx[j];
    } else {
      for (int64_t gg = 0; gg < groups; ++gg)
        for (int64_t i = 0; i < per_group; ++i) out[gg * per_group + i] = dw[gg] * dx[gg * per_group + i];
    }
  }
  // 512-bit products, two blocks (int4 in groups of 32: four groups) per
  // instruction; the blocks left over go one at a time through 256-bit products
  // into `rest`.
  __m512 acc[U][B];
  __m256 rest[B];
  for (int b = 0; b < B; ++b) {
    rest[b] = _mm256_setzero_ps();
    for (int u = 0; u < U; ++u) acc[u][b] = _mm512_setzero_ps();
  }
  const int8_t* xq = a.q.data() + b0 * K;
  int64_t j = 0;
  if (Bits == 4 && per_group == 1) {
    if (!a.quads.empty()) {
      const int8_t* xs = a.quads.data() + b0 * K;
      for (; j + 4 * U <= blocks; j += 4 * U)  // U independent sums in flight
        for (int u = 0; u < U; ++u) quad_step<B>(row, xs, both, blocks, K, j + 4 * u, acc[u]);
      for (; j + 4 <= blocks; j += 4) quad_step<B>(row, xs, both, blocks, K, j, acc[0]);
    }
  } else {
    for (; j + 2 * U <= blocks; j += 2 * U)
      for (int u = 0; u < U; ++u) pair_step<Bits, B>(row, xq, both, blocks, K, j + 2 * u, per_group, shift, acc[u]);
    for (; j + 2 <= blocks; j += 2) pair_step<Bits, B>(row, xq, both, blocks, K, j, per_group, shift, acc[0]);
  }
  for (; j < blocks; ++j) {
    const int64_t gb = j >> shift;
    const __m256i wv = weight_block<Bits>(row, gb, j - gb * per_group, group);
    for (int b = 0; b < B; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * K + j * kBlock));
      const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
      rest[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(both[b * blocks + j]), rest[b]);
    }
  }
  // Symmetric: minus dw * (offset * input sum) per group; affine: plus bias * input sum.
  const float* coefficient = w.biases ? bias : dw;
  const float sign = w.biases ? 1.0f : -1.0f;
  for (int b = 0; b < B; ++b) {
    __m512 wide = acc[0][b];
    for (int u = 1; u < U; ++u) wide = _mm512_add_ps(wide, acc[u][b]);
    const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(wide), 1));
    const __m256 folded = _mm256_add_ps(rest[b], _mm256_add_ps(_mm512_castps512_ps256(wide), upper));
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(folded), _mm256_extractf128_ps(folded, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    const float sum = _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
    const float* offsets = a.offset_sum.data() + (b0 + b) * groups;
    __m512 offset16 = _mm512_setzero_ps();
    int64_t gg = 0;
    for (; gg + 16 <= groups; gg += 16)
      offset16 = _mm512_fmadd_ps(_mm512_loadu_ps(coefficient + gg), _mm512_loadu_ps(offsets + gg), offset16);
    float offset = _mm512_reduce_add_ps(offset16);
    for (; gg < groups; ++gg) offset += coefficient[gg] * offsets[gg];
    w.out[(b0 + b) * w.N + n] = sum + sign * offset;
  }
}

template <int Bits, int B>
AVX512_VNNI void rows_vnni_fixed(const Weights& w, const QuantizedActivations& a, int64_t b0, int64_t n0,
                                 int64_t n1, int64_t group, float* scratch) {
  for (int64_t n = n0; n < n1; ++n) row_vnni<Bits, B>(w, a, b0, n, group, scratch);
}

// Sixteen weight rows at a time against several activation rows (batched decode,
// prompts). row_vnni scales each block's partial sums lane by lane, so every
// product costs two more vector operations of scaling, which bound it once there
// are a few activation rows to share each weight load. Here a tile's integers are
// first transposed: one 512-bit vector holds four consecutive inputs of each of
// the 16 rows, a product with those four inputs of an activation row (broadcast)
// sums into the rows' 16 lanes, and a block's eight products leave one vector of
// 16 integer sums that one multiply-add scales. Each block's sum starts at minus
// the weights' offset times the activations' block sum, so it ends exact.
constexpr int64_t kTile = 16;

// Blocks (512 bytes each) that the products over stored tiles fetch ahead in
// software. Measured on a 2-core AMD EPYC (Qwen3-0.6B shapes, int8, the products
// of a whole step): 8 activation rows took 32 ms with the hardware prefetchers
// alone, 24 ms 4 blocks ahead and 19 ms 16 ahead (8 KiB; 32 and 64 no better).
// Fetching the next tile's scales and each chunk's first blocks as well, and
// the blocks as non-temporal (they are read once), took one row from 14.6 to
// 12.0 ms and 8 rows from 18.4 to 16.4 (T0 instead of NTA: 13.1 and 16.8).
constexpr int64_t kStoredAhead = 16;

// Whether that stream is fetched non-temporal. On a 2-core Intel Xeon VM (AVX-512
// VNNI and AMX) the same non-temporal fetches halved the speed of a whole int8 step
// (62 ms against 29 with T0, 31 with no software fetch; T1 and T2 as T0), so only
// AMD's CPUs get them. Read once, when the library loads: not in the products' loop.
const bool kStreamNonTemporal = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
}();

// Rows a[r] of eight 32-bit words as eight vectors, out[d] holding word d of
// every row in lanes 0..15: 4x4 interleaves within 128-bit lanes, then the lanes
// gathered in row order.
AVX512_VNNI inline void transpose_16x8(const __m256i (&a)[16], __m512i (&out)[8]) {
  __m512i z[8], t[8], u[8];
  for (int r = 0; r < 4; ++r) {  // lanes of z[r]: row r (words 0-3, 4-7), then row r + 4
    z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(a[r]), a[r + 4], 1);
    z[4 + r] = _mm512_inserti64x4(_mm512_castsi256_si512(a[8 + r]), a[12 + r], 1);
  }
  for (int h = 0; h < 8; h += 4) {
    t[h] = _mm512_unpacklo_epi32(z[h], z[h + 1]);
    t[h + 1] = _mm512_unpackhi_epi32(z[h], z[h + 1]);
    t[h + 2] = _mm512_unpacklo_epi32(z[h + 2], z[h + 3]);
    t[h + 3] = _mm512_unpackhi_epi32(z[h + 2], z[h + 3]);
    u[h] = _mm512_unpacklo_epi64(t[h], t[h + 2]);          // word 0 (and 4) of four rows
    u[h + 1] = _mm512_unpackhi_epi64(t[h], t[h + 2]);      // word 1 (5)
    u[h + 2] = _mm512_unpacklo_epi64(t[h + 1], t[h + 3]);  // word 2 (6)
    u[h + 3] = _mm512_unpackhi_epi64(t[h + 1], t[h + 3]);  // word 3 (7)
  }
  for (int d = 0; d < 4; ++d) {
    out[d] = _mm512_shuffle_i32x4(u[d], u[4 + d], _MM_SHUFFLE(2, 0, 2, 0));
    out[d + 4] = _mm512_shuffle_i32x4(u[d], u[4 + d], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// The blocks a chunk of a tile's bytes holds: int8, chunk c is block c; int4,
// chunk c is 32 bytes of each row, two blocks: in groups of 32 two whole groups
// (16 bytes each, low nibbles the first half, high ones the second), in larger
// groups one block's low nibbles and another's high ones. A last lone group of
// 32 is a chunk of 16 bytes, one block.
template <int Bits>
inline int chunk_blocks(int64_t c, int64_t blocks, int64_t group, int64_t (&filled)[2]) {
  if constexpr (Bits == 8) {
    filled[0] = c;
    return 1;
  } else {
    if (group == kBlock) {
      filled[0] = 2 * c;
      filled[1] = 2 * c + 1;
      return 2 * c + 1 < blocks ? 2 : 1;
    }
    const int64_t half = group / 2, per_group = group / kBlock;
    const int64_t g = 32 * c / half, within = 32 * c - g * half;  // bytes into the group
    filled[0] = g * per_group + within / kBlock;
    filled[1] = g * per_group + (half + within) / kBlock;
    return 2;
  }
}

template <int Bits>
constexpr int64_t chunk_count(int64_t blocks) { return Bits == 8 ? blocks : (blocks + 1) / 2; }

// Chunk c of a tile's 16 rows rearranged for the products: per block of 32 inputs
// eight vectors, vector q holding inputs 4q..4q+3 of the 16 rows as unsigned bytes
// (int8: q + 128; int4: the nibble), stored at `packed + 8 * block`.
// `filled` / `count`: the chunk's blocks, as chunk_blocks gives them.
template <int Bits>
AVX512_VNNI inline void pack_chunk(const uint8_t* rows, int64_t row_bytes, int64_t group, int64_t c,
                                   const int64_t (&filled)[2], int count, __m512i* packed) {
  __m256i a[16];
  __m512i t[8];
  if constexpr (Bits == 8) {
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    const uint8_t* from = rows + c * kBlock;
    for (int r = 0; r < 16; ++r, from += row_bytes) a[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
    transpose_16x8(a, t);
    for (int q = 0; q < 8; ++q) _mm512_store_si512(packed + 8 * c + q, _mm512_xor_si512(t[q], offset));
  } else {
    const __m512i nibbles = _mm512_set1_epi8(0x0F);
    const bool lone = group == kBlock && count == 1;
    const uint8_t* from = rows + c * 32;
    for (int r = 0; r < 16; ++r, from += row_bytes)
      a[r] = lone ? _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(from)), 0)
                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
    transpose_16x8(a, t);
    __m512i low[8], high[8];
    for (int q = 0; q < 8; ++q) {
      low[q] = _mm512_and_si512(t[q], nibbles);
      high[q] = _mm512_and_si512(_mm512_srli_epi16(t[q], 4), nibbles);
    }
    __m512i* first = packed + 8 * filled[0];
    __m512i* second = packed + 8 * filled[1];
    if (group == kBlock) {  // words 0-3 the first group, 4-7 the second
      for (int q = 0; q < 4; ++q) {
        _mm512_store_si512(first + q, low[q]);
        _mm512_store_si512(first + 4 + q, high[q]);
        if (!lone) {
          _mm512_store_si512(second + q, low[4 + q]);
          _mm512_store_si512(second + 4 + q, high[4 + q]);
        }
      }
    } else {
      for (int q = 0; q < 8; ++q) {
        _mm512_store_si512(first + q, low[q]);
        _mm512_store_si512(second + q, high[q]);
      }
    }
  }
}

inline int32_t word_at(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return word;
}

// Block j of a packed tile against B activation rows from b0, into acc.
template <int B>
AVX512_VNNI inline void block_products(const __m512i* packed, const float* dw, const QuantizedActivations& a,
                                       int64_t b0, int64_t j, __m512 (&acc)[B]) {
  const int64_t K = a.K, blocks = K / kBlock;
  const __m512i* wv = packed + 8 * j;
  const __m512 scale = _mm512_loadu_ps(dw + kTile * j);
  for (int b = 0; b < B; ++b) {
    const int64_t at = (b0 + b) * blocks + j;
    const int8_t* x = a.q.data() + (b0 + b) * K + j * kBlock;
    // Two chains of four products, not one of eight: the products' latency, not
    // their count, bounded the tiles.
    __m512i sums = _mm512_set1_epi32(a.start[at]), odd = _mm512_setzero_si512();
    for (int q = 0; q < 8; q += 2) {
      sums = _mm512_dpbusd_epi32(sums, _mm512_loadu_si512(wv + q), _mm512_set1_epi32(word_at(x + 4 * q)));
      odd = _mm512_dpbusd_epi32(odd, _mm512_loadu_si512(wv + q + 1), _mm512_set1_epi32(word_at(x + 4 * q + 4)));
    }
    sums = _mm512_add_epi32(sums, odd);
    acc[b] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(a.scale[at])), scale, acc[b]);
  }
}

// A tile against B activation rows from b0: out[b, 0..15] for its 16 weight
// rows. With `rows` (the tile's first row of integers) each chunk is packed into
// `scratch` just before its products, so that the shuffles of the packing and
// the products share the cores' ports, and `packed` is `scratch`; without,
// `packed` is read as it lies (packed by an earlier pass, or stored tiled).
// `dw`: per block the 16 rows' scales; `bias` (affine): per group the 16 rows'
// biases, which multiply the group's input sums.
template <int Bits, int B>
AVX512_VNNI void tile_rows(const uint8_t* rows, __m512i* scratch, const __m512i* packed, const float* dw,
                           const float* bias,
                           const QuantizedActivations& a, int64_t b0, int64_t group, float* out, int64_t N,
                           int64_t row_bytes) {
  const int64_t K = a.K, blocks = K / kBlock, groups = K / group;
  __m512 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunk_count<Bits>(blocks); ++c) {
    int64_t filled[2];
    const int count = chunk_blocks<Bits>(c, blocks, group, filled);
    if (rows) pack_chunk<Bits>(rows, row_bytes, group, c, filled, count, scratch);
    if (!rows && packed != scratch) {  // stored tiles: one stream through the tiles of the chunk and on
      const __m512i* ahead = packed + 8 * (c + kStoredAhead);
      if (kStreamNonTemporal)
        prefetch_lines<0>(ahead, sizeof(__m512i) * 8);
      else
        prefetch_lines<3>(ahead, sizeof(__m512i) * 8);
    }
    for (int i = 0; i < count; ++i) block_products<B>(packed, dw, a, b0, filled[i], acc);
  }
  if (bias)
    for (int64_t g = 0; g < groups; ++g)
      for (int b = 0; b < B; ++b)
        acc[b] = _mm512_fmadd_ps(_mm512_loadu_ps(bias + kTile * g),
                                 _mm512_set1_ps(a.offset_sum[(b0 + b) * groups + g]), acc[b]);
  for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + (b0 + b) * N, acc[b]);
}

// The 16 rows' 16-bit floats (`values[r * groups + g]`, float16 if `half`, else
// bfloat16) as float32 columns, `columns[16 * g + r]`: eight groups of each row
// widened in a register, then transposed in registers. (A gather per column was
// slower: gathers are microcoded where the CPU's data-sampling mitigations are on.
// Widening the rows into a table first cost a store and a load per value.)
AVX512_VNNI void tile_columns(const uint16_t* values, int64_t groups, bool half, float* columns) {
  __m256i a[16];
  __m512i t[8];
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int64_t count = std::min<int64_t>(8, groups - g0);
    const __mmask8 lanes = static_cast<__mmask8>((1u << count) - 1);
    for (int r = 0; r < 16; ++r) {
      const __m128i raw = _mm_maskz_loadu_epi16(lanes, values + r * groups + g0);
      a[r] = half ? _mm256_castps_si256(_mm256_cvtph_ps(raw)) : _mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16);
    }
    transpose_16x8(a, t);
    for (int64_t d = 0; d < count; ++d) _mm512_storeu_ps(columns + kTile * (g0 + d), _mm512_castsi512_ps(t[d]));
  }
}

// Stored tiles read as this many streams at once, for up to kStreamedRows
// activation rows (the streams' sums must stay in registers). On the 2-core Intel
// Xeon VM one thread walking its tiles in order read 23-25 GB/s: its single stream
// kept too few lines in flight. Four streams, each through its own quarter of the
// thread's tiles with software fetches 4 blocks ahead, read 29-31 GB/s in a loop
// over 640 MB (2 and 8 streams: 28 and 30). Not measured on AMD, which keeps the
// single non-temporal stream it was tuned with. EQX_MODELS_QUANTIZED_STREAMS=0 or
// 1 forces one way or the other, for tests and measurements.
constexpr int kStreams = 4;
constexpr int64_t kStreamedRows = 2;
constexpr int64_t kStreamAhead = 4;
const bool kStreamTiles = [] {
  const char* forced = std::getenv("EQX_MODELS_QUANTIZED_STREAMS");
  return forced ? std::atoi(forced) != 0 : !kStreamNonTemporal;
}();

// Stored int8 tiles from row n0 against B (<= kStreamedRows) activation rows,
// kStreams tiles at a time, each from its own contiguous run of `per_stream`
// tiles. `dw`: kStreams scale tables of kTile * blocks floats.
template <int B>
AVX512_VNNI void streamed_tiles(const Weights& w, const QuantizedActivations& a, int64_t n0, int64_t per_stream,
                                int64_t group, float* dw) {
  const int64_t K = a.K, blocks = K / kBlock, groups = K / group, per_group = group / kBlock;
  const int64_t tile_scale_bytes = kTile * groups * sizeof(uint16_t);
  for (int64_t t = 0; t < per_stream; ++t) {
    const __m512i* tile[kStreams];
    int64_t first_row[kStreams];
    __m512 acc[kStreams][B];
    for (int s = 0; s < kStreams; ++s) {
      const int64_t n = n0 + kTile * (s * per_stream + t);
      first_row[s] = n;
      tile[s] = reinterpret_cast<const __m512i*>(w.packed + n * K);
      prefetch_lines(w.scales + (n + kTile) * groups, tile_scale_bytes);
      float* table = dw + s * kTile * blocks;
      widen(w.scales + n * groups, w.half, kTile * groups, table);
      for (int64_t g = groups - 1; per_group > 1 && g >= 0; --g)  // spread in place, last group first
        for (int64_t i = per_group - 1; i >= 0; --i)
          std::memmove(table + kTile * (g * per_group + i), table + kTile * g, kTile * sizeof(float));
      for (int b = 0; b < B; ++b) acc[s][b] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < blocks; ++j)
      for (int s = 0; s < kStreams; ++s) {
        prefetch_lines(tile[s] + 8 * (j + kStreamAhead), sizeof(__m512i) * 8);  // past a tile's end: its run's next
        block_products<B>(tile[s], dw + s * kTile * blocks, a, 0, j, acc[s]);
      }
    for (int s = 0; s < kStreams; ++s)
      for (int b = 0; b < B; ++b) _mm512_storeu_ps(w.out + b * w.N + first_row[s], acc[s][b]);
  }
}

// Whole tiles of rows [n0, n1) against every activation row; returns the first
// row left over (fewer than 16; none for stored tiles, whose N is whole tiles).
template <int Bits>
AVX512_VNNI int64_t tiles_vnni(const Weights& w, const QuantizedActivations& a, int64_t n0, int64_t n1,
                               int64_t group) {
  const int64_t K = a.K, blocks = K / kBlock, groups = K / group, per_group = group / kBlock;
  const int64_t row_bytes = K * Bits / 8;
  if (n1 - n0 < kTile) return n0;
  std::unique_ptr<uint8_t[]> storage(new uint8_t[64 * (8 * blocks + 1)]);  // 64-byte aligned vectors within
  __m512i* packed = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(storage.get()) + 63) & ~uintptr_t{63});
  // Per block the 16 rows' scales: a group's column, repeated for each of its blocks
  // (groups of 32: the columns themselves).
  std::vector<float> columns(kTile * groups), repeated(per_group > 1 ? kTile * blocks : 0);
  std::vector<float> bias(w.biases ? kTile * groups : 0);
  const float* dw = per_group > 1 ? repeated.data() : columns.data();
  int64_t n = n0;
  const int64_t tile_scale_bytes = kTile * groups * sizeof(uint16_t);
  if (w.tiled) {  // the chunk's first blocks and scales; the products fetch the rest on the way
    prefetch_lines(w.packed + n * K, std::min(kTile * K, kTile * kBlock * kStoredAhead));
    prefetch_lines(w.scales + n * groups, tile_scale_bytes);
  }
  for (; n + kTile <= n1; n += kTile) {
    if (w.tiled) prefetch_lines(w.scales + (n + kTile) * groups, tile_scale_bytes);  // the next tile's
    if (w.tiled)  // stored as columns already
      widen(w.scales + n * groups, w.half, kTile * groups, columns.data());
    else
      tile_columns(w.scales + n * groups, groups, w.half, columns.data());
    if (per_group > 1)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < per_group; ++i)
          std::memcpy(repeated.data() + kTile * (g * per_group + i), columns.data() + kTile * g, kTile * sizeof(float));
    if (w.biases) tile_columns(w.biases + n * groups, groups, w.half, bias.data());
    const float* biases = w.biases ? bias.data() : nullptr;
    float* out = w.out + n;
    // Stored tiles: the 16 rows' n * K bytes lie before this tile's (int8 only).
    const __m512i* tile = w.tiled ? reinterpret_cast<const __m512i*>(w.packed + n * K) : packed;
    for (int64_t b0 = 0; b0 < a.rows; b0 += 8) {
      // packed on the first pass, unless stored so
      const uint8_t* rows = b0 == 0 && !w.tiled ? w.packed + n * row_bytes : nullptr;
      switch (a.rows - b0 < 8 ? a.rows - b0 : 8) {
#define EQX_TILE(B) tile_rows<Bits, B>(rows, packed, tile, dw, biases, a, b0, group, out, w.N, row_bytes)
        case 1: EQX_TILE(1); break;
        case 2: EQX_TILE(2); break;
        case 3: EQX_TILE(3); break;
        case 4: EQX_TILE(4); break;
        case 5: EQX_TILE(5); break;
        case 6: EQX_TILE(6); break;
        case 7: EQX_TILE(7); break;
        default: EQX_TILE(8); break;
#undef EQX_TILE
      }
    }
  }
  return n;
}

// From this many activation rows on, whole tiles go through tiles_vnni: measured
// on the Qwen3-0.6B shapes (2 cores, AVX-512 VNNI), symmetric weights gain from
// 4 rows, affine ones (whose row path is slower) from 2.
// EQX_MODELS_QUANTIZED_TILES_FROM moves the switch, for tests and measurements.
int64_t tile_rows_from(bool affine) {
  static const char* forced = std::getenv("EQX_MODELS_QUANTIZED_TILES_FROM");
  return forced ? std::atoll(forced) : affine ? 2 : 4;
}

template <int Bits>
AVX512_VNNI void rows_vnni(const Weights& w, const QuantizedActivations& a, int64_t n0, int64_t n1, int64_t group) {
  if (w.tiled || a.rows >= tile_rows_from(w.biases != nullptr)) n0 = tiles_vnni<Bits>(w, a, n0, n1, group);
  std::vector<float> scratch(2 * (a.K / group) + 8 * (a.K / kBlock));
  for (int64_t b0 = 0; b0 < a.rows; b0 += 8) {
    float* s = scratch.data();
    switch (a.rows - b0 < 8 ? a.rows - b0 : 8) {
      case 1: rows_vnni_fixed<Bits, 1>(w, a, b0, n0, n1, group, s); break;
      case 2: rows_vnni_fixed<Bits, 2>(w, a, b0, n0, n1, group, s); break;
      case 3: rows_vnni_fixed<Bits, 3>(w, a, b0, n0, n1, group, s); break;
      case 4: rows_vnni_fixed<Bits, 4>(w, a, b0, n0, n1, group, s); break;
      case 5: rows_vnni_fixed<Bits, 5>(w, a, b0, n0, n1, group, s); break;
      case 6: rows_vnni_fixed<Bits, 6>(w, a, b0, n0, n1, group, s); break;
      case 7: rows_vnni_fixed<Bits, 7>(w, a, b0, n0, n1, group, s); break;
      default: rows_vnni_fixed<Bits, 8>(w, a, b0, n0, n1, group, s); break;
    }
  }
}

// Rows [n0, n1) of stored int8 tiles against one or two activation rows (with
// kStreamTiles): streamed_tiles, then the few tiles after its whole runs one at a
// time. The scale tables are the thread's own, kept from call to call (tiles_vnni
// allocates its packing buffer and tables per chunk, which stored tiles never use).
AVX512_VNNI void streamed_chunk(const Weights& w, const QuantizedActivations& a, int64_t n0, int64_t n1,
                                int64_t group) {
  thread_local std::vector<float> tables;
  tables.resize(kStreams * kTile * (a.K / kBlock));
  const int64_t per_stream = (n1 - n0) / kTile / kStreams;
  if (a.rows == 1)
    streamed_tiles<1>(w, a, n0, per_stream, group, tables.data());
  else
    streamed_tiles<2>(w, a, n0, per_stream, group, tables.data());
  const int64_t rest = n0 + kStreams * per_stream * kTile;
  if (rest < n1) tiles_vnni<8>(w, a, rest, n1, group);
}

#define AVX2 __attribute__((target("avx2,fma,f16c")))

// Block `i` (32 inputs) of group `g` of a weight row as signed bytes q, in input
// order (affine int4: the nibbles themselves, 0..15).
template <int Bits, bool Affine = false>
AVX2 inline __m256i signed_block(const uint8_t* row, int64_t g, int64_t i, int64_t group) {
  if constexpr (Bits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * group + i * kBlock));
  } else {
    const int64_t half = group / 2, start = i * kBlock;
    const uint8_t* bytes = row + g * half;
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    __m256i nibbles;
    if (half == 16) {  // the block is the whole group: low nibbles, then high ones
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
      nibbles = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(b, low_nibbles)),
                                        _mm_and_si128(_mm_srli_epi16(b, 4), low_nibbles), 1);
    } else {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + (start < half ? start : start - half)));
      const __m256i mask = _mm256_set1_epi8(0x0F);
      nibbles = start < half ? _mm256_and_si256(b, mask) : _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
    }
    return Affine ? nibbles : _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8));
  }
}

AVX2 inline float scale_avx2(const Weights& w, int64_t n, int64_t g, int64_t groups) {
  const uint16_t s = w.scales[n * groups + g];
  return w.half ? _cvtsh_ss(s) : to_float(s);
}

// Without VNNI (AVX2 only): `vpmaddubsw` multiplies unsigned by signed bytes into
// saturating 16-bit pair sums, so the weights go in as |q| and each activation
// takes q's sign (|q| * sign(q) x: at most 2 * 128 * 127, no saturation); a
// `vpmaddwd` by ones widens the pairs to the 8 lanes of 32-bit sums. The weights
// are read signed, so no offset comes off at the end. Affine int4 nibbles are
// unsigned already (the biases come in at the end). Block `k` of the row into
// the B sums `acc`.
template <int Bits, int B, bool Affine>
AVX2 inline void block_avx2(const uint8_t* row, const QuantizedActivations& a, int64_t b0, const float* dw,
                            int64_t group, int64_t k, __m256* acc) {
  const int64_t K = a.K, blocks = K / kBlock, per_group = group / kBlock, g = k / per_group;
  const __m256i wv = signed_block<Bits, Affine>(row, g, k - g * per_group, group);
  const __m256i magnitude = Affine ? wv : _mm256_sign_epi8(wv, wv);
  for (int b = 0; b < B; ++b) {
    const int8_t* xq = a.q.data() + (b0 + b) * K + k * kBlock;
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    const __m256i pairs = _mm256_maddubs_epi16(magnitude, Affine ? xv : _mm256_sign_epi8(xv, wv));
    const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    const float both = dw[g] * a.scale[(b0 + b) * blocks + k];
    acc[b] = _mm256_fmadd_ps(sums, _mm256_set1_ps(both), acc[b]);
  }
}

// One weight row against B activation rows; U blocks at a time keep independent
// sums in flight.
template <int Bits, int B, bool Affine>
AVX2 void row_avx2(const Weights& w, const QuantizedActivations& a, int64_t b0, int64_t n, int64_t group,
                   float* dw) {
  constexpr int U = B >= 4 ? 1 : 4 / B;
  const int64_t K = a.K, groups = K / group, blocks = K / kBlock;
  const uint8_t* row = w.packed + n * (K * Bits / 8);
  for (int64_t g = 0; g < groups; ++g) dw[g] = scale_avx2(w, n, g, groups);
  __m256 acc[U][B];
  for (int u = 0; u < U; ++u)
    for (int b = 0; b < B; ++b) acc[u][b] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + U <= blocks; j += U)
    for (int u = 0; u < U; ++u) block_avx2<Bits, B, Affine>(row, a, b0, dw, group, j + u, acc[u]);
  for (; j < blocks; ++j) block_avx2<Bits, B, Affine>(row, a, b0, dw, group, j, acc[0]);
  for (int b = 0; b < B; ++b) {
    float bias_term = 0;
    if constexpr (Affine)
      for (int64_t g = 0; g < groups; ++g) bias_term += w.bias(n, g, groups) * a.offset_sum[(b0 + b) * groups + g];
    w.out[(b0 + b) * w.N + n] = lane_sum<U, B>(acc, b) + bias_term;
  }
}

template <int Bits, bool Affine>
AVX2 void rows_avx2(const Weights& w, const QuantizedActivations& a, int64_t n0, int64_t n1, int64_t group) {
  std::vector<float> dw(a.K / group);
  for (int64_t b0 = 0; b0 < a.rows; b0 += 4) {
    for (int64_t n = n0; n < n1; ++n) {
      switch (a.rows - b0 < 4 ? a.rows - b0 : 4) {
        case 1: row_avx2<Bits, 1, Affine>(w, a, b0, n, group, dw.data()); break;
        case 2: row_avx2<Bits, 2, Affine>(w, a, b0, n, group, dw.data()); break;
        case 3: row_avx2<Bits, 3, Affine>(w, a, b0, n, group, dw.data()); break;
        default: row_avx2<Bits, 4, Affine>(w, a, b0, n, group, dw.data()); break;
      }
    }
  }
}

const bool kHasAvx2 = std::getenv("EQX_MODELS_KERNELS_PORTABLE") == nullptr && __builtin_cpu_supports("avx2") &&
                      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");

const bool kHasVnni = kAvx512Allowed && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");

const bool kHasAvx512 = kAvx512Allowed && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("f16c");
#else
const bool kHasAvx512 = false;
const bool kHasVnni = false;
const bool kHasAvx2 = false;
#endif

void rows_int(const Weights& w, const QuantizedActivations& a, int64_t n0, int64_t n1, int bits, int64_t group) {
#if defined(__x86_64__)
  if (kHasVnni) return bits == 8 ? rows_vnni<8>(w, a, n0, n1, group) : rows_vnni<4>(w, a, n0, n1, group);
  if (kHasAvx2) {
    if (bits == 8) return rows_avx2<8, false>(w, a, n0, n1, group);
    return w.biases ? rows_avx2<4, true>(w, a, n0, n1, group) : rows_avx2<4, false>(w, a, n0, n1, group);
  }
#endif
  rows_portable_int(w, a, n0, n1, bits, group);
}

void rows_any(const Weights& w, const float* x, const float* x_sums, int64_t rows, int64_t n0, int64_t n1, int64_t K,
              int bits, int64_t group) {
#if defined(__x86_64__)
  if (kHasAvx512) return rows_avx512(w, x, x_sums, rows, n0, n1, K, bits, group);
#endif
  rows_portable(w, x, x_sums, rows, n0, n1, K, bits, group);
}

// Chunks of whole tiles of 16 rows (see tiles_vnni). A decode's few activation
// rows (up to 8) stream the weights: about 2M weights a chunk, and per weight a
// multiple of the thread count of chunks, so each thread reads long runs and none
// is left waiting on an odd last chunk. Measured on a 2-core AMD EPYC (a Qwen3-0.6B
// decode step, the two chunkings alternated in one process): int8 18.2 -> 17.0 ms
// and int4 11.4 -> 10.4 ms against 256K weights a chunk; 8 rows unchanged.
// From 9 activation rows on the products cost more per weight: 256K weights a
// chunk, fewer rows the more activation rows (down to an eighth from 64 on), so a
// prompt still makes enough chunks for many cores.
constexpr int64_t kDecodeChunkWeights = int64_t{2} << 20;

int64_t chunk_rows(int64_t N, int64_t K, int64_t activation_rows) {
  K = K > 0 ? K : 1;
  if (activation_rows <= 8) {
    const int64_t threads = eqx_models::parallel_threads();
    const int64_t chunks = std::max<int64_t>(1, (N * K + kDecodeChunkWeights / 2) / kDecodeChunkWeights);
    const int64_t even = (chunks + threads - 1) / threads * threads;
    return std::max<int64_t>(16, ((N + even - 1) / even + 15) / 16 * 16);
  }
  const int64_t eights = activation_rows > 64 ? 8 : (activation_rows + 7) / 8;
  const int64_t rows = (256 * 1024) / K / eights / 16 * 16;
  return rows < 16 ? 16 : rows;
}

ffi::Error QuantizedMatvec(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs stacks,
                           ffi::RemainingRets outs, int32_t bits, int32_t group, int32_t int8_activations,
                           int32_t affine, int32_t tiled, ffi::ThreadPool xla_pool) {
  auto x_dims = x.dimensions();
  const size_t per_stack = affine ? 3 : 2;
  if (x_dims.size() < 1 || stacks.size() == 0 || stacks.size() != per_stack * outs.size())
    return ffi::Error::InvalidArgument(
        "quantized_matvec: want x [..., K], the layer, and (integers, scales[, biases]) per output");
  if ((bits != 8 && bits != 4) || group < 32 || group % 32)
    return ffi::Error::InvalidArgument("quantized_matvec: bits must be 8 or 4 and the group a multiple of 32");
  if (affine && bits != 4) return ffi::Error::InvalidArgument("quantized_matvec: affine weights are int4 only");
  if (tiled && (bits != 8 || !int8_activations || !kHasVnni))
    return ffi::Error::InvalidArgument(
        "quantized_matvec: stored tiles are int8 with int8 activations, on a CPU with AVX-512 VNNI");
  if (bits == 4 && group != 32 && group != 64 && group != 128)
    return ffi::Error::InvalidArgument("quantized_matvec: int4 groups are 32, 64 or 128 inputs");
  const int64_t K = x_dims.back();
  if (K % group) return ffi::Error::InvalidArgument("quantized_matvec: the group must divide K");
  const int64_t rows = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  const int64_t index = layer.typed_data()[0], row_bytes = K * bits / 8, groups = K / group;
  std::vector<Weights> weights;
  int64_t chunks = 0;
  for (size_t j = 0; j < outs.size(); ++j) {
    auto packed = stacks.get<ffi::AnyBuffer>(per_stack * j);
    auto scales = stacks.get<ffi::AnyBuffer>(per_stack * j + 1);
    auto y = outs.get<ffi::Buffer<ffi::F32>>(j);
    if (!packed.has_value() || !scales.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("quantized_matvec: inputs and outputs must be arrays, outputs float32");
    auto p = packed->dimensions(), s = scales->dimensions();
    const auto integer = packed->element_type();
    if (integer != (bits == 8 && !tiled ? ffi::DataType::S8 : ffi::DataType::U8))
      return ffi::Error::InvalidArgument(
          "quantized_matvec: int8 weights are s8 (u8 q + 128 when tiled), int4 weights packed in u8");
    if (scales->element_type() != ffi::DataType::F16 && scales->element_type() != ffi::DataType::BF16)
      return ffi::Error::InvalidArgument("quantized_matvec: scales must be float16 or bfloat16");
    if (tiled ? s.size() != 4 || s[2] != groups || s[3] != 16 : s.size() != 3 || s[2] != groups)
      return ffi::Error::InvalidArgument(tiled ? "quantized_matvec: want tiled scales [layers, N / 16, K / group, 16]"
                                               : "quantized_matvec: want scales [layers, N, K / group]");
    if (tiled ? p.size() != 4 || p[0] != s[0] || p[1] != s[1] || p[2] * kBlock != K || p[3] != 16 * kBlock
              : p.size() != 3 || p[2] != row_bytes || s[0] != p[0] || s[1] != p[1])
      return ffi::Error::InvalidArgument(tiled ? "quantized_matvec: want tiles [layers, N / 16, K / 32, 512]"
                                               : "quantized_matvec: want [layers, N, K * bits / 8]");
    if (index < 0 || index >= p[0]) return ffi::Error::InvalidArgument("quantized_matvec: layer index out of range");
    const int64_t N = tiled ? s[1] * 16 : s[1], chunk = chunk_rows(N, K, rows);
    const uint16_t* biases = nullptr;
    if (affine) {
      auto b = stacks.get<ffi::AnyBuffer>(per_stack * j + 2);
      if (!b.has_value() || b->element_type() != scales->element_type() || b->dimensions().size() != 3 ||
          b->dimensions()[0] != s[0] || b->dimensions()[1] != s[1] || b->dimensions()[2] != s[2])
        return ffi::Error::InvalidArgument("quantized_matvec: biases must have the scales' shape and dtype");
      biases = static_cast<const uint16_t*>(b->untyped_data()) + index * N * groups;
    }
    weights.push_back({static_cast<const uint8_t*>(packed->untyped_data()) + index * N * row_bytes,
                       static_cast<const uint16_t*>(scales->untyped_data()) + index * N * groups, biases,
                       scales->element_type() == ffi::DataType::F16, tiled != 0, (*y)->typed_data(), N, chunks,
                       chunk});
    chunks += (N + chunk - 1) / chunk;
  }
  const float* xs = x.typed_data();
  std::unique_ptr<QuantizedActivations> quantized;
  if (int8_activations)
    quantized = std::make_unique<QuantizedActivations>(xs, rows, K, group, bits == 8 ? 128 : affine ? 1 : 8);
  const std::vector<float> x_sums = group_sums(xs, rows, K, group, affine && !int8_activations);
  auto product = [&](int64_t c) {
    size_t j = weights.size() - 1;
    while (weights[j].first_chunk > c) --j;
    const Weights& w = weights[j];
    const int64_t n0 = (c - w.first_chunk) * w.chunk, n1 = n0 + w.chunk < w.N ? n0 + w.chunk : w.N;
    if (w.tiled && kStreamTiles && rows <= kStreamedRows)
      streamed_chunk(w, *quantized, n0, n1, group);
    else if (quantized)
      rows_int(w, *quantized, n0, n1, bits, group);
    else
      rows_any(w, xs, x_sums.empty() ? nullptr : x_sums.data(), rows, n0, n1, K, bits, group);
  };
  // A decode's products (a few activation rows, tens of microseconds to a few ms)
  // go to this library's spinning helpers. A prompt's run for milliseconds, and
  // there the helpers lost the second core to XLA's own idle worker at random:
  // on a 2-core AMD EPYC, in a Qwen3-0.6B int8 512-token prefill, a third of the
  // gate/up products took 8-12 ms instead of 6, and run on XLA's threads every one
  // took 6 (the products 594 -> 453 ms a prompt). Decode steps were no faster there.
  if (rows > 8)
    eqx_models::parallel_for_on(xla_pool, chunks, product);
  else
    eqx_models::parallel_for(chunks, product);
  return ffi::Error::Success();
}

}  // namespace

// Whether this CPU runs the tiles (AVX-512 VNNI): then many activation rows, a
// prompt's, are also faster here than through a dequantized float matmul.
extern "C" int EqxQuantizedTiles() { return kHasVnni ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxQuantizedMatvec, QuantizedMatvec,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("group")
                                  .Attr<int32_t>("int8_activations")
                                  .Attr<int32_t>("affine")
                                  .Attr<int32_t>("tiled")
                                  .Ctx<ffi::ThreadPool>());
