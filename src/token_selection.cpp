// The decoder's token selection: prompt positions, the per-request state, and
// select_next_tokens (greedy and sampled choice, eos and min_new_tokens, the
// bookkeeping a graph advances on the device). Apart from src/decoder.cpp, whose
// Decoder captures and replays it, so that each file keeps to one job.

#include "graphed/decoder.h"

#include "graphed/check.h"

#include "device/token_selection_kernel.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <limits>

namespace graphed {
namespace {

constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();

// Hugging Face's TopKLogitsWarper: scores below the k-th largest become -inf.
at::Tensor top_k_filter(const at::Tensor& scores, int64_t top_k, int64_t min_tokens_to_keep) {
  const int64_t k = std::min(std::max(top_k, min_tokens_to_keep), scores.size(-1));
  const at::Tensor kth = std::get<0>(at::topk(scores, k)).narrow(-1, k - 1, 1);
  return scores.masked_fill(scores < kth, kMinusInfinity);
}

// Hugging Face's TopPLogitsWarper, operation for operation.
at::Tensor top_p_filter(const at::Tensor& scores, double top_p, int64_t min_tokens_to_keep) {
  const auto [sorted, indices] = at::sort(scores, /*dim=*/-1, /*descending=*/false);
  const at::Tensor cumulative = sorted.softmax(-1).cumsum(-1);
  at::Tensor remove_sorted = cumulative <= (1.0 - top_p);
  const int64_t vocab = scores.size(-1);
  const int64_t keep = std::min(min_tokens_to_keep, vocab);
  remove_sorted.narrow(-1, vocab - keep, keep).fill_(false);
  const at::Tensor remove = remove_sorted.scatter(1, indices, remove_sorted);
  return scores.masked_fill(remove, kMinusInfinity);
}

std::optional<device::ScoreType> fused_score_type(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return device::ScoreType::kFloat32;
    case at::kBFloat16:
      return device::ScoreType::kBFloat16;
    case at::kHalf:
      return device::ScoreType::kFloat16;
    default:
      return std::nullopt;
  }
}

// Whether the fused kernel (Note [One kernel picks the tokens]) can take
// these scores and this state: CUDA tensors of the layouts it indexes.
bool fused_selection_applies(const at::Tensor& scores, const DecodeState& state,
                             const at::Tensor& eos) {
  const auto contiguous_rows = [](const at::Tensor& t) { return t.dim() < 2 || t.stride(-1) == 1; };
  const int64_t rows = scores.size(0);
  return scores.is_cuda() && fused_score_type(scores.scalar_type()) && scores.stride(-1) == 1 &&
         rows <= device::kMaxSelectionRows && scores.size(1) <= device::kMaxSelectionVocab &&
         state.arrivals.defined() && state.arrivals.is_cuda() &&
         state.arrivals.numel() >= 1 + rows && state.partials.defined() &&
         state.partials.numel() >= rows * device::kMaxSelectionChunks * 2 &&
         state.tokens.stride(1) == 1 &&
         contiguous_rows(state.next) && state.counters.is_contiguous() &&
         state.finished.is_contiguous() &&
         (!state.eos_threshold.defined() || state.eos_threshold.is_contiguous()) &&
         (!eos.defined() || eos.is_contiguous());
}

void fused_greedy_step(const at::Tensor& scores, DecodeState& state, const at::Tensor& eos,
                       bool suppress_eos, std::optional<int64_t> pad_token_id) {
  device::GreedyStep step;
  step.scores = scores.data_ptr();
  step.score_type = *fused_score_type(scores.scalar_type());
  step.batch = scores.size(0);
  step.vocab = scores.size(1);
  step.score_row_stride = scores.stride(0);
  if (suppress_eos) {
    step.eos_threshold = state.eos_threshold.data_ptr<int64_t>();
  }
  if (eos.defined() && eos.numel() > 0) {
    step.eos = eos.data_ptr<int64_t>();
    step.eos_count = eos.numel();
    step.finished = state.finished.data_ptr<bool>();
    step.done = state.done.data_ptr<bool>();
  }
  step.has_pad_token = pad_token_id.has_value();
  step.pad_token_id = pad_token_id.value_or(0);
  step.next = state.next.data_ptr<int64_t>();
  step.next_row_stride = state.next.stride(0);
  step.tokens = state.tokens.data_ptr<int64_t>();
  step.tokens_row_stride = state.tokens.stride(0);
  step.tokens_capacity = state.tokens.size(1);
  step.counters = state.counters.data_ptr<int64_t>();
  step.counter_count = state.counters.numel();
  step.arrivals = reinterpret_cast<unsigned int*>(state.arrivals.data_ptr<int32_t>());
  step.partials = state.partials.data_ptr<int32_t>();
  GRAPHED_CHECK_CUDA(device::launch_greedy_step(
      step, c10::cuda::getCurrentCUDAStream(scores.device().index()).stream()));
}

}  // namespace

at::Tensor prompt_positions(const at::Tensor& attention_mask) {
  GRAPHED_CHECK(attention_mask.dim() == 2, "Expected an attention mask [batch, prompt_len], got ",
                attention_mask.dim(), " dimensions ", attention_mask.sizes(), ".");
  const at::Tensor mask = attention_mask.to(at::kLong);
  return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0);
}

