// Single-token decode attention over one layer of a stacked KV cache, as XLA FFI
// custom calls.
//
// For every batch row b and key/value head h, the G query heads of the group
// attend to the cached keys/values of layer `layer` (slots where `valid[b, s]`),
// and to this step's own key/value. The cache operands are whole stacks, read in
// place: XLA:CPU copies a layer's slice out of the stack before its own `dot`s.
// Two layouts: contiguous `[layers, batch, kv_heads, kv_seq, head_dim]`, and
// paged `[layers, pages, kv_heads, page_size, head_dim]` where row b's slot s
// lives in page `block_tables[b, s / page_size]`. Softmax and accumulation are
// float32; the cache may be float32 or bfloat16.
//
// A value is the first `Dv` channels of its row in the value operand, whose rows
// may be wider: with the key stack passed as the values, the values are a prefix
// of the keys (Multi-head Latent Attention caches one latent per token and
// attends with it as both). Each query head may have a sink: a logit in its
// softmax without a value (-inf for none).
//
// An int8 cache comes with one float32 scale per slot row (`[layers, batch,
// kv_heads, kv_seq]`, or `[layers, pages, kv_heads, page_size]`): a key is its
// integers times its scale. The integers are widened in registers and the scale
// applied once per slot (to the score, and to the value's softmax weight).
//
// Each cache dtype is its own build of this file (EQX_MODELS_CACHE_F32, _BF16 or
// _S8 defined; none: all three), a library of its own: the three together took
// about a minute to compile, and a model needs one.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "bfloat16.h"
#include "parallel_for.h"
#include "prefetch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using eqx_models::prefetch_lines;
using eqx_models::to_float;


// Sixteen float32 lanes as one value (GCC vector extension): each clone below
// compiles it to its own registers (one zmm, two ymm, four xmm).
typedef float Lanes __attribute__((vector_size(64)));
typedef float Half __attribute__((vector_size(32)));
typedef float Quarter __attribute__((vector_size(16)));
typedef uint16_t Bits16 __attribute__((vector_size(32)));
typedef uint32_t Bits32 __attribute__((vector_size(64)));

inline Lanes load_lanes(const float* from) {
  Lanes v;
  std::memcpy(&v, from, sizeof(v));
  return v;
}

// Sixteen bfloat16 values widened: each the top half of its float32.
inline Lanes load_lanes(const uint16_t* from) {
  Bits16 raw;
  std::memcpy(&raw, from, sizeof(raw));
  const Bits32 wide = __builtin_convertvector(raw, Bits32) << 16;
  Lanes v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// The lanes' total, halving: 8 + 8, 4 + 4, 2 + 2, 1 + 1.
inline float lane_total(Lanes v) {
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// Sixteen partial sums in one vector, added by halving at the end. (Sixteen scalar
// partials added one after another were a chain of dependent adds per score that
// bounded decode attention at short contexts.)
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  Lanes partial = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) partial += load_lanes(a + i) * load_lanes(b + i);
  float sum = lane_total(partial);
  for (; i < n; ++i) sum += a[i] * to_float(b[i]);
  return sum;
}

struct Problem {
  const float* q;      // [B, H, G, D]
  const void* keys;    // this layer: [B, H, S, D], or [pages, H, P, D] when paged
  const void* values;  // this layer: same layout as keys
  const int32_t* block_tables;  // [B, S / P] when paged, else null
  const bool* valid;   // [B, S]
  const bool* self_valid;  // [B]
  const float* k_new;  // [B, H, D]
  const float* v_new;  // [B, H, Dv]
  const float* sinks;  // [H, G]
  const float* key_scales;    // this layer, one per slot row (int8 caches), else null
  const float* value_scales;  // the same for the values
  float* out;          // [B, H, G, Dv]
  int64_t B, H, G, S, D, P;
  int64_t Dv, value_stride;  // value width, and the width of the value operand's rows
  float scale;
  ffi::DataType type;  // of the cache: F32, BF16 or S8

  // Row number (in units of one slot's row) of row b, head h, slot s within this layer.
  int64_t slot_row(int64_t b, int64_t h, int64_t s) const {
    if (block_tables == nullptr) return (b * H + h) * S + s;
    const int64_t page = block_tables[b * (S / P) + s / P];
    return (page * H + h) * P + s % P;
  }
};

