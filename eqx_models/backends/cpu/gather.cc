// Copies rows of an array out as raw bytes, as an XLA FFI call.
//
// table: [layers, rows, ...] (any dtype, the trailing axes one row's item), layer: a
// scalar, ids: any shape; out[i] = table[layer, ids[i]]. Ids outside [0, rows) are
// clamped, as XLA's gather clamps them.
//
// It serves the three places where XLA:CPU moved far more than the rows taken from
// a 16-bit float array: a layer of a stacked weight (`index_layer`, with the stack
// seen as one layer of `layers` rows), the embedding rows of a prompt (`take_rows`)
// and a layer's KV pages (`gather_pages`). XLA widened the whole array to float32
// for those, or, given the array's bits as 16-bit integers, hoisted a copy of the
// whole array out of the layer loop on every call.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error TakeRows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                    ffi::Result<ffi::AnyBuffer> out) {
  auto dims = table.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("take_rows: want a table of at least 2 axes");
  const int64_t layers = dims[0], rows = dims[1];
  if (rows == 0) return ffi::Error::InvalidArgument("take_rows: the table has no rows");
  int64_t item = static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  for (size_t i = 2; i < dims.size(); ++i) item *= dims[i];
  const int64_t count = static_cast<int64_t>(ids.element_count());
  if (static_cast<int64_t>(out->size_bytes()) != count * item)
    return ffi::Error::InvalidArgument("take_rows: the output does not hold one row per id");
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, layers - 1);
  const char* src = static_cast<const char*>(table.untyped_data()) + l * rows * item;
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(dst + i * item, src + std::clamp<int64_t>(id[i], 0, rows - 1) * item, item);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxTakeRows, TakeRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