DecodeState make_decode_state(int64_t batch, int64_t capacity, c10::Device device,
                              int64_t extra_counters) {
  GRAPHED_CHECK(extra_counters >= 0, "Expected extra_counters >= 0, got ", extra_counters, ".");
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  const auto bools = at::TensorOptions().dtype(at::kBool).device(device);
  DecodeState state;
  state.finished = at::zeros({batch}, bools);
  state.tokens = at::zeros({batch, capacity}, longs);
  state.next = at::zeros({batch, 1}, longs);
  state.counters = at::zeros({2 + extra_counters}, longs);
  state.step = state.counters.narrow(0, 0, 1);
  state.generated = state.counters.narrow(0, 1, 1);
  state.done = at::zeros({1}, bools);
  if (device.is_cuda()) {
    const auto ints = at::TensorOptions().dtype(at::kInt).device(device);
    state.arrivals = at::zeros({1 + batch}, ints);
    state.partials = at::empty({batch * device::kMaxSelectionChunks * 2}, ints);
  }
  return state;
}

void suppress_eos_until(DecodeState& state, const at::Tensor& eos, int64_t vocab,
                        int64_t min_new_tokens) {
  if (!eos.defined() || eos.numel() == 0) {
    return;
  }
  GRAPHED_CHECK(vocab >= 1 && min_new_tokens >= 0, "Expected vocab >= 1 and min_new_tokens >= 0, "
                "got vocab ", vocab, " and min_new_tokens ", min_new_tokens, ".");
  if (!state.eos_threshold.defined() || state.eos_threshold.numel() != vocab) {
    state.eos_threshold = at::zeros({vocab}, eos.options().dtype(at::kLong));
  }
  // Membership, not indexing: an id outside [0, vocab) marks nothing (it
  // never ends a row either), as in transformers' isin-based processors, and
  // cannot reach a device-side assert (Note [Token ids are checked on the host]).
  const at::Tensor is_eos = at::isin(at::arange(vocab, eos.options().dtype(at::kLong)), eos);
  at::mul_out(state.eos_threshold, is_eos, min_new_tokens);
}

at::Tensor select_next_tokens(const at::Tensor& logits, DecodeState& state,
                              const SamplingOptions& sampling, const at::Tensor& eos,
                              std::optional<int64_t> pad_token_id,
                              TokenSelectionKernels kernels) {
  // Note [Fewer kernels per token]: every operation here is a kernel in each
  // decode graph; keep their number down.
  const at::Tensor last = logits.dim() == 3 ? logits.select(1, -1) : logits;
  const int64_t batch = state.next.size(0);
  GRAPHED_CHECK(last.dim() == 2 && last.size(0) == batch,
                "Expected logits [", batch, ", vocab] or [", batch, ", 1, vocab] from the model, "
                "got ", logits.sizes(), ". The step must return the logits of one position per "
                "row.");
  GRAPHED_CHECK(at::isFloatingType(last.scalar_type()), "Expected floating-point logits, got ",
                last.scalar_type(), ".");
  const bool has_eos = eos.defined() && eos.numel() > 0;
  bool suppress_eos = false;
  if (has_eos && state.eos_threshold.defined()) {
    GRAPHED_CHECK(state.eos_threshold.numel() == last.size(-1), "Expected eos_threshold with one "
                  "entry per vocabulary token (", last.size(-1), "), got ",
                  state.eos_threshold.numel(), ". Call suppress_eos_until with the logits' "
                  "vocabulary size.");
    suppress_eos = true;
  }
  at::Tensor scores = last;
  if (sampling.do_sample) {
    if (suppress_eos) {
      // MinNewTokensLengthLogitsProcessor, with its host condition on the device.
      scores = at::where(state.eos_threshold.gt(state.step), kMinusInfinity, scores);
      suppress_eos = false;
    }
    // Hugging Face: outputs.logits[:, -1].to(copy=True, dtype=torch.float32), then the warpers.
    scores = scores.to(at::kFloat);
    if (sampling.temperature != 1.0) {
      scores = scores / sampling.temperature;
    }
    if (sampling.top_k > 0) {
      scores = top_k_filter(scores, sampling.top_k, sampling.min_tokens_to_keep);
    }
    if (sampling.top_p < 1.0) {
      scores = top_p_filter(scores, sampling.top_p, sampling.min_tokens_to_keep);
    }
    // Note [Sampling inside a graph]: multinomial(probs, 1) without its host checks.
    const at::Tensor probs = at::softmax(scores, -1);
    const at::Tensor draws = at::empty_like(probs).exponential_(1.0);
    scores = probs.div_(draws);
  }
  if (kernels == TokenSelectionKernels::kFused && fused_selection_applies(scores, state, eos)) {
    fused_greedy_step(scores, state, eos, suppress_eos, pad_token_id);
    return state.next.select(1, 0);
  }
  if (suppress_eos) {
    scores = at::where(state.eos_threshold.gt(state.step), kMinusInfinity, scores);
  }
  // Greedy: the float32 copy Hugging Face makes is exact, so the argmax of the
  // logits in their own dtype is the same token (ties: the first index, both ways).
  at::argmax_out(state.next, scores, -1, /*keepdim=*/true);
  if (has_eos && pad_token_id) {
    state.next.masked_fill_(state.finished.unsqueeze(1), *pad_token_id);
  }
  // Bounded like the fused kernel's write (the Decoder never lets the step
  // reach the capacity; a caller of this function might).
  state.tokens.index_copy_(1, state.step.clamp_max(state.tokens.size(1) - 1), state.next);
  if (has_eos) {
    // done still says whether every row had finished before this token.
    state.generated.add_(state.done, /*alpha=*/-1);
  }
  state.counters.add_(1);
  if (has_eos) {
    const at::Tensor ended = eos.numel() == 1 ? state.next.eq(eos)
                                              : state.next.eq(eos).any(-1, /*keepdim=*/true);
    state.finished.unsqueeze(1).logical_or_(ended);
    at::all_out(state.done, state.finished, 0, /*keepdim=*/true);
  }
  return state.next.select(1, 0);
}

}  // namespace graphed
