#pragma once

/// \file tensor_identity.h
/// The tensors a captured graph reads and writes in place without owning
/// them (a module's parameters and buffers, a training step's state), as they
/// were at capture, so that each call can tell whether they still are.

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace graphed {

/// Note [Tensors a graph reads in place]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// A graph's kernels hold the addresses its module's parameters and buffers
/// had at capture. Python can move those tensors without graphed noticing:
/// `module.double()`, `.half()`, `.to(...)` and `param.data = t` keep the
/// tensor object but give it new storage, and the old storage is freed, so a
/// replay would read freed memory (wrong values, or an illegal address once
/// the allocator hands the memory on or returns it to the driver);
/// `module.weight = nn.Parameter(t)` replaces the object, and a replay would
/// keep computing with, and training, the old weights. So a graph records,
/// at capture, each such tensor's TensorImpl, data address (storage plus
/// offset), dtype and sizes, and each call compares them before replaying: a
/// handful of loads per tensor, no device work. A difference raises with the
/// fix (capture again) instead of replaying. Values changed in place
/// (`param.data.copy_(...)`, `load_state_dict`, an optimizer step) keep the
/// address and are what graphs are for.
class TensorIdentities {
 public:
  /// Records nothing; every comparison with an empty list succeeds.
  TensorIdentities() = default;
  /// Records `tensors` as they are now (undefined tensors too).
  explicit TensorIdentities(const std::vector<at::Tensor>& tensors);

  /// Empty when `now` holds the recorded tensors, in order, with the data
  /// address, dtype and sizes they had; else one sentence on the first
  /// difference, e.g. "tensor 2 ((8,) float32 cuda:0 at capture) now is
  /// (8,) float64 cuda:0 at another address", or "there are 3 tensors now,
  /// 2 at capture". `noun` replaces "tensor" in the sentence.
  std::string first_difference(const std::vector<at::Tensor>& now,
                               const std::string& noun = "tensor") const;

  /// Number of tensors recorded.
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    const c10::TensorImpl* impl = nullptr;
    const void* data = nullptr;
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    std::vector<int64_t> sizes;
    std::string description;
  };
  static Entry entry_of(const at::Tensor& tensor);
  std::vector<Entry> entries_;
};

}  // namespace graphed
