// ATen's dtypes as the element types of graphed's elementwise decode-step
// kernels (device/float_type.h). Internal to src/.

#pragma once

#include "device/float_type.h"

#include <c10/core/ScalarType.h>

#include <optional>

namespace graphed {

/// The kernels' element type for `type`, or nullopt for dtypes they do not take.
inline std::optional<device::FloatType> float_type_of(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return device::FloatType::kFloat32;
    case at::kBFloat16:
      return device::FloatType::kBFloat16;
    case at::kHalf:
      return device::FloatType::kFloat16;
    default:
      return std::nullopt;
  }
}

}  // namespace graphed
