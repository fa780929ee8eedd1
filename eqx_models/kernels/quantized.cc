// Matrix-vector products with group-quantized weights for decode, as an XLA FFI call.
//
// y_j[b, n] = sum_g scale_j[layer, n, g] * sum_{k in group g} q_j(layer, n, k) x[b, k]
//
// for a few activation rows b and one or more weight stacks j that share x. Each
// stack is the whole `[layers, N, K * bits / 8]` array of integers plus its scales
// `[layers, N, K / group]` (float16 or bfloat16) and the layer index: the layer's
// integers are read where they lie and widened in registers, so a step reads the
// quantized bytes once and writes no float copy of any weight.
//   int8: q = the signed byte.
//   int4: q = nibble - 8; byte i of a group holds element i (low nibble) and
//         element i + group / 2 (high nibble), llama.cpp's Q4_0 order.
// Sums are float32 against float32 activations: the result is the float32 product
// with the dequantized weight, up to the order of additions.

#include <cstdint>
#include <cstring>
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
  bool half;                // float16 scales (else bfloat16)
  float* out;               // [rows, N]
  int64_t N, first_chunk, chunk;

  float scale(int64_t n, int64_t g, int64_t groups) const {
    const uint16_t s = scales[n * groups + g];
    return half ? half_to_float(s) : to_float(s);
  }
};

void rows_portable(const Weights& w, const float* x, int64_t rows, int64_t n0, int64_t n1, int64_t K, int bits,
                   int64_t group) {
  const int64_t groups = K / group, row_bytes = K * bits / 8, half = group / 2;
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
            sum += static_cast<float>((q[i] & 0xF) - 8) * xb[g * group + i];
            sum += static_cast<float>((q[i] >> 4) - 8) * xb[g * group + half + i];
          }
        }
        total += w.scale(n, g, groups) * sum;
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

template <int B, int R>
AVX512 void tile_int4(const Weights& w, const float* x, int64_t n, int64_t K, int64_t group) {
  const int64_t groups = K / group, half = group / 2, row_bytes = K / 2;
  const __m512i low_nibble = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
  __m512 acc[R][B];
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
        lo[r] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(wide, low_nibble), eight));
        hi[r] = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(wide, 4), eight));
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
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) w.out[b * w.N + n + r] = _mm512_reduce_add_ps(acc[r][b]);
}

template <int B, int R8, int R4>
AVX512 void rows_fixed(const Weights& w, const float* x, int64_t n0, int64_t n1, int64_t K, int bits,
                       int64_t group) {
  int64_t n = n0;
  if (bits == 8) {
    for (; n + R8 <= n1; n += R8) tile_int8<B, R8>(w, x, n, K, group);
    for (; n < n1; ++n) tile_int8<B, 1>(w, x, n, K, group);
  } else {
    for (; n + R4 <= n1; n += R4) tile_int4<B, R4>(w, x, n, K, group);
    for (; n < n1; ++n) tile_int4<B, 1>(w, x, n, K, group);
  }
}

// Tile heights that keep the totals, partial sums and widened weights within the
// 32 vector registers.
AVX512 void rows_avx512(const Weights& w, const float* x, int64_t rows, int64_t n0, int64_t n1, int64_t K,
                        int bits, int64_t group) {
  for (int64_t b0 = 0; b0 < rows; b0 += 8) {
    const float* xs = x + b0 * K;
    Weights shifted = w;
    shifted.out = w.out + b0 * w.N;
    switch (rows - b0 < 8 ? rows - b0 : 8) {
      case 1: rows_fixed<1, 8, 6>(shifted, xs, n0, n1, K, bits, group); break;
      case 2: rows_fixed<2, 4, 4>(shifted, xs, n0, n1, K, bits, group); break;
      case 3: rows_fixed<3, 3, 2>(shifted, xs, n0, n1, K, bits, group); break;
      case 4: rows_fixed<4, 3, 2>(shifted, xs, n0, n1, K, bits, group); break;
      case 5: rows_fixed<5, 1, 1>(shifted, xs, n0, n1, K, bits, group); break;
      case 6: rows_fixed<6, 1, 1>(shifted, xs, n0, n1, K, bits, group); break;
      case 7: rows_fixed<7, 1, 1>(shifted, xs, n0, n1, K, bits, group); break;
      default: rows_fixed<8, 1, 1>(shifted, xs, n0, n1, K, bits, group); break;
    }
  }
}

