// Writes new key/value slots into a KV cache buffer in place, as an XLA FFI call.
//
// buffer: [layers, batch, kv_heads, kv_seq, head_dim], update: [layers, batch,
// kv_heads, new, head_dim] of the same dtype, written at slot `start`; with `wrap`
// (a ring buffer, for sliding-window layers) slots past the end continue at slot 0.
// The result aliases `buffer`. XLA:CPU widens a bfloat16 `dynamic-update-slice` to float32
// and so rewrites the whole cache every step; this copies only the new bytes.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteSlots(ffi::AnyBuffer buffer, ffi::AnyBuffer update, ffi::Buffer<ffi::S32> start,
                      ffi::Result<ffi::AnyBuffer> out, int32_t wrap) {
  auto b_dims = buffer.dimensions();
  auto u_dims = update.dimensions();
  if (b_dims.size() != 5 || u_dims.size() != 5 || buffer.element_type() != update.element_type())
    return ffi::Error::InvalidArgument("write_slots: want two 5-d arrays of one dtype");
  for (int i : {0, 1, 2, 4})
    if (b_dims[i] != u_dims[i]) return ffi::Error::InvalidArgument("write_slots: shapes disagree");
  const int64_t rows = b_dims[0] * b_dims[1] * b_dims[2], slots = b_dims[3], width = b_dims[4];
  const int64_t count = u_dims[3], first = start.typed_data()[0];
  if (first < 0 || count > slots || (first + count > slots && !wrap) || (wrap && first >= slots))
    return ffi::Error::InvalidArgument("write_slots: the new slots do not fit in the cache");
  const int64_t item = static_cast<int64_t>(ffi::ByteWidth(buffer.element_type()));
  char* dst = static_cast<char*>(out->untyped_data());
  const char* src = static_cast<const char*>(update.untyped_data());
  if (dst != buffer.untyped_data())  // XLA did not alias (the buffer is still used): copy it first
    std::memcpy(dst, buffer.untyped_data(), buffer.size_bytes());
  const int64_t row_bytes = count * width * item;
  const int64_t before_end = (first + count <= slots ? count : slots - first) * width * item;
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + (r * slots + first) * width * item, src + r * row_bytes, before_end);
    if (before_end < row_bytes)  // the rest wraps around to slot 0
      std::memcpy(dst + r * slots * width * item, src + r * row_bytes + before_end, row_bytes - before_end);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxWriteSlots, WriteSlots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("wrap"));
