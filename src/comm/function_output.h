#pragma once
/// \file The output of a custom autograd Function (comm/ primitives and the
/// ops/ Functions), made safe for in-place ops: Note [function outputs are not views].
#include <ATen/ATen.h>

#include <initializer_list>

namespace shardtensor::comm {

/// Note [function outputs are not views]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// libtorch (1.13 and 2.13, torch/csrc/autograd/custom_function.cpp,
/// _wrap_outputs) marks every output of a custom Function that is a view, of
/// anything, even of a buffer made inside forward, with
/// CreationMeta::IN_CUSTOM_FUNCTION; an in-place op on that output or on any
/// view of it then raises in handle_view_on_rebase ("This view was created
/// inside a custom Function"; on 2.13 checked with a C++ Function returning
/// buf.squeeze(0): both out.mul_(2) and out.select(0, 1).copy_(v) raise).
/// Rules hand Function outputs to users: `u.select(0, i)` of a sharded dim is
/// a view of an all-gather's output, and `u.select(0, i).copy_(v)` on a
/// non-leaf `u` must work as it does in libtorch. Views arise silently inside
/// forward: `recv.movedim(0, d).contiguous()` returns the permuted view when it
/// is already contiguous (d == 0, or size-1 dims), and `out.squeeze(0)` is a
/// view. So every Function returns its output through function_output(): a
/// view of a buffer made inside forward becomes a plain tensor over the same
/// memory (no copy; autograd's view tracking is what is dropped, and nothing
/// outside forward can see the buffer); a view that shares memory with one of
/// the Function's `inputs` is cloned instead (an in-place op on the output
/// must not change an input behind autograd's back). Functions that return an
/// input itself on purpose (identities such as use_replicated) keep doing so:
/// autograd then treats the output as a view of the input, as libtorch does.
/// Local; never throws for a defined tensor.
inline at::Tensor function_output(const at::Tensor& out,
                                  std::initializer_list<at::Tensor> inputs = {}) {
  if (!out.defined() || !out.is_view()) return out;
  for (const at::Tensor& in : inputs) {
    if (in.defined() && in.has_storage() && out.is_alias_of(in)) {
      return out.clone(at::MemoryFormat::Preserve);
    }
  }
  at::Tensor t = at::empty({0}, out.options());
  t.set_(out.storage(), out.storage_offset(), out.sizes(), out.strides());
  return t;
}

}  // namespace shardtensor::comm