const bool kHasAvx512 = std::getenv("EQX_MODELS_KERNELS_PORTABLE") == nullptr && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("f16c");
#else
const bool kHasAvx512 = false;
#endif

void rows_any(const Weights& w, const float* x, int64_t rows, int64_t n0, int64_t n1, int64_t K, int bits,
              int64_t group) {
#if defined(__x86_64__)
  if (kHasAvx512) return rows_avx512(w, x, rows, n0, n1, K, bits, group);
#endif
  rows_portable(w, x, rows, n0, n1, K, bits, group);
}

// ~1 MiB of integers per chunk, as in matvec.cc.
int64_t chunk_rows(int64_t row_bytes) {
  const int64_t rows = (1024 * 1024) / (row_bytes > 0 ? row_bytes : 1);
  return rows < 8 ? 8 : rows;
}

ffi::Error QuantizedMatvec(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs stacks,
                           ffi::RemainingRets outs, int32_t bits, int32_t group) {
  auto x_dims = x.dimensions();
  if (x_dims.size() < 1 || stacks.size() == 0 || stacks.size() != 2 * outs.size())
    return ffi::Error::InvalidArgument("quantized_matvec: want x [..., K], the layer, and (integers, scales) per output");
  if ((bits != 8 && bits != 4) || group < 32 || group % 32)
    return ffi::Error::InvalidArgument("quantized_matvec: bits must be 8 or 4 and the group a multiple of 32");
  const int64_t K = x_dims.back();
  if (K % group) return ffi::Error::InvalidArgument("quantized_matvec: the group must divide K");
  const int64_t rows = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  const int64_t index = layer.typed_data()[0], row_bytes = K * bits / 8, groups = K / group;
  std::vector<Weights> weights;
  int64_t chunks = 0;
  for (size_t j = 0; j < outs.size(); ++j) {
    auto packed = stacks.get<ffi::AnyBuffer>(2 * j);
    auto scales = stacks.get<ffi::AnyBuffer>(2 * j + 1);
    auto y = outs.get<ffi::Buffer<ffi::F32>>(j);
    if (!packed.has_value() || !scales.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("quantized_matvec: inputs and outputs must be arrays, outputs float32");
    auto p = packed->dimensions(), s = scales->dimensions();
    const auto integer = packed->element_type();
    if (integer != (bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8))
      return ffi::Error::InvalidArgument("quantized_matvec: int8 weights are s8, int4 weights packed in u8");
    if (scales->element_type() != ffi::DataType::F16 && scales->element_type() != ffi::DataType::BF16)
      return ffi::Error::InvalidArgument("quantized_matvec: scales must be float16 or bfloat16");
    if (p.size() != 3 || s.size() != 3 || p[2] != row_bytes || s[2] != groups || s[0] != p[0] || s[1] != p[1])
      return ffi::Error::InvalidArgument("quantized_matvec: want [layers, N, K * bits / 8] and [layers, N, K / group]");
    if (index < 0 || index >= p[0]) return ffi::Error::InvalidArgument("quantized_matvec: layer index out of range");
    const int64_t N = p[1], chunk = chunk_rows(row_bytes);
    weights.push_back({static_cast<const uint8_t*>(packed->untyped_data()) + index * N * row_bytes,
                       static_cast<const uint16_t*>(scales->untyped_data()) + index * N * groups,
                       scales->element_type() == ffi::DataType::F16, (*y)->typed_data(), N, chunks, chunk});
    chunks += (N + chunk - 1) / chunk;
  }
  const float* xs = x.typed_data();
  eqx_models::parallel_for(chunks, [&](int64_t c) {
    size_t j = weights.size() - 1;
    while (weights[j].first_chunk > c) --j;
    const Weights& w = weights[j];
    const int64_t n0 = (c - w.first_chunk) * w.chunk, n1 = n0 + w.chunk < w.N ? n0 + w.chunk : w.N;
    rows_any(w, xs, rows, n0, n1, K, bits, group);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxQuantizedMatvec, QuantizedMatvec,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("bits")
                                  .Attr<int32_t>("group"));
