#include "graphed/tensor_identity.h"

#include "graphed/signature.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/StringUtil.h>

namespace graphed {
namespace {

// The address a kernel reads the tensor at: storage plus offset; null for
// tensors without storage.
const void* data_address(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.unsafeGetTensorImpl()->has_storage()) {
    return nullptr;
  }
  return tensor.const_data_ptr();
}

}  // namespace

TensorIdentities::Entry TensorIdentities::entry_of(const at::Tensor& tensor) {
  Entry entry;
  if (!tensor.defined()) {
    entry.description = "an undefined tensor";
    return entry;
  }
  entry.impl = tensor.unsafeGetTensorImpl();
  entry.data = data_address(tensor);
  entry.dtype = tensor.scalar_type();
  entry.sizes = tensor.sizes().vec();
  entry.description = describe_tensor(tensor);
  return entry;
}

TensorIdentities::TensorIdentities(const std::vector<at::Tensor>& tensors) {
  entries_.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) {
    entries_.push_back(entry_of(tensor));
  }
}

std::string TensorIdentities::first_difference(const std::vector<at::Tensor>& now,
                                               const std::string& noun) const {
  if (now.size() != entries_.size()) {
    return c10::str("there are ", now.size(), " ", noun, "s now, ", entries_.size(),
                    " at capture");
  }
  for (size_t i = 0; i < now.size(); ++i) {
    const Entry& entry = entries_[i];
    const at::Tensor& tensor = now[i];
    const c10::TensorImpl* impl = tensor.defined() ? tensor.unsafeGetTensorImpl() : nullptr;
    if (impl == entry.impl && (impl == nullptr ||
                               (data_address(tensor) == entry.data &&
                                tensor.scalar_type() == entry.dtype &&
                                tensor.sizes().equals(entry.sizes)))) {
      continue;
    }
    const std::string found = tensor.defined() ? describe_tensor(tensor) : "an undefined tensor";
    if (impl != entry.impl) {
      return c10::str(noun, " ", i, " (", entry.description, " at capture) was replaced by ",
                      "another tensor, ", found);
    }
    return c10::str(noun, " ", i, " (", entry.description, " at capture) now is ", found,
                    data_address(tensor) == entry.data ? "" : " at another address");
  }
  return std::string();
}

}  // namespace graphed
