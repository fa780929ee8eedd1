// Writes new key/value slots into a KV cache buffer in place, as an XLA FFI call.
//
// buffer: [layers, batch, kv_heads, kv_seq, head_dim], update: [layers, batch,
// kv_heads, new, head_dim] of the same dtype, written at slot `start`; with `wrap`
// (a ring buffer, for sliding-window layers) slots past the end continue at slot 0.
// The result aliases `buffer`. XLA:CPU widens a bfloat16 `dynamic-update-slice` to float32
// and so rewrites the whole cache every step; this copies only the new bytes.
//
// `write_pages` is the same for a paged pool [layers, pages, kv_heads, page_size,
// head_dim]: token t of row b goes to slot `slots[b, t]` (page * page_size + offset),
// or nowhere where that is -1 (padding). Both take 4-d arrays without the last
// axis too (an int8 cache's per-slot scales), one item per slot.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteSlots(ffi::AnyBuffer buffer, ffi::AnyBuffer update, ffi::Buffer<ffi::S32> start,
                      ffi::Result<ffi::AnyBuffer> out, int32_t wrap) {
  auto b_dims = buffer.dimensions();
  auto u_dims = update.dimensions();
  const size_t rank = b_dims.size();
  if ((rank != 4 && rank != 5) || u_dims.size() != rank || buffer.element_type() != update.element_type())
    return ffi::Error::InvalidArgument("write_slots: want two 4-d or 5-d arrays of one dtype");
  for (size_t i = 0; i < rank; ++i)
    if (i != 3 && b_dims[i] != u_dims[i]) return ffi::Error::InvalidArgument("write_slots: shapes disagree");
  const int64_t rows = b_dims[0] * b_dims[1] * b_dims[2], slots = b_dims[3], width = rank == 5 ? b_dims[4] : 1;
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

ffi::Error WritePages(ffi::AnyBuffer buffer, ffi::AnyBuffer update, ffi::Buffer<ffi::S32> slots,
                      ffi::Result<ffi::AnyBuffer> out) {
  auto b_dims = buffer.dimensions();
  auto u_dims = update.dimensions();
  auto s_dims = slots.dimensions();
  const size_t rank = b_dims.size();
  if ((rank != 4 && rank != 5) || u_dims.size() != rank || buffer.element_type() != update.element_type())
    return ffi::Error::InvalidArgument("write_pages: want two 4-d or 5-d arrays of one dtype");
  if (b_dims[0] != u_dims[0] || b_dims[2] != u_dims[2] || (rank == 5 && b_dims[4] != u_dims[4]) ||
      s_dims.size() != 2 || s_dims[0] != u_dims[1] || s_dims[1] != u_dims[3])
    return ffi::Error::InvalidArgument("write_pages: shapes disagree");
  const int64_t layers = b_dims[0], pages = b_dims[1], heads = b_dims[2], page_size = b_dims[3];
  const int64_t rows = u_dims[1], count = u_dims[3];
  const int64_t item = static_cast<int64_t>(ffi::ByteWidth(buffer.element_type()));
  const int64_t width = (rank == 5 ? b_dims[4] : 1) * item;  // bytes per slot and head
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < rows * count; ++i)
    if (slot[i] < -1 || slot[i] >= pages * page_size)
      return ffi::Error::InvalidArgument("write_pages: a slot is outside the page pool");
  char* dst = static_cast<char*>(out->untyped_data());
  const char* src = static_cast<const char*>(update.untyped_data());
  if (dst != buffer.untyped_data()) std::memcpy(dst, buffer.untyped_data(), buffer.size_bytes());
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < count; ++t) {
          const int64_t target = slot[b * count + t];
          if (target < 0) continue;
          const int64_t page = target / page_size, offset = target % page_size;
          std::memcpy(dst + (((l * pages + page) * heads + h) * page_size + offset) * width,
                      src + (((l * rows + b) * heads + h) * count + t) * width, width);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxWritePages, WritePages,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
