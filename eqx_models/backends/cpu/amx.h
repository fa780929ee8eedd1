// bfloat16 products for prompts on Intel AMX tiles:
//
// y[m, n] = sum_k x[m, k] * w[n, k]   for many activation rows m,
//
// with w a layer's `[N, K]` bfloat16 rows read where they lie and x's values
// bfloat16 themselves (a bfloat16 model's activations), summed in float32.
//
// `TDPBF16PS C, A, B` adds A (16 rows of 32 bfloat16) times B (16 rows of 16
// bfloat16 pairs) into C (16 x 16 float32 sums). A is 16 weight rows as they
// lie, so the weights need no repacking; B is 16 activation rows, repacked once
// per call so that row r of a B tile holds, for each of its 16 activation rows
// m, the pair x[m, 2r], x[m, 2r + 1]. C is then y transposed (n by m), turned
// back on the way out. Two weight tiles meet two activation tiles in four sum
// tiles, and a chunk of weight rows that stays in L2 meets each block of 32
// activation rows in turn, so the weights come from memory once per call.
//
// The instruction takes subnormal inputs as zero, like `vdpbf16ps`. Linux hands
// out the tile registers only to a process that asks (`arch_prctl`), once.

#ifndef EQX_MODELS_KERNELS_AMX_H_
#define EQX_MODELS_KERNELS_AMX_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>

// EQX_MODELS_NO_AMX: set by the build when a compiler or assembler without AMX
// failed on this file (the rest of the kernels still build).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(EQX_MODELS_NO_AMX) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define EQX_MODELS_HAVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace eqx_models::amx {

constexpr int64_t kRows = 16;       // rows of a tile
constexpr int64_t kBlock = 32;      // bfloat16 along k per tile row (64 bytes)
constexpr int64_t kPairs = kBlock / 2;

// The activations (bfloat16 bits) in the B tiles' order: for each block of 16
// rows and each block of 32 inputs, 16 lines of 16 pairs (1 KiB). Rows are padded
// with zeros to a multiple of 32 (two B tiles).
class PackedRows {
 public:
  PackedRows(const uint16_t* x, int64_t rows, int64_t K)
      : rows_(rows), padded_((rows + 2 * kRows - 1) / (2 * kRows) * (2 * kRows)), k_blocks_(K / kBlock),
        data_(static_cast<uint16_t*>(std::aligned_alloc(64, padded_ * K * 2 > 0 ? padded_ * K * 2 : 64))) {
    if (data_ == nullptr) return;
    for (int64_t m16 = 0; m16 < padded_ / kRows; ++m16)
      for (int64_t kb = 0; kb < k_blocks_; ++kb) {
        uint32_t* lines = reinterpret_cast<uint32_t*>(block(m16, kb));  // [pair r][row i]
        for (int64_t i = 0; i < kRows; ++i) {
          const int64_t m = m16 * kRows + i;
          for (int64_t r = 0; r < kPairs; ++r) {
            uint32_t pair = 0;
            if (m < rows) std::memcpy(&pair, x + m * K + kb * kBlock + 2 * r, sizeof(pair));
            lines[r * kRows + i] = pair;
          }
        }
      }
  }
  ~PackedRows() { std::free(data_); }
  PackedRows(const PackedRows&) = delete;
  PackedRows& operator=(const PackedRows&) = delete;

  uint16_t* block(int64_t m16, int64_t kb) const { return data_ + (m16 * k_blocks_ + kb) * kRows * kBlock; }
  int64_t rows() const { return rows_; }
  int64_t padded_rows() const { return padded_; }
  bool allocated() const { return data_ != nullptr; }

 private:
  int64_t rows_, padded_, k_blocks_;
  uint16_t* data_;
};

#if defined(EQX_MODELS_HAVE_AMX)
#define AMX_BF16 __attribute__((target("amx-tile,amx-bf16,avx512f")))

// Palette 1, eight tiles of 16 rows x 64 bytes: sums 0-3, weights 4-5, activations 6-7.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Whether the CPU has AMX with bfloat16 (and AVX-512 for the stores).
// EQX_MODELS_AMX=0 (or EQX_MODELS_KERNELS_PORTABLE) says no.
inline bool cpu_has_tiles() {
  if (std::getenv("EQX_MODELS_KERNELS_PORTABLE") != nullptr) return false;
  if (const char* flag = std::getenv("EQX_MODELS_AMX"); flag != nullptr && std::strcmp(flag, "0") == 0) return false;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1u, amx_tile = (edx >> 24) & 1u;
  return amx_bf16 && amx_tile && __builtin_cpu_supports("avx512f");
}

