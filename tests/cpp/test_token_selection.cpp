// The decoder's fused token selection (Note [One kernel picks the tokens])
// against the ATen sequence it replaces, on a GPU: same tokens, rows, flags
// and counters after every step, in every score dtype, with ties, NaNs,
// end-of-sequence tokens, min_new_tokens, padding and strided logits; and the
// same again replayed from a captured graph.

#include "graphed/decoder.h"
#include "graphed/graph.h"
#include "test_support.h"

#include <ATen/ATen.h>

#include <vector>

namespace {

using graphed::DecodeState;
using graphed::SamplingOptions;
using graphed::TokenSelectionKernels;

class TokenSelectionOnGpu : public ::testing::Test {
 protected:
  void SetUp() override { GRAPHED_REQUIRE_GPU(); }
};

const c10::Device kCuda(c10::DeviceType::CUDA, 0);

// Scores with many ties (few distinct values), and a NaN in some rows.
at::Tensor tied_scores(int64_t batch, int64_t vocab, at::ScalarType dtype, bool with_nans,
                       int64_t seed) {
  at::manual_seed(seed);
  at::Tensor scores = at::randint(0, 4, {batch, vocab}, at::TensorOptions().dtype(at::kFloat));
  if (with_nans) {
    for (int64_t row = 0; row < batch; row += 3) {
      scores.index_put_({row, (row * 7 + 1) % vocab}, NAN);
    }
  }
  return scores.to(kCuda).to(dtype);
}

// Compares every field the step writes.
void expect_same_state(const DecodeState& fused, const DecodeState& reference,
                       const std::string& where) {
  SCOPED_TRACE(where);
  EXPECT_TRUE(at::equal(fused.next, reference.next));
  EXPECT_TRUE(at::equal(fused.tokens, reference.tokens));
  EXPECT_TRUE(at::equal(fused.counters, reference.counters));
  EXPECT_TRUE(at::equal(fused.finished, reference.finished));
  EXPECT_TRUE(at::equal(fused.done, reference.done));
}

struct Case {
  int64_t batch;
  int64_t vocab;
  at::ScalarType dtype;
  bool eos;
  int64_t min_new_tokens;
};

TEST_F(TokenSelectionOnGpu, FusedKernelMatchesTheAtenSequenceStepByStep) {
  const std::vector<Case> cases = {
      {1, 32000, at::kBFloat16, true, 0},  {8, 32000, at::kBFloat16, true, 3},
      {3, 1000, at::kFloat, true, 2},      {33, 50257, at::kHalf, true, 0},
      {5, 7, at::kFloat, false, 0},        {64, 4096, at::kBFloat16, false, 0},
      {2, 513, at::kHalf, true, 5},
      // Many chunks per row (Note [One kernel picks the tokens]): the tied
      // maxima sit in every chunk, and the lowest index must win.
      {1, 151936, at::kBFloat16, true, 2}, {3, 1025, at::kFloat, false, 0},
      {2, 65536, at::kHalf, true, 0},
  };
  const at::Tensor eos = at::tensor({1, 2}, at::TensorOptions().dtype(at::kLong).device(kCuda));
  constexpr int64_t kSteps = 8;
  for (const Case& c : cases) {
    const std::string name = "batch " + std::to_string(c.batch) + ", vocab " +
                             std::to_string(c.vocab) + ", " + at::toString(c.dtype);
    DecodeState fused = graphed::make_decode_state(c.batch, kSteps, kCuda, /*extra_counters=*/2);
    DecodeState reference =
        graphed::make_decode_state(c.batch, kSteps, kCuda, /*extra_counters=*/2);
    const at::Tensor eos_ids = c.eos ? eos : at::Tensor();
    if (c.eos) {
      graphed::suppress_eos_until(fused, eos, c.vocab, c.min_new_tokens);
      graphed::suppress_eos_until(reference, eos, c.vocab, c.min_new_tokens);
    }
    for (int64_t step = 0; step < kSteps; ++step) {
      at::Tensor scores = tied_scores(c.batch, c.vocab, c.dtype, step % 2 == 1, 100 * step + 1);
      if (c.eos && step >= 2) {
        // Make eos win in some rows, so rows finish at different steps.
        scores.narrow(0, 0, (c.batch + 1) / 2).select(1, 1 + step % 2).fill_(100);
      }
      (void)graphed::select_next_tokens(scores, fused, {}, eos_ids, 0,
                                        TokenSelectionKernels::kFused);
      (void)graphed::select_next_tokens(scores, reference, {}, eos_ids, 0,
                                        TokenSelectionKernels::kAten);
      expect_same_state(fused, reference, name + ", step " + std::to_string(step));
    }
    EXPECT_EQ(fused.arrivals.count_nonzero().item<int64_t>(), 0) << name;
  }
}

TEST_F(TokenSelectionOnGpu, StridedLogitsOfThePromptsLastPosition) {
  // A prefill without logits_to_keep returns every position; the last one's
  // rows are strided by prompt_len * vocab.
  const at::Tensor logits = tied_scores(4 * 5, 300, at::kBFloat16, true, 7).view({4, 5, 300});
  DecodeState fused = graphed::make_decode_state(4, 2, kCuda);
  DecodeState reference = graphed::make_decode_state(4, 2, kCuda);
  (void)graphed::select_next_tokens(logits, fused, {}, at::Tensor(), {},
                                    TokenSelectionKernels::kFused);
  (void)graphed::select_next_tokens(logits, reference, {}, at::Tensor(), {},
                                    TokenSelectionKernels::kAten);
  expect_same_state(fused, reference, "strided");
  EXPECT_TRUE(at::equal(fused.next.view(-1), logits.select(1, -1).argmax(-1)));
}

TEST_F(TokenSelectionOnGpu, SampledScoresTakeTheFusedArgmax) {
  SamplingOptions sampling;
  sampling.do_sample = true;
  sampling.top_k = 50;
  const at::Tensor eos = at::tensor({3}, at::TensorOptions().dtype(at::kLong).device(kCuda));
  DecodeState fused = graphed::make_decode_state(6, 4, kCuda);
  DecodeState reference = graphed::make_decode_state(6, 4, kCuda);
  graphed::suppress_eos_until(fused, eos, 2000, 2);
  graphed::suppress_eos_until(reference, eos, 2000, 2);
  for (int64_t step = 0; step < 4; ++step) {
    const at::Tensor logits = at::randn({6, 2000}, at::TensorOptions().device(kCuda));
    at::manual_seed(40 + step);
    (void)graphed::select_next_tokens(logits, fused, sampling, eos, 0,
                                      TokenSelectionKernels::kFused);
    at::manual_seed(40 + step);
    (void)graphed::select_next_tokens(logits, reference, sampling, eos, 0,
                                      TokenSelectionKernels::kAten);
    expect_same_state(fused, reference, "sampled step " + std::to_string(step));
  }
}

TEST_F(TokenSelectionOnGpu, ReplayedGraphAdvancesLikeEagerSteps) {
  constexpr int64_t kBatch = 8;
  constexpr int64_t kVocab = 5000;
  constexpr int64_t kSteps = 6;
  const at::Tensor eos = at::tensor({4}, at::TensorOptions().dtype(at::kLong).device(kCuda));
  at::Tensor scores = at::zeros({kBatch, kVocab}, at::TensorOptions().dtype(at::kBFloat16).device(kCuda));
  DecodeState captured = graphed::make_decode_state(kBatch, kSteps + 2, kCuda);
  DecodeState reference = graphed::make_decode_state(kBatch, kSteps + 2, kCuda);
  graphed::suppress_eos_until(captured, eos, kVocab, 1);
  graphed::suppress_eos_until(reference, eos, kVocab, 1);
  graphed::Graph graph;
  // Capture writes nothing (the body only enqueues); the step runs on replay.
  graph.capture([&] { (void)graphed::select_next_tokens(scores, captured, {}, eos, 7); });
  for (int64_t step = 0; step < kSteps; ++step) {
    scores.copy_(tied_scores(kBatch, kVocab, at::kBFloat16, step == 3, step + 11));
    scores.narrow(0, 0, step).select(1, 4).fill_(50);  // row r ends at step r + 1
    graph.replay();
    (void)graphed::select_next_tokens(scores, reference, {}, eos, 7,
                                      TokenSelectionKernels::kAten);
    expect_same_state(captured, reference, "replay " + std::to_string(step));
  }
  EXPECT_EQ(captured.arrivals.count_nonzero().item<int64_t>(), 0);
}

}  // namespace
