#include "graphed/static_io.h"

#include "graphed/check.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace graphed {

void for_each_tensor(const c10::IValue& value,
                     const std::function<void(const at::Tensor&)>& visit) {
  if (value.isTensor()) {
    visit(value.toTensor());
  } else if (value.isTuple()) {
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      for_each_tensor(element, visit);
    }
  } else if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      for_each_tensor(element, visit);
    }
  } else if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      for_each_tensor(entry.value(), visit);
    }
  }
}

c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(const at::Tensor&)>& replace) {
  if (value.isTensor()) {
    return replace(value.toTensor());
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& element : value.toTupleRef().elements()) {
      elements.push_back(map_tensors(element, replace));
    }
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (value.isList()) {
    const auto source = value.toList();
    c10::impl::GenericList list(source.elementType());
    list.reserve(source.size());
    for (const c10::IValue& element : source) {
      list.push_back(map_tensors(element, replace));
    }
    return list;
  }
  if (value.isGenericDict()) {
    const auto source = value.toGenericDict();
    c10::impl::GenericDict dict(source.keyType(), source.valueType());
    dict.reserve(source.size());
    for (const auto& entry : source) {
      dict.insert(entry.key(), map_tensors(entry.value(), replace));
    }
    return dict;
  }
  return value;
}

std::vector<at::Tensor> flatten_tensors(const c10::IValue& value) {
  std::vector<at::Tensor> tensors;
  for_each_tensor(value, [&](const at::Tensor& tensor) { tensors.push_back(tensor); });
  return tensors;
}

at::Tensor arena_front(const at::Tensor& arena, const at::Tensor& like) {
  if (!arena.defined() || !like.defined() || arena.scalar_type() != like.scalar_type() ||
      arena.device() != like.device() || !arena.is_contiguous() ||
      like.numel() > arena.numel() || like.numel() == 0 ||
      (like.unsafeGetTensorImpl()->has_storage() &&
       like.storage().data() == arena.storage().data())) {
    return at::Tensor();
  }
  return arena.view(-1).narrow(0, 0, like.numel()).view(like.sizes());
}

StaticInputs::StaticInputs(const std::vector<c10::IValue>& sample,
                           const std::vector<at::Tensor>& arenas) {
  // Buffers hold values, not autograd history, even when a sample requires grad.
  c10::NoGradGuard no_grad;
  tree_.reserve(sample.size());
  for (const c10::IValue& input : sample) {
    tree_.push_back(map_tensors(input, [&](const at::Tensor& tensor) {
      const size_t index = buffers_.size();
      at::Tensor buffer;
      // An input kept in its arena is contiguous there, whatever the sample's layout.
      if (index < arenas.size() && tensor.is_contiguous()) {
        buffer = arena_front(arenas[index], tensor);
      }
      if (!buffer.defined()) buffer = at::empty_like(tensor, at::MemoryFormat::Preserve);
      buffer.copy_(tensor);
      buffers_.push_back(buffer);
      return buffer;
    }));
  }
}

namespace {

const void* storage_address(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.unsafeGetTensorImpl()->has_storage()) {
    return nullptr;
  }
  return tensor.storage().data();
}

// Whether tensors[i] shares storage with a buffer other than its own.
bool aliases_another_buffer(const std::vector<at::Tensor>& tensors,
                            const std::vector<at::Tensor>& buffers, size_t i) {
  const void* address = storage_address(tensors[i]);
  if (address == nullptr) {
    return false;
  }
  for (size_t j = 0; j < buffers.size(); ++j) {
    if (j != i && storage_address(buffers[j]) == address) {
      return true;
    }
  }
  return false;
}

}  // namespace

bool any_cross_alias(const std::vector<at::Tensor>& tensors,
                     const std::vector<at::Tensor>& buffers) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (aliases_another_buffer(tensors, buffers, i)) {
      return true;
    }
  }
  return false;
}

size_t clone_cross_aliases(std::vector<at::Tensor>& tensors,
                           const std::vector<at::Tensor>& buffers) {
  GRAPHED_INTERNAL_ASSERT(tensors.size() == buffers.size(), "expected ", buffers.size(),
                          " input tensors, got ", tensors.size());
  // See Note [Inputs that alias other static buffers].
  size_t cloned = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (aliases_another_buffer(tensors, buffers, i)) {
      c10::NoGradGuard no_grad;
      tensors[i] = tensors[i].clone(at::MemoryFormat::Preserve);
      ++cloned;
    }
  }
  return cloned;
}

size_t StaticInputs::load(const std::vector<at::Tensor>& tensors) {
  GRAPHED_INTERNAL_ASSERT(tensors.size() == buffers_.size(), "expected ", buffers_.size(),
                          " input tensors, got ", tensors.size());
  c10::NoGradGuard no_grad;
  // Copies of the handles only when some input aliases another's buffer.
  std::vector<at::Tensor> unaliased;
  if (any_cross_alias(tensors, buffers_)) {
    unaliased = tensors;
    clone_cross_aliases(unaliased, buffers_);
  }
  const std::vector<at::Tensor>& sources = unaliased.empty() ? tensors : unaliased;
  size_t copied = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    if (!sources[i].is_same(buffers_[i])) {
      buffers_[i].copy_(sources[i], /*non_blocking=*/true);
      ++copied;
    }
  }
  return copied;
}

void StaticInputs::start_mutation_watch() {
  versions_.clear();
  for (const at::Tensor& buffer : buffers_) {
    versions_.push_back(static_cast<int64_t>(buffer._version()));
  }
}

void StaticInputs::finish_mutation_watch() {
  GRAPHED_INTERNAL_ASSERT(versions_.size() == buffers_.size(),
                          "finish_mutation_watch() without start_mutation_watch()");
  mutated_.clear();
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (static_cast<int64_t>(buffers_[i]._version()) != versions_[i]) {
      mutated_.push_back(i);
    }
  }
}

void StaticInputs::store_back(const std::vector<at::Tensor>& tensors) const {
  c10::NoGradGuard no_grad;
  for (size_t index : mutated_) {
    if (!tensors[index].is_same(buffers_[index])) {
      tensors[index].copy_(buffers_[index], /*non_blocking=*/true);
    }
  }
}

StaticOutputs::StaticOutputs(c10::IValue captured)
    : captured_(std::move(captured)), tensors_(flatten_tensors(captured_)) {}

c10::IValue StaticOutputs::materialize(bool clone) const {
  if (captured_.isTensor() && !clone) {
    return captured_;
  }
  return map_tensors(captured_, [clone](const at::Tensor& tensor) {
    return clone ? tensor.clone() : tensor;
  });
}

}  // namespace graphed