// Sixteen partial sums, as `dot`.
__attribute__((always_inline)) inline float sum(const float* a, int64_t n) {
  float partial[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) partial[j] += a[i + j];
  float total = 0.0f;
  for (; i < n; ++i) total += a[i];
  for (int j = 0; j < 16; ++j) total += partial[j];
  return total;
}

// e^x for x <= 0, in plain float arithmetic the compiler vectorises (std::exp is a
// library call per element): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// polynomial to r^7 (within about one float32 ulp), 2^n built in the exponent bits.
// Below -87 (masked slots are -inf) the result is exactly 0.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  // Rounded to the nearest integer by adding and taking away 1.5 * 2^23.
  const float n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;
  const float r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 in two parts
  float poly = 1.0f / 5040.0f;
  poly = poly * r + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof(power));
  return x < -87.0f ? 0.0f : poly * power;
}

// An int8 row as float32 in `out`: widened once, then read by every query head of
// the group (bfloat16 widens with a shift, cheaply enough to repeat in registers).
inline const float* widened(const int8_t* row, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(row[i]);
  return out;
}

// Slots whose key (value) row is fetched ahead of the one being read. A head's
// rows are read once each, in order, with little work between them; the hardware
// prefetchers alone kept bfloat16 decode attention at about 11 GB/s (1024 slots,
// 2 cores).
constexpr int64_t kSlotsAhead = 8;

// Whether row b attends to anything: its own key or any valid slot. A row with
// nothing to attend to (a padding query) averages every slot, as the XLA path
// does: its output is ignored, but it must stay finite.
inline bool attends_to_any(const Problem& p, int64_t b) {
  bool any = p.self_valid[b];
  for (int64_t s = 0; s < p.S && !any; ++s) any = p.valid[b * p.S + s];
  return any;
}

