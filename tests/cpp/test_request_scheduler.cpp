// graphed::RequestScheduler: continuous batching on a Decoder's buffers, on the
// CPU (use_graphs = false runs the same steps eagerly) and on captured graphs.

#include "graphed/check.h"
#include "graphed/decoder.h"
#include "graphed/request_scheduler.h"
#include "test_support.h"

#include <ATen/ATen.h>

#include <map>
#include <vector>

namespace {

using graphed::DecodeInputs;
using graphed::Decoder;
using graphed::DecoderOptions;
using graphed::FinishedRequest;
using graphed::RequestScheduler;
using graphed::SchedulerOptions;

constexpr int64_t kVocab = 97;

// A model whose next token is (fed token + position) % kVocab: a row that is
// fed another row's token or position, or a token column read from the wrong
// step, gives other tokens than the host reference below.
at::Tensor token_logits(const at::Tensor& index) {
  const at::Tensor at_index = index.remainder(kVocab).view({-1, 1});
  return at::zeros({at_index.size(0), kVocab}, index.options().dtype(at::kFloat))
      .scatter_(1, at_index, 1.0);
}

at::Tensor step(const DecodeInputs& in) {
  return token_logits(in.input_ids.select(1, 0) + in.position_ids.select(1, 0));
}

// The prefill of one prompt: its last token plus its last position.
at::Tensor prefill(const at::Tensor& ids, int64_t /*slot*/) {
  return token_logits(ids.select(1, -1) + (ids.size(1) - 1)).unsqueeze(1);
}

std::vector<int64_t> expected(const std::vector<int64_t>& prompt, int64_t new_tokens,
                              int64_t eos = -1) {
  int64_t token = prompt.back();
  int64_t position = static_cast<int64_t>(prompt.size()) - 1;
  std::vector<int64_t> out;
  for (int64_t i = 0; i < new_tokens; ++i) {
    token = (token + position) % kVocab;
    position += 1;
    out.push_back(token);
    if (token == eos) break;
  }
  return out;
}

DecoderOptions options(int64_t max_batch, int64_t max_len, bool graphs) {
  DecoderOptions decoding;
  decoding.max_batch = max_batch;
  decoding.max_len = max_len;
  decoding.use_graphs = graphs;
  return decoding;
}

Decoder make_decoder(DecoderOptions decoding, c10::Device device) {
  return Decoder(step, [](const at::Tensor&, const at::Tensor&, const at::Tensor&) {
    return at::Tensor();
  }, std::move(decoding), device);
}

std::vector<int64_t> prompt_of(int64_t length, int64_t seed) {
  std::vector<int64_t> prompt;
  for (int64_t i = 0; i < length; ++i) prompt.push_back((seed * 7 + i * 3) % kVocab);
  return prompt;
}

void serve_and_check(Decoder& decoder, int64_t chunk_steps, int64_t eos, c10::Device device) {
  SchedulerOptions scheduling;
  scheduling.chunk_steps = chunk_steps;
  if (eos >= 0) scheduling.eos_token_ids = {eos};
  RequestScheduler scheduler(decoder, prefill, scheduling);
  const std::vector<int64_t> lengths = {3, 9, 1, 5, 12, 2, 7, 4, 6, 8};
  const std::vector<int64_t> budgets = {6, 1, 13, 4, 9, 2, 11, 5, 7, 3};
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const std::vector<int64_t> prompt = prompt_of(lengths[i], static_cast<int64_t>(i));
    index[scheduler.submit(at::tensor(prompt, at::kLong).to(device), budgets[i])] = i;
  }
  std::map<int64_t, std::vector<int64_t>> streamed;
  const std::vector<FinishedRequest> done = scheduler.run(
      [&](int64_t id, const std::vector<int64_t>& tokens, bool) {
        streamed[id].insert(streamed[id].end(), tokens.begin(), tokens.end());
      });
  ASSERT_EQ(done.size(), lengths.size());
  EXPECT_TRUE(scheduler.idle());
  for (const FinishedRequest& request : done) {
    const size_t i = index.at(request.id);
    const std::vector<int64_t> want =
        expected(prompt_of(lengths[i], static_cast<int64_t>(i)), budgets[i], eos);
    EXPECT_EQ(request.tokens, want) << "request " << i;
    EXPECT_EQ(streamed[request.id], want) << "request " << i;
    EXPECT_EQ(request.hit_eos, !want.empty() && want.back() == eos) << "request " << i;
  }
  EXPECT_EQ(scheduler.stats().prefills, static_cast<int64_t>(lengths.size()));
}

TEST(RequestScheduler, EveryRequestGetsItsOwnTokensWhateverTheOtherSlotsDo) {
  Decoder decoder = make_decoder(options(3, 24, false), c10::kCPU);
  serve_and_check(decoder, 4, -1, c10::kCPU);
}

TEST(RequestScheduler, EndOfSequenceEndsARequestAndFreesItsSlot) {
  Decoder decoder = make_decoder(options(2, 24, false), c10::kCPU);
  serve_and_check(decoder, 3, 14, c10::kCPU);  // request 2 ends on its first token
}

TEST(RequestScheduler, RefusesDecodersThatCannotServeSlots) {
  DecoderOptions with_eos = options(2, 16, false);
  with_eos.eos_token_ids = {3};
  with_eos.pad_token_id = 0;
  Decoder eos_decoder = make_decoder(with_eos, c10::kCPU);
  EXPECT_THROW_WITH(RequestScheduler(eos_decoder, prefill, {}), graphed::Error,
                    "Expected a Decoder built without eos_token_ids");
  DecoderOptions with_budget = options(2, 16, false);
  with_budget.memory_budget_bytes = 1 << 20;
  Decoder budget_decoder = make_decoder(with_budget, c10::kCPU);
  EXPECT_THROW_WITH(RequestScheduler(budget_decoder, prefill, {}), graphed::Error,
                    "Expected a Decoder without a memory budget");
  Decoder decoder = make_decoder(options(2, 16, false), c10::kCPU);
  SchedulerOptions bad;
  bad.chunk_steps = 0;
  EXPECT_THROW_WITH(RequestScheduler(decoder, prefill, bad), graphed::Error,
                    "Expected chunk_steps >= 1");
  RequestScheduler scheduler(decoder, prefill, {});
  EXPECT_THROW_WITH(scheduler.submit(at::ones({2, 2}, at::kLong), 2), graphed::Error,
                    "Expected a prompt as a 1-D tensor of token ids");
  EXPECT_THROW_WITH(scheduler.submit(at::ones({10}, at::kLong), 8), graphed::Error,
                    "The request needs 17 cache positions");
  EXPECT_TRUE(scheduler.idle());
}

class RequestSchedulerOnGpu : public ::testing::Test {
 protected:
  void SetUp() override { GRAPHED_REQUIRE_GPU(); }
};

TEST_F(RequestSchedulerOnGpu, GraphsGiveEveryRequestItsOwnTokens) {
  const c10::Device gpu(c10::kCUDA, 0);
  Decoder decoder = make_decoder(options(4, 24, true), gpu);
  serve_and_check(decoder, 4, -1, gpu);
  for (const graphed::BucketReport& report : decoder.memory_report()) {
    EXPECT_TRUE(report.captured) << "bucket " << report.batch;
  }
}

TEST_F(RequestSchedulerOnGpu, GraphsEndRequestsOnEosSeenInTheCopiedTokens) {
  const c10::Device gpu(c10::kCUDA, 0);
  Decoder decoder = make_decoder(options(2, 24, true), gpu);
  serve_and_check(decoder, 2, 14, gpu);
}

}  // namespace
