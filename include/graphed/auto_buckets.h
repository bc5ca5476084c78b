#pragma once

/// \file auto_buckets.h
/// graphed::AutoBuckets: the buckets GraphManager picks for a module whose
/// inference calls come at many batch sizes when the user gave none, and the
/// check of the first padded call against eager that keeps them honest. See
/// Note [Buckets graphed picks itself].

#include "graphed/bucket_policy.h"
#include "graphed/call_key.h"

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace graphed {

/// Note [Buckets graphed picks itself]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Without buckets every new input signature of a module gets a graph of its
/// own: a model served at batch sizes 1..64 keeps 64 graphs per layer (0.4 to
/// 2.6 GB on the zoo's models). So when a module's inference calls that need
/// a new graph have come at `after` (4) different sizes of dimension 0 and
/// are otherwise alike (same structure, dtypes, other sizes and constants;
/// tensors of size 1 there count as broadcast, Note [Bucket padding]), the
/// manager pads that module's inference calls to powers of two along
/// dimension 0 from then on (1, 2, 4, ..., 65536; larger calls fall back),
/// drops its graphs of other sizes, and says so in stats()["notes"]: memory
/// stays at about log2(largest batch) graphs per module.
///
/// Padding is exact only when rows along dimension 0 do not influence each
/// other (a batch), which graphed cannot see from the module. So the first
/// call that is actually padded also runs eagerly, and its outputs are
/// compared twice: as replayed, and replayed again with the padding rows
/// repeating the call's rows (zero rows alone leave some reductions over the
/// rows unchanged, e.g. a mean of inputs whose mean is zero). Every output
/// tensor is compared relative to its largest magnitude: at most
/// 1e-3 for 32- and 64-bit floats, 2e-2 for 16-bit ones, equal for others).
/// When they disagree (dimension 0 is not a batch: a sequence, a reduced
/// dimension) the module goes back to one graph per size for good, that
/// call returns the eager result, and the note says why. Training calls are
/// never padded (padded rows would get gradients). Explicit buckets= turn
/// all of this off; so does GraphManagerOptions::pick_buckets = false.
class AutoBuckets {
 public:
  /// Picks buckets once calls differing only along dimension 0 came at
  /// `after` sizes (>= 2).
  explicit AutoBuckets(int64_t after = 4);

  /// The policy picked buckets follow: powers of two along dimension 0, up
  /// to 65536.
  static BucketPolicy policy();

  /// Records an inference call that needs a new graph. True when it makes
  /// `after` sizes of dimension 0 for calls alike in everything else: time
  /// to pick buckets. Calls the policy cannot plan (tensors disagreeing
  /// along dimension 0) are not counted.
  bool observe(const std::vector<c10::IValue>& inputs);

 private:
  int64_t after_;
  // Calls alike but for dimension 0 (their keys with it erased), and the
  // sizes they came at; a few entries, searched in order.
  std::vector<std::pair<CallKey, std::set<int64_t>>> seen_;
};

/// How a padded replay's outputs compare with eager outputs of the same call.
struct OutputAgreement {
  /// Same structure, and every tensor within its tolerance (Note [Buckets
  /// graphed picks itself]).
  bool agrees = true;
  /// The largest difference found, relative to the eager tensor's largest
  /// magnitude.
  double max_relative_diff = 0.0;
  /// Where they first disagree ("output[1]: shapes (4, 8) and (3, 8)", or
  /// "output[0]: relative difference 0.5 above 0.001"); empty when they agree.
  std::string disagreement;
};

/// Compares `replayed` with `eager` (nested tuples, lists and dicts of
/// tensors and constants).
OutputAgreement compare_outputs(const c10::IValue& replayed, const c10::IValue& eager);

}  // namespace graphed