// One (batch row, kv head): scores for all slots, softmax, weighted sum of values.
// Slots are visited in order, so keys and values stream from memory once each.
// `any`: attends_to_any(p, b).
template <typename T>
__attribute__((always_inline)) inline void attend_one(const Problem& p, int64_t b, int64_t h, bool any,
                                                      std::vector<float>& scores, std::vector<float>& row) {
  const int64_t S = p.S, D = p.D, G = p.G, Dv = p.Dv;
  const T* keys = static_cast<const T*>(p.keys);
  const T* values = static_cast<const T*>(p.values);
  const bool* valid = p.valid + b * S;
  const float* q = p.q + (b * p.H + h) * G * D;
  const float* k_new = p.k_new + (b * p.H + h) * D;
  const float* v_new = p.v_new + (b * p.H + h) * Dv;
  const float* sinks = p.sinks + h * G;
  float* out = p.out + (b * p.H + h) * G * Dv;
  row.resize(std::max(D, Dv));

  // scores[g * (S + 1) + s]; slot S is this step's own key. Masked slots stay at
  // -inf, so their weight below is exp(-inf) = 0.
  scores.assign(G * (S + 1), -INFINITY);
  thread_local std::vector<float> row_max, total;
  row_max.assign(G, -INFINITY);
  total.assign(G, 0.0f);
  for (int64_t s = 0; s <= S; ++s) {
    const bool allowed = !any || (s < S ? valid[s] : p.self_valid[b]);
    if (!allowed) continue;
    auto score = [&](const auto* key, float key_scale) {
      for (int64_t g = 0; g < G; ++g) {
        const float value = p.scale * key_scale * dot(q + g * D, key, D);
        scores[g * (S + 1) + s] = value;
        row_max[g] = std::max(row_max[g], value);
      }
    };
    if (s == S) {
      score(k_new, 1.0f);
    } else {
      if (s + kSlotsAhead < S) prefetch_lines(keys + p.slot_row(b, h, s + kSlotsAhead) * D, D * sizeof(T));
      const int64_t slot = p.slot_row(b, h, s);
      if constexpr (std::is_same_v<T, int8_t>)
        score(widened(keys + slot * D, D, row.data()), p.key_scales[slot]);
      else
        score(keys + slot * D, 1.0f);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    if (sinks[g] > row_max[g]) row_max[g] = sinks[g];
    const float top = row_max[g];
    float* sg = scores.data() + g * (S + 1);
    for (int64_t s = 0; s <= S; ++s) sg[s] = exp_nonpositive(sg[s] - top);
    total[g] = sum(sg, S + 1) + exp_nonpositive(sinks[g] - top);  // 0 without a sink (-inf)
  }
  std::fill(out, out + G * Dv, 0.0f);
  for (int64_t s = 0; s <= S; ++s) {
    bool used = false;
    for (int64_t g = 0; g < G && !used; ++g) used = scores[g * (S + 1) + s] != 0.0f;
    if (!used) continue;
    auto accumulate = [&](const auto* value, float value_scale) {
      for (int64_t g = 0; g < G; ++g) {
        const float weight = scores[g * (S + 1) + s] / total[g] * value_scale;
        float* og = out + g * Dv;
        for (int64_t d = 0; d < Dv; ++d) og[d] += weight * to_float(value[d]);
      }
    };
    if (s == S) {
      accumulate(v_new, 1.0f);
    } else {
      if (s + kSlotsAhead < S) prefetch_lines(values + p.slot_row(b, h, s + kSlotsAhead) * p.value_stride, Dv * sizeof(T));
      const int64_t slot = p.slot_row(b, h, s);
      if constexpr (std::is_same_v<T, int8_t>)
        accumulate(widened(values + slot * p.value_stride, Dv, row.data()), p.value_scales[slot]);
      else
        accumulate(values + slot * p.value_stride, 1.0f);
    }
  }
}

// Sixteen int8 values widened.
inline Lanes load_lanes(const int8_t* from) {
  typedef int8_t Bytes __attribute__((vector_size(16)));
  Bytes raw;
  std::memcpy(&raw, from, sizeof(raw));
  return __builtin_convertvector(raw, Lanes);
}

// What attend_group keeps in registers: per pass over the slots, G * W vectors of
// value sums (W vectors of 16 columns for each of the G query heads).
constexpr int kSumVectors = 16;

// attend_one for head and value widths that are whole vectors of 16, with the G
// query heads of the group taken together: each key row is loaded once for all G
// scores, and the weighted sums of the values stay in registers over all slots
// (one pass per W vectors of columns) instead of being read and written back at
// every slot. On the 2-core Xeon (bfloat16, 8 kv heads of 2 query heads, D = 128,
// a scan over 28 layers): 161 slots 34 -> 28 us a layer, 1024 slots 238 -> 173;
// inside the int8 Qwen3-0.6B decode step 43 -> 38 us.
template <typename T, int G, int W>
__attribute__((always_inline)) inline void attend_group(const Problem& p, int64_t b, int64_t h, bool any,
                                                        std::vector<float>& scores) {
  const int64_t S = p.S, D = p.D, Dv = p.Dv;
  const T* keys = static_cast<const T*>(p.keys);
  const T* values = static_cast<const T*>(p.values);
  const bool* valid = p.valid + b * S;
  const float* q = p.q + (b * p.H + h) * G * D;
  const float* sinks = p.sinks + h * G;
  float* out = p.out + (b * p.H + h) * G * Dv;
  const bool self_allowed = !any || p.self_valid[b];

  // scores[g * (S + 1) + s], slot S this step's own key; masked slots stay -inf.
  scores.assign(G * (S + 1), -INFINITY);
  float top[G], total[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY;
  auto score = [&](const auto* key, float factor, int64_t s) {
    Lanes partial[G] = {};
    for (int64_t d = 0; d < D; d += 16) {
      const Lanes k = load_lanes(key + d);
      for (int g = 0; g < G; ++g) partial[g] += load_lanes(q + g * D + d) * k;
    }
    for (int g = 0; g < G; ++g) {
      const float value = factor * lane_total(partial[g]);
      scores[g * (S + 1) + s] = value;
      top[g] = std::max(top[g], value);
    }
  };
  for (int64_t s = 0; s < S; ++s) {
    if (any && !valid[s]) continue;
    if (s + kSlotsAhead < S) prefetch_lines(keys + p.slot_row(b, h, s + kSlotsAhead) * D, D * sizeof(T));
    const int64_t slot = p.slot_row(b, h, s);
    score(keys + slot * D, std::is_same_v<T, int8_t> ? p.scale * p.key_scales[slot] : p.scale, s);
  }
  if (self_allowed) score(p.k_new + (b * p.H + h) * D, p.scale, S);

  for (int g = 0; g < G; ++g) {
    top[g] = std::max(top[g], sinks[g]);
    float* sg = scores.data() + g * (S + 1);
    for (int64_t s = 0; s <= S; ++s) sg[s] = exp_nonpositive(sg[s] - top[g]);
    total[g] = sum(sg, S + 1) + exp_nonpositive(sinks[g] - top[g]);  // 0 without a sink (-inf)
    for (int64_t s = 0; s <= S; ++s) sg[s] /= total[g];
  }

  for (int64_t c0 = 0; c0 < Dv; c0 += 16 * W) {
    Lanes sums[G][W] = {};
    auto accumulate = [&](const auto* value, float value_scale, int64_t s) {
      Lanes v[W];
      for (int c = 0; c < W; ++c) v[c] = load_lanes(value + 16 * c);
      for (int g = 0; g < G; ++g) {
        const float weight = scores[g * (S + 1) + s] * value_scale;
        for (int c = 0; c < W; ++c) sums[g][c] += weight * v[c];
      }
    };
    for (int64_t s = 0; s < S; ++s) {
      if (any && !valid[s]) continue;
      if (s + kSlotsAhead < S)
        prefetch_lines(values + p.slot_row(b, h, s + kSlotsAhead) * p.value_stride + c0, 16 * W * sizeof(T));
      const int64_t slot = p.slot_row(b, h, s);
      accumulate(values + slot * p.value_stride + c0, std::is_same_v<T, int8_t> ? p.value_scales[slot] : 1.0f, s);
    }
    if (self_allowed) accumulate(p.v_new + (b * p.H + h) * Dv + c0, 1.0f, S);
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < W; ++c) std::memcpy(out + g * Dv + c0 + 16 * c, &sums[g][c], sizeof(Lanes));
  }
}

// attend_group's widths of a pass: the most vectors of each query head's columns
// (a power of two dividing Dv / 16) that keep G * W within kSumVectors.
template <typename T, int G>
__attribute__((always_inline)) inline void attend_group_any_width(const Problem& p, int64_t b, int64_t h, bool any,
                                                                  std::vector<float>& scores) {
  const int64_t columns = p.Dv / 16;
  // Widths that would not fit stay 1, so that no such attend_group is instantiated.
  constexpr int W8 = G * 8 <= kSumVectors ? 8 : 1, W4 = G * 4 <= kSumVectors ? 4 : 1;
  constexpr int W2 = G * 2 <= kSumVectors ? 2 : 1;
  if (W8 == 8 && columns % 8 == 0) return attend_group<T, G, W8>(p, b, h, any, scores);
  if (W4 == 4 && columns % 4 == 0) return attend_group<T, G, W4>(p, b, h, any, scores);
  if (W2 == 2 && columns % 2 == 0) return attend_group<T, G, W2>(p, b, h, any, scores);
  attend_group<T, G, 1>(p, b, h, any, scores);
}

// attend_group where it applies (widths whole vectors, 1, 2, 4 or 8 query heads a
// group), else attend_one.
template <typename T>
__attribute__((always_inline)) inline void attend(const Problem& p, int64_t b, int64_t h, std::vector<float>& scores,
                                                  std::vector<float>& row) {
  const bool any = attends_to_any(p, b);
  if (p.D % 16 == 0 && p.Dv % 16 == 0) {
    switch (p.G) {
      case 1: return attend_group_any_width<T, 1>(p, b, h, any, scores);
      case 2: return attend_group_any_width<T, 2>(p, b, h, any, scores);
      case 4: return attend_group_any_width<T, 4>(p, b, h, any, scores);
      case 8: return attend_group_any_width<T, 8>(p, b, h, any, scores);
      default: break;
    }
  }
  attend_one<T>(p, b, h, any, scores, row);
}

// One clone per instruction set, chosen when the library loads.
#if defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#if !defined(EQX_MODELS_CACHE_F32) && !defined(EQX_MODELS_CACHE_BF16) && !defined(EQX_MODELS_CACHE_S8)
#define EQX_MODELS_CACHE_F32
#define EQX_MODELS_CACHE_BF16
#define EQX_MODELS_CACHE_S8
#endif
#ifdef EQX_MODELS_CACHE_F32
CLONES void attend_f32(const Problem& p, int64_t b, int64_t h, std::vector<float>& scores, std::vector<float>& row) {
  attend<float>(p, b, h, scores, row);
}
#endif
#ifdef EQX_MODELS_CACHE_BF16
CLONES void attend_bf16(const Problem& p, int64_t b, int64_t h, std::vector<float>& scores, std::vector<float>& row) {
  attend<uint16_t>(p, b, h, scores, row);
}
#endif
#ifdef EQX_MODELS_CACHE_S8
CLONES void attend_s8(const Problem& p, int64_t b, int64_t h, std::vector<float>& scores, std::vector<float>& row) {
  attend<int8_t>(p, b, h, scores, row);
}
#endif

// The attend_* of the cache's dtype, or null where this build has none.
using Attend = void (*)(const Problem&, int64_t, int64_t, std::vector<float>&, std::vector<float>&);
Attend attend_for(ffi::DataType type) {
  switch (type) {
#ifdef EQX_MODELS_CACHE_F32
    case ffi::DataType::F32: return attend_f32;
#endif
#ifdef EQX_MODELS_CACHE_BF16
    case ffi::DataType::BF16: return attend_bf16;
#endif
#ifdef EQX_MODELS_CACHE_S8
    case ffi::DataType::S8: return attend_s8;
#endif
    default: return nullptr;
  }
}

ffi::Error run(const char* name, const Problem& problem) {
  const Attend attend_row = attend_for(problem.type);
  if (attend_row == nullptr)
    return ffi::Error::InvalidArgument(std::string(name) + ": this build does not take the cache's dtype");
  eqx_models::parallel_for(problem.B * problem.H, [&](int64_t task) {
    thread_local std::vector<float> scores, row;
    attend_row(problem, task / problem.H, task % problem.H, scores, row);
  });
  return ffi::Error::Success();
}

// The layer's scales of an int8 stack (`[layers, d1, d2, d3]` beside a 5-d stack
// of those leading dimensions), or null for a float stack (whose scales are empty).
ffi::Error layer_scales(const char* name, const ffi::AnyBuffer& stack, const ffi::Buffer<ffi::F32>& scales,
                        int64_t index, const float** out) {
  *out = nullptr;
  const bool quantized = stack.element_type() == ffi::DataType::S8;
  if (!quantized) {
    if (scales.element_count() != 0)
      return ffi::Error::InvalidArgument(std::string(name) + ": only an int8 cache takes scales");
    return ffi::Error::Success();
  }
  auto dims = stack.dimensions();
  auto s_dims = scales.dimensions();
  if (s_dims.size() != 4 || s_dims[0] != dims[0] || s_dims[1] != dims[1] || s_dims[2] != dims[2] ||
      s_dims[3] != dims[3])
    return ffi::Error::InvalidArgument(std::string(name) + ": an int8 cache needs one scale per slot row");
  *out = scales.typed_data() + index * dims[1] * dims[2] * dims[3];
  return ffi::Error::Success();
}

// Checks what both layouts share; returns the layer's byte offsets into the key
// and value operands.
ffi::Error check(const char* name, ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& keys, ffi::AnyBuffer& values,
                 ffi::Buffer<ffi::S32>& layer, ffi::Buffer<ffi::F32>& v_new, ffi::Buffer<ffi::F32>& sinks,
                 ffi::Buffer<ffi::F32>& key_scales, ffi::Buffer<ffi::F32>& value_scales, int64_t B,
                 int64_t* key_offset, int64_t* value_offset, const float** layer_key_scales,
                 const float** layer_value_scales) {
  auto q_dims = q.dimensions();
  auto c_dims = keys.dimensions();
  auto v_dims = values.dimensions();
  if (q_dims.size() != 4 || c_dims.size() != 5 || v_dims.size() != 5)
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": want q [batch, kv_heads, groups, head_dim] and 5-d caches");
  const ffi::DataType type = keys.element_type();
  if (type != values.element_type() ||
      (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::S8))
    return ffi::Error::InvalidArgument(std::string(name) + ": caches must both be float32, bfloat16 or int8");
  if (q_dims[0] != B || q_dims[1] != c_dims[2] || q_dims[3] != c_dims[4])
    return ffi::Error::InvalidArgument(std::string(name) + ": query and cache shapes disagree");
  for (int i = 0; i < 4; ++i)
    if (v_dims[i] != c_dims[i]) return ffi::Error::InvalidArgument(std::string(name) + ": key and value caches disagree");
  auto n_dims = v_new.dimensions();
  if (n_dims.size() != 3 || n_dims[2] > v_dims[4])
    return ffi::Error::InvalidArgument(std::string(name) + ": the new value is wider than the value cache's rows");
  if (sinks.dimensions().size() != 2 || sinks.dimensions()[0] != q_dims[1] || sinks.dimensions()[1] != q_dims[2])
    return ffi::Error::InvalidArgument(std::string(name) + ": want sinks [kv_heads, groups]");
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= c_dims[0])
    return ffi::Error::InvalidArgument(std::string(name) + ": layer index out of range");
  const int64_t bytes = static_cast<int64_t>(ffi::ByteWidth(type));
  *key_offset = index * (c_dims[1] * c_dims[2] * c_dims[3] * c_dims[4]) * bytes;
  *value_offset = index * (v_dims[1] * v_dims[2] * v_dims[3] * v_dims[4]) * bytes;
  if (auto error = layer_scales(name, keys, key_scales, index, layer_key_scales); error.failure()) return error;
  return layer_scales(name, values, value_scales, index, layer_value_scales);
}

ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys,
                           ffi::AnyBuffer values, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::PRED> self_valid,
                           ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::F32> sinks,
                           ffi::Buffer<ffi::F32> key_scales, ffi::Buffer<ffi::F32> value_scales, float scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto c_dims = keys.dimensions();
  int64_t key_offset = 0, value_offset = 0;
  const float *layer_key_scales = nullptr, *layer_value_scales = nullptr;
  const int64_t B = c_dims.size() == 5 ? c_dims[1] : 0;
  if (auto error = check("decode_attention", q, keys, values, layer, v_new, sinks, key_scales, value_scales, B,
                         &key_offset, &value_offset, &layer_key_scales, &layer_value_scales);
      error.failure())
    return error;
  const int64_t S = c_dims[3];
  return run("decode_attention", Problem{q.typed_data(), static_cast<const char*>(keys.untyped_data()) + key_offset,
              static_cast<const char*>(values.untyped_data()) + value_offset, nullptr, valid.typed_data(),
              self_valid.typed_data(), k_new.typed_data(), v_new.typed_data(), sinks.typed_data(), layer_key_scales,
              layer_value_scales, out->typed_data(), B, c_dims[2], q.dimensions()[2], S, c_dims[4], S,
              v_new.dimensions()[2], values.dimensions()[4], scale, keys.element_type()});
}