// Whether this process may use the tiles: Linux grants them on request, once per
// process (all threads). Asked on first use, not when the library loads: the
// granted state enlarges every signal frame, and Linux then refuses alternate
// signal stacks smaller than that.
inline bool available() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return cpu_has_tiles() && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// A sum tile (16 weight rows n by 16 activation rows m) into y[m, n], rows m
// beyond the activations dropped: transposed in registers (unpacks within 128-bit
// lanes, then lanes gathered; 16 gathers from the tile instead cost a third of a
// [512, 1024] x [1024, 6144] product).
AMX_BF16 inline void store_transposed(const float (&sums)[kRows][kRows], float* y, int64_t m0, int64_t rows,
                                      int64_t n, int64_t N) {
  __m512 r[16], t[16], u[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(sums[i]);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4g + j], 128-bit lane L: rows 4g..4g+3 of column 4L + j.
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
    u[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
    u[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    u[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 even = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), odd = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
    const __m512 even2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88),
                 odd2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
    const __m512 columns[4] = {_mm512_shuffle_f32x4(even, even2, 0x88), _mm512_shuffle_f32x4(odd, odd2, 0x88),
                               _mm512_shuffle_f32x4(even, even2, 0xDD), _mm512_shuffle_f32x4(odd, odd2, 0xDD)};
    for (int lane = 0; lane < 4; ++lane) {
      const int64_t m = m0 + 4 * lane + j;
      if (m < rows) _mm512_storeu_ps(y + m * N + n, columns[lane]);
    }
  }
}

// Weight rows [n, n + 16 * Tiles) of `w` (Tiles 1 or 2) against activation rows
// [m0, m0 + 32): sum tiles 0-1 for the first 16 weight rows, 2-3 for the next.
template <int Tiles>
AMX_BF16 inline void block(const uint16_t* w, int64_t K, const PackedRows& x, int64_t n, int64_t m0, float* y,
                           int64_t N) {
  const int64_t stride = K * 2, k_blocks = K / kBlock;
  const uint16_t* w0 = w + n * K;
  const uint16_t* w1 = w0 + kRows * K;
  const uint16_t* x0 = x.block(m0 / kRows, 0);
  const uint16_t* x1 = x.block(m0 / kRows + 1, 0);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Tiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    _tile_loadd(4, w0 + kb * kBlock, stride);
    _tile_loadd(6, x0 + kb * kRows * kBlock, 64);
    _tile_loadd(7, x1 + kb * kRows * kBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Tiles == 2) {
      _tile_loadd(5, w1 + kb * kBlock, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[kRows][kRows];
  _tile_stored(0, sums, 64);
  store_transposed(sums, y, m0, x.rows(), n, N);
  _tile_stored(1, sums, 64);
  store_transposed(sums, y, m0 + kRows, x.rows(), n, N);
  if constexpr (Tiles == 2) {
    _tile_stored(2, sums, 64);
    store_transposed(sums, y, m0, x.rows(), n + kRows, N);
    _tile_stored(3, sums, 64);
    store_transposed(sums, y, m0 + kRows, x.rows(), n + kRows, N);
  }
}

// y[:, n0:n1] for weight rows [n0, n1), n1 - n0 a multiple of 16 and K of 32. Each
// block of activation rows sweeps the whole chunk, which the caller keeps small
// enough to stay in L2 between sweeps.
AMX_BF16 inline void product(const PackedRows& x, const uint16_t* w, float* y, int64_t n0, int64_t n1, int64_t N,
                             int64_t K) {
  static const TileConfig config;
  _tile_loadconfig(&config);
  for (int64_t m0 = 0; m0 < x.padded_rows(); m0 += 2 * kRows) {
    int64_t n = n0;
    for (; n + 2 * kRows <= n1; n += 2 * kRows) block<2>(w, K, x, n, m0, y, N);
    if (n < n1) block<1>(w, K, x, n, m0, y, N);  // 16 rows left
  }
  _tile_release();
}
#else
inline bool cpu_has_tiles() { return false; }
inline bool available() { return false; }
inline void product(const PackedRows&, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t) {}
#endif

}  // namespace eqx_models::amx

#endif  // EQX_MODELS_KERNELS_AMX_H_
