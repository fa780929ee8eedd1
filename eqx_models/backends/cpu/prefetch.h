// Software fetches ahead of a stream of reads, shared by the kernels.

#ifndef EQX_MODELS_KERNELS_PREFETCH_H_
#define EQX_MODELS_KERNELS_PREFETCH_H_

#include <cstdint>

namespace eqx_models {

// `bytes` from `from` fetched for reading, line by line: `Locality` 3 into every
// cache level (T0), 0 non-temporal (NTA). A fetch past the end of a buffer does
// not fault.
template <int Locality = 3>
inline void prefetch_lines(const void* from, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(from) + line, 0, Locality);
}

}  // namespace eqx_models

#endif  // EQX_MODELS_KERNELS_PREFETCH_H_
