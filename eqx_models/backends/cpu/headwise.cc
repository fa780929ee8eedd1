// Per-head products with one layer of a stacked weight read in place, as an XLA FFI
// call: Multi-head Latent Attention's absorbed key and value expansions at decode.
//
// stack: [layers, heads * per_head, width] (a Linear's [out, in] weight whose rows
// are grouped by head), float32 or bfloat16 (raw 16 bits); x: [batch, heads, n].
// Only rows [row_start, row_start + rows) of each head's group are used, W_h below.
//   transpose = 0: out[b, h, o] = sum_i W_h[o, i] x[b, h, i]   (n = width, out n = rows)
//   transpose = 1: out[b, h, i] = sum_o x[b, h, o] W_h[o, i]   (n = rows, out n = width)
// XLA would copy the layer's slice of the stack out first (a dot of a dynamic slice
// inside the scan), every step.

#include <cstdint>
#include <vector>

#include "bfloat16.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

template <typename T>
void Headwise(const T* weights, const float* x, float* out, int64_t batch, int64_t heads, int64_t per_head,
              int64_t width, int64_t row_start, int64_t rows, bool transpose) {
  // One task per head: its rows are read once for every row of the batch.
  eqx_models::parallel_for(heads, [&](int64_t h) {
    const T* head = weights + (h * per_head + row_start) * width;
    if (!transpose) {
      for (int64_t o = 0; o < rows; ++o) {
        const T* row = head + o * width;
        for (int64_t b = 0; b < batch; ++b) {
          const float* xb = x + (b * heads + h) * width;
          float sum = 0.0f;
          for (int64_t i = 0; i < width; ++i) sum += eqx_models::to_float(row[i]) * xb[i];
          out[(b * heads + h) * rows + o] = sum;
        }
      }
      return;
    }
    for (int64_t b = 0; b < batch; ++b) {
      float* ob = out + (b * heads + h) * width;
      for (int64_t i = 0; i < width; ++i) ob[i] = 0.0f;
    }
    for (int64_t o = 0; o < rows; ++o) {
      const T* row = head + o * width;
      for (int64_t b = 0; b < batch; ++b) {
        const float scale = x[(b * heads + h) * rows + o];
        float* ob = out + (b * heads + h) * width;
        for (int64_t i = 0; i < width; ++i) ob[i] += scale * eqx_models::to_float(row[i]);
      }
    }
  });
}

ffi::Error HeadwiseMatvec(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer stack, ffi::Buffer<ffi::S32> layer,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t heads, int32_t row_start, int32_t rows,
                          int32_t transpose) {
  auto s = stack.dimensions();
  auto xd = x.dimensions();
  if (s.size() != 3 || xd.size() != 3 || xd[1] != heads || s[1] % heads)
    return ffi::Error::InvalidArgument("headwise_matvec: want a [layers, heads * per_head, width] stack");
  const int64_t per_head = s[1] / heads, width = s[2], batch = xd[0];
  if (row_start < 0 || rows < 1 || row_start + rows > per_head || xd[2] != (transpose ? rows : width))
    return ffi::Error::InvalidArgument("headwise_matvec: rows or x disagree with the stack");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= s[0]) return ffi::Error::InvalidArgument("headwise_matvec: layer out of range");
  const int64_t offset = l * s[1] * width;
  if (stack.element_type() == ffi::DataType::F32) {
    Headwise(static_cast<const float*>(stack.untyped_data()) + offset, x.typed_data(), out->typed_data(), batch,
             heads, per_head, width, row_start, rows, transpose);
  } else if (stack.element_type() == ffi::DataType::BF16) {
    Headwise(static_cast<const uint16_t*>(stack.untyped_data()) + offset, x.typed_data(), out->typed_data(), batch,
             heads, per_head, width, row_start, rows, transpose);
  } else {
    return ffi::Error::InvalidArgument("headwise_matvec: the stack must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxHeadwiseMatvec, HeadwiseMatvec,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("heads")
                                  .Attr<int32_t>("row_start")
                                  .Attr<int32_t>("rows")
                                  .Attr<int32_t>("transpose"));
