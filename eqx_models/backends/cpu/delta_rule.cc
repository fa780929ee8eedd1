// One token of the gated delta rule per row, updating a pool of recurrent states in
// place, as an XLA FFI call (Gated DeltaNet decode).
//
// pool: [layers, slots, members, heads, key_dim, value_dim] float32; row b's state
// for (layer, member) is pool[layer, slots[b], member]. With fresh[b] the row starts
// from zeros. Per row and head, with S that key_dim x value_dim state:
//   S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q.
// The state is read twice (once for S^T k, once to update it and read the output)
// and written once, where it lies: no copy of a layer's states.
// Rows may share a slot only when they leave it unchanged (g = 0, beta = 0) or all
// start fresh with the same inputs (the padding rows of a call).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error DeltaRuleStep(ffi::Buffer<ffi::F32> pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::PRED> fresh, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> pool_out,
                         int32_t member) {
  auto p = pool.dimensions();
  auto qd = q.dimensions();
  auto vd = v.dimensions();
  if (p.size() != 6 || qd.size() != 3 || vd.size() != 3)
    return ffi::Error::InvalidArgument("delta_rule_step: want a 6-d pool and [batch, heads, dim] inputs");
  const int64_t layers = p[0], num_slots = p[1], members = p[2], heads = p[3], dk = p[4], dv = p[5];
  const int64_t batch = qd[0];
  if (qd[1] != heads || qd[2] != dk || vd[0] != batch || vd[1] != heads || vd[2] != dv ||
      slots.dimensions()[0] != batch || fresh.dimensions()[0] != batch)
    return ffi::Error::InvalidArgument("delta_rule_step: shapes disagree");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= layers || member < 0 || member >= members)
    return ffi::Error::InvalidArgument("delta_rule_step: layer or member out of range");
  const int32_t* slot = slots.typed_data();
  for (int64_t b = 0; b < batch; ++b)
    if (slot[b] < 0 || slot[b] >= num_slots) return ffi::Error::InvalidArgument("delta_rule_step: bad slot");
  float* states = pool_out->typed_data();
  if (states != pool.typed_data())  // not aliased (the pool is still used elsewhere): copy it first
    std::memcpy(states, pool.typed_data(), pool.size_bytes());
  const bool* is_fresh = fresh.typed_data();
  const float *qs = q.typed_data(), *ks = k.typed_data(), *vs = v.typed_data();
  const float *gs = g.typed_data(), *betas = beta.typed_data();
  float* outs = out->typed_data();
  eqx_models::parallel_for(batch * heads, [&](int64_t task) {
    const int64_t b = task / heads, h = task % heads;
    float* s = states + ((((l * num_slots + slot[b]) * members + member) * heads + h) * dk) * dv;
    if (is_fresh[b]) std::memset(s, 0, sizeof(float) * dk * dv);
    const float* qt = qs + task * dk;
    const float* kt = ks + task * dk;
    const float* vt = vs + task * dv;
    const float decay = std::exp(gs[task]), strength = betas[task];
    std::vector<float> delta(dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = s + i * dv;
      const float weight = kt[i];
      for (int64_t d = 0; d < dv; ++d) delta[d] += row[d] * weight;
    }
    for (int64_t d = 0; d < dv; ++d) delta[d] = (vt[d] - decay * delta[d]) * strength;
    float* o = outs + task * dv;
    for (int64_t d = 0; d < dv; ++d) o[d] = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv;
      const float key = kt[i], query = qt[i];
      for (int64_t d = 0; d < dv; ++d) {
        const float updated = decay * row[d] + key * delta[d];
        row[d] = updated;
        o[d] += updated * query;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqxDeltaRuleStep, DeltaRuleStep,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("member"));
