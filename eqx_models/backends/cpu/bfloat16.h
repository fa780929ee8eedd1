// Reading float32, bfloat16 (stored as its raw 16 bits) and int8 alike as float32.

#ifndef EQX_MODELS_KERNELS_BFLOAT16_H_
#define EQX_MODELS_KERNELS_BFLOAT16_H_

#include <cstdint>
#include <cstring>

namespace eqx_models {

inline float to_float(float value) { return value; }
inline float to_float(int8_t value) { return static_cast<float>(value); }

// bfloat16 is the top half of a float32: widening is a shift, exact.
inline float to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

}  // namespace eqx_models

#endif  // EQX_MODELS_KERNELS_BFLOAT16_H_