ffi::Error PagedDecodeAttention(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::PRED> self_valid,
                                ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::F32> sinks,
                                ffi::Buffer<ffi::F32> key_scales, ffi::Buffer<ffi::F32> value_scales, float scale,
                                ffi::ResultBuffer<ffi::F32> out) {
  auto c_dims = keys.dimensions();
  auto t_dims = block_tables.dimensions();
  if (t_dims.size() != 2)
    return ffi::Error::InvalidArgument("paged_decode_attention: want block_tables [batch, pages_per_row]");
  const int64_t B = t_dims[0];
  int64_t key_offset = 0, value_offset = 0;
  const float *layer_key_scales = nullptr, *layer_value_scales = nullptr;
  if (auto error = check("paged_decode_attention", q, keys, values, layer, v_new, sinks, key_scales, value_scales, B,
                         &key_offset, &value_offset, &layer_key_scales, &layer_value_scales);
      error.failure())
    return error;
  const int64_t pages = c_dims[1], P = c_dims[3], S = t_dims[1] * P;
  const int32_t* table = block_tables.typed_data();
  for (int64_t i = 0; i < B * t_dims[1]; ++i)
    if (table[i] < 0 || table[i] >= pages)
      return ffi::Error::InvalidArgument("paged_decode_attention: a block table entry is not a page of the pool");
  if (valid.dimensions().size() != 2 || valid.dimensions()[1] != S)
    return ffi::Error::InvalidArgument("paged_decode_attention: valid must be [batch, pages_per_row * page_size]");
  return run("paged_decode_attention", Problem{q.typed_data(), static_cast<const char*>(keys.untyped_data()) + key_offset,
              static_cast<const char*>(values.untyped_data()) + value_offset, table, valid.typed_data(),
              self_valid.typed_data(), k_new.typed_data(), v_new.typed_data(), sinks.typed_data(), layer_key_scales,
              layer_value_scales, out->typed_data(), B, c_dims[2], q.dimensions()[2], S, c_dims[4], P,
              v_new.dimensions()[2], values.dimensions()[4], scale, keys.element_type()});
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxPagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
