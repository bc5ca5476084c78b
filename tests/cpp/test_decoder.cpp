// graphed::Decoder: the token selection and the decode loop on the CPU
// (use_graphs = false runs the same steps eagerly), captured graphs on a GPU.

#include "graphed/check.h"
#include "graphed/decoder.h"
#include "test_support.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <vector>

namespace {

using graphed::DecodeInputs;
using graphed::Decoder;
using graphed::DecoderOptions;
using graphed::DecodeState;
using graphed::SamplingOptions;

constexpr int64_t kVocab = 11;

std::vector<int64_t> to_vector(const at::Tensor& tensor) {
  const at::Tensor flat = tensor.to(at::kCPU).to(at::kLong).contiguous().view(-1);
  return {flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()};
}

// A toy language model with a KV "cache" of one counter: the next token is
// (token + position + cache length) % kVocab, as one-hot logits. Reading the
// cache length from a device tensor it advances itself is what a real
// static-cache model does.
struct ToyModel {
  at::Tensor length;  // [1], int64: positions written so far

  explicit ToyModel(c10::Device device)
      : length(at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device))) {}

  at::Tensor logits_for(const at::Tensor& tokens) const {
    // scatter_ rather than one_hot, which reads the tokens on the host on some devices.
    const at::Tensor index = tokens.remainder(kVocab).unsqueeze(1);
    return at::zeros({tokens.size(0), kVocab}, tokens.options().dtype(at::kFloat))
        .scatter_(1, index, 1.0);
  }

  at::Tensor step(const DecodeInputs& inputs) {
    length.add_(1);  // the token's key and value are appended, then attended to
    return logits_for(inputs.input_ids.select(1, 0) + inputs.position_ids.select(1, 0) + length);
  }

  at::Tensor prefill(const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& positions) {
    length.add_(ids.size(1));
    return logits_for(ids.select(1, -1) + positions.select(1, -1) + length).unsqueeze(1);
  }

  // What the loop must produce, computed on the host.
  std::vector<std::vector<int64_t>> expected(const std::vector<std::vector<int64_t>>& prompts,
                                             const std::vector<int64_t>& ones, int64_t new_tokens,
                                             int64_t eos = -1, int64_t pad = 0) const {
    std::vector<std::vector<int64_t>> rows;
    for (size_t row = 0; row < prompts.size(); ++row) {
      const int64_t len = static_cast<int64_t>(prompts[row].size());
      int64_t token = prompts[row].back();
      int64_t position = ones[row] - 1;
      int64_t cache = len;
      bool finished = false;
      std::vector<int64_t> out;
      for (int64_t i = 0; i < new_tokens; ++i) {
        int64_t next = (token + position + cache) % kVocab;
        if (finished) next = pad;
        if (next == eos) finished = true;
        out.push_back(next);
        token = next;
        position += 1;
        cache += 1;
      }
      rows.push_back(out);
    }
    return rows;
  }
};

DecoderOptions toy_options(int64_t max_batch, int64_t max_len, bool graphs) {
  DecoderOptions options;
  options.max_batch = max_batch;
  options.max_len = max_len;
  options.use_graphs = graphs;
  options.check_every = 3;
  return options;
}

Decoder toy_decoder(ToyModel& model, DecoderOptions options, c10::Device device) {
  options.reset_cache = [&model] { model.length.zero_(); };
  return Decoder([&model](const DecodeInputs& in) { return model.step(in); },
                 [&model](const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& pos) {
                   return model.prefill(ids, mask, pos);
                 },
                 std::move(options), device);
}

TEST(DecoderOptions, DefaultBucketsArePowersOfTwoThenMaxBatch) {
  EXPECT_EQ(graphed::default_batch_buckets(1), (std::vector<int64_t>{1}));
  EXPECT_EQ(graphed::default_batch_buckets(8), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(graphed::default_batch_buckets(6), (std::vector<int64_t>{1, 2, 4, 6}));
}

TEST(DecoderOptions, BadOptionsNameTheLimit) {
  DecoderOptions options = toy_options(4, 16, false);
  options.max_len = 1;
  EXPECT_THROW_WITH(graphed::validate_decoder_options(options), graphed::Error, "max_len");
  options = toy_options(4, 16, false);
  options.batch_buckets = {1, 2};
  EXPECT_THROW_WITH(graphed::validate_decoder_options(options), graphed::Error,
                    "below max_batch (4)");
  options.batch_buckets = {1, 8};
  EXPECT_THROW_WITH(graphed::validate_decoder_options(options), graphed::Error,
                    "above max_batch (4)");
  options = toy_options(4, 16, false);
  options.eos_token_ids = {2};
  EXPECT_THROW_WITH(graphed::validate_decoder_options(options), graphed::Error, "pad_token_id");
  options = toy_options(4, 16, false);
  options.sampling.temperature = 0.0;
  EXPECT_THROW_WITH(graphed::validate_decoder_options(options), graphed::Error, "do_sample");
  options = toy_options(4, 16, false);
  options.sampling.top_p = 0.0;
  EXPECT_THROW_WITH(graphed::validate_decoder_options(options), graphed::Error, "top_p");
  options = toy_options(4, 16, false);
  options.batch_buckets = {4, 2, 2};
  EXPECT_EQ(graphed::validate_decoder_options(options), (std::vector<int64_t>{2, 4}));
}

TEST(DecoderOptions, GraphsOnTheCpuAreRefusedWithTheFix) {
  ToyModel model(at::kCPU);
  EXPECT_THROW_WITH(toy_decoder(model, toy_options(2, 8, true), at::kCPU), graphed::Error,
                    "use_graphs=false");
}

TEST(PromptPositions, CountAttendedTokensLikeHuggingFace) {
  const at::Tensor mask = at::tensor({0, 0, 1, 1, 1, 1, 1, 1}, at::kLong).view({2, 4});
  EXPECT_EQ(to_vector(graphed::prompt_positions(mask)),
            (std::vector<int64_t>{0, 0, 0, 1, 0, 1, 2, 3}));
}

TEST(SelectNextTokens, GreedyWritesTokensFinishesRowsAndPads) {
  DecodeState state = graphed::make_decode_state(3, 4, at::kCPU);
  const at::Tensor eos = at::tensor({5}, at::kLong);
  at::Tensor logits = at::zeros({3, kVocab});
  logits.index_put_({0, 5}, 1.0);  // row 0 emits eos
  logits.index_put_({1, 7}, 1.0);
  logits.index_put_({2, 3}, 1.0);
  state.finished.index_put_({2}, true);  // row 2 finished earlier: emits pad
  const at::Tensor next = graphed::select_next_tokens(logits, state, {}, eos, 9);
  EXPECT_EQ(to_vector(next), (std::vector<int64_t>{5, 7, 9}));
  EXPECT_EQ(to_vector(state.tokens.select(1, 0)), (std::vector<int64_t>{5, 7, 9}));
  EXPECT_EQ(to_vector(state.finished), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(to_vector(state.step), (std::vector<int64_t>{1}));
  EXPECT_EQ(to_vector(state.generated), (std::vector<int64_t>{1}));
  EXPECT_FALSE(state.done.item<bool>());
  logits.zero_();
  logits.index_put_({1, 5}, 1.0);
  (void)graphed::select_next_tokens(logits, state, {}, eos, 9);
  EXPECT_TRUE(state.done.item<bool>());
  EXPECT_EQ(to_vector(state.tokens.select(1, 1)), (std::vector<int64_t>{9, 5, 9}));
  // A step taken after every row finished does not count.
  (void)graphed::select_next_tokens(logits, state, {}, eos, 9);
  EXPECT_EQ(to_vector(state.generated), (std::vector<int64_t>{2}));
  EXPECT_EQ(to_vector(state.step), (std::vector<int64_t>{3}));
}

TEST(SelectNextTokens, MinNewTokensSuppressEosUntilReached) {
  DecodeState state = graphed::make_decode_state(1, 4, at::kCPU);
  const at::Tensor eos = at::tensor({5}, at::kLong);
  graphed::suppress_eos_until(state, eos, kVocab, 2);
  at::Tensor logits = at::zeros({1, kVocab});
  logits.index_put_({0, 5}, 2.0);
  logits.index_put_({0, 4}, 1.0);
  EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, {}, eos, 0)),
            (std::vector<int64_t>{4}));
  EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, {}, eos, 0)),
            (std::vector<int64_t>{4}));
  EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, {}, eos, 0)),
            (std::vector<int64_t>{5}));
}

TEST(SelectNextTokens, IdsOutsideTheVocabularyAreNeverIndexes) {
  // Note [Token ids are checked on the host]: an eos id outside the
  // vocabulary marks nothing, and a step past the capacity writes in bounds.
  DecodeState state = graphed::make_decode_state(1, 2, at::kCPU);
  const at::Tensor eos = at::tensor({50256, -3, 2}, at::kLong);
  graphed::suppress_eos_until(state, eos, kVocab, 4);
  std::vector<int64_t> want(kVocab, 0);
  want[2] = 4;
  EXPECT_EQ(to_vector(state.eos_threshold), want);
  at::Tensor logits = at::zeros({1, kVocab});
  logits.index_put_({0, 7}, 1.0);
  state.step.fill_(5);
  EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, {}, eos, 0)),
            (std::vector<int64_t>{7}));
  EXPECT_EQ(to_vector(state.tokens), (std::vector<int64_t>{0, 7}));
}

TEST(SelectNextTokens, GreedyInTheLogitsDtypeWritesNextAndAdvancesTheCounters) {
  // Two extra counters stand for a caller's positions: they advance with step.
  DecodeState state = graphed::make_decode_state(2, 3, at::kCPU, /*extra_counters=*/2);
  state.counters.narrow(0, 2, 2).fill_(7);
  at::Tensor logits = at::zeros({2, 1, kVocab}, at::kBFloat16);
  logits.index_put_({0, 0, 4}, 1.0);
  logits.index_put_({1, 0, 9}, 1.0);
  logits.index_put_({1, 0, 2}, 1.0);  // a tie: the first index wins, as for float32
  const at::Tensor next = graphed::select_next_tokens(logits, state, {}, at::Tensor(), 0);
  EXPECT_EQ(to_vector(next), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(to_vector(state.next), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(next.data_ptr(), state.next.data_ptr()) << "the tokens are state.next itself";
  EXPECT_EQ(to_vector(state.tokens.select(1, 0)), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(to_vector(state.counters), (std::vector<int64_t>{1, 1, 8, 8}));
  EXPECT_FALSE(state.done.item<bool>());
}

TEST(SelectNextTokens, MatchesArgmaxOfFloatLogitsForEveryDtype) {
  at::manual_seed(3);
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
    // Coarse values make ties common in the low-precision dtypes.
    const at::Tensor logits = at::randint(-4, 4, {64, 1, 50}).to(dtype);
    DecodeState state = graphed::make_decode_state(64, 1, at::kCPU);
    const at::Tensor want = logits.select(1, 0).to(at::kFloat).argmax(-1);
    EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, {}, at::Tensor(), {})),
              to_vector(want)) << dtype;
  }
}

TEST(SelectNextTokens, SeveralEosTokensAndTheThresholdFollowMinNewTokens) {
  DecodeState state = graphed::make_decode_state(2, 6, at::kCPU);
  const at::Tensor eos = at::tensor({5, 6}, at::kLong);
  EXPECT_THROW_WITH(
      {
        DecodeState bad = graphed::make_decode_state(2, 6, at::kCPU);
        graphed::suppress_eos_until(bad, eos, 20, 1);
        (void)graphed::select_next_tokens(at::zeros({2, kVocab}), bad, {}, eos, 0);
      },
      graphed::Error, "suppress_eos_until");
  graphed::suppress_eos_until(state, eos, kVocab, 1);
  at::Tensor logits = at::zeros({2, kVocab});
  logits.index_put_({0, 6}, 3.0);
  logits.index_put_({0, 1}, 1.0);
  logits.index_put_({1, 5}, 3.0);
  logits.index_put_({1, 2}, 1.0);
  // Step 0 < min_new_tokens 1: both eos tokens suppressed.
  EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, {}, eos, 0)),
            (std::vector<int64_t>{1, 2}));
  // Step 1: row 0 ends on eos 6, row 1 on eos 5.
  EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, {}, eos, 0)),
            (std::vector<int64_t>{6, 5}));
  EXPECT_TRUE(state.done.item<bool>());
  EXPECT_EQ(to_vector(state.generated), (std::vector<int64_t>{2}));
  // The threshold is rewritten in place for the next request.
  const void* where = state.eos_threshold.data_ptr();
  graphed::suppress_eos_until(state, eos, kVocab, 0);
  EXPECT_EQ(state.eos_threshold.data_ptr(), where);
  EXPECT_EQ(to_vector(state.eos_threshold).at(5), 0);
}

TEST(SelectNextTokens, TopKOneAndTinyTopPAreGreedy) {
  at::manual_seed(0);
  const at::Tensor logits = at::randn({64, kVocab});
  const std::vector<int64_t> argmax = to_vector(logits.argmax(-1));
  SamplingOptions top_k;
  top_k.do_sample = true;
  top_k.top_k = 1;
  DecodeState state = graphed::make_decode_state(64, 1, at::kCPU);
  EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, top_k, at::Tensor(), {})), argmax);
  SamplingOptions top_p;
  top_p.do_sample = true;
  top_p.top_p = 1e-6;
  state = graphed::make_decode_state(64, 1, at::kCPU);
  EXPECT_EQ(to_vector(graphed::select_next_tokens(logits, state, top_p, at::Tensor(), {})), argmax);
}

// The draws follow softmax(logits / temperature) restricted to the top k.
void expect_sampling_follows_distribution(c10::Device device) {
  at::manual_seed(0);
  const int64_t rows = 40000;
  const at::Tensor base = at::tensor({2.0, 1.5, 1.0, 0.5, 0.0, -1.0}, at::kFloat);
  SamplingOptions sampling;
  sampling.do_sample = true;
  sampling.temperature = 0.8;
  sampling.top_k = 4;
  DecodeState state = graphed::make_decode_state(rows, 1, device);
  const at::Tensor logits = base.to(device).expand({rows, 6});
  const at::Tensor next = graphed::select_next_tokens(logits, state, sampling, at::Tensor(), {});
  const at::Tensor counts = at::bincount(next.cpu(), {}, 6).to(at::kDouble) / rows;
  at::Tensor expected = at::softmax(base.narrow(0, 0, 4).to(at::kDouble) / 0.8, 0);
  expected = at::cat({expected, at::zeros({2}, at::kDouble)});
  for (int64_t i = 0; i < 6; ++i) {
    const double p = expected[i].item<double>();
    const double tolerance = 5.0 * std::sqrt(p * (1 - p) / rows) + 1e-12;
    EXPECT_NEAR(counts[i].item<double>(), p, tolerance) << "token " << i;
  }
}

TEST(SelectNextTokens, SamplingFollowsTheDistribution) {
  expect_sampling_follows_distribution(at::kCPU);
}

TEST(DecoderLoop, GreedyPaddedBatchMatchesTheHostReference) {
  ToyModel model(at::kCPU);
  Decoder decoder = toy_decoder(model, toy_options(4, 16, false), at::kCPU);
  // Three rows run in bucket 4; row 1 is left-padded.
  const at::Tensor ids = at::tensor({3, 4, 5, 0, 2, 7, 1, 1, 1}, at::kLong).view({3, 3});
  const at::Tensor mask = at::tensor({1, 1, 1, 0, 1, 1, 1, 1, 1}, at::kLong).view({3, 3});
  const graphed::DecodeResult result = decoder.generate(ids, mask, 6);
  EXPECT_EQ(result.bucket, 4);
  EXPECT_EQ(result.steps, 6);
  const auto expected = model.expected({{3, 4, 5}, {0, 2, 7}, {1, 1, 1}}, {3, 2, 3}, 6);
  ASSERT_EQ(result.tokens.sizes(), (std::vector<int64_t>{3, 6}));
  for (int64_t row = 0; row < 3; ++row) {
    EXPECT_EQ(to_vector(result.tokens[row]), expected[row]) << "row " << row;
  }
}

TEST(DecoderLoop, StopsWhenEveryRowFinishedWithHuggingFacesLength) {
  ToyModel model(at::kCPU);
  DecoderOptions options = toy_options(2, 32, false);
  // From prompt [1], position 0, cache 1 the tokens are 2, 5, 0, 2, ...: eos 5
  // is the second token.
  options.eos_token_ids = {5};
  options.pad_token_id = 10;
  Decoder decoder = toy_decoder(model, options, at::kCPU);
  const at::Tensor ids = at::tensor({1}, at::kLong).view({1, 1});
  const graphed::DecodeResult result = decoder.generate(ids, at::Tensor(), 20);
  EXPECT_EQ(to_vector(result.tokens), (std::vector<int64_t>{2, 5}));
  // The done flag is read every check_every (3) tokens: one wasted step.
  EXPECT_EQ(result.steps, 3);
}

TEST(DecoderLoop, CallbackSeesEveryTokenAndStopsAtOnce) {
  ToyModel model(at::kCPU);
  DecoderOptions options = toy_options(1, 32, false);
  options.eos_token_ids = {5};
  options.pad_token_id = 10;
  Decoder decoder = toy_decoder(model, options, at::kCPU);
  std::vector<int64_t> seen;
  const graphed::DecodeResult result =
      decoder.generate(at::tensor({1}, at::kLong).view({1, 1}), at::Tensor(), 20, 0,
                       [&](const at::Tensor& tokens) { seen.push_back(tokens.item<int64_t>()); });
  EXPECT_EQ(seen, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(result.steps, 2);
}

TEST(DecoderLoop, RequestsOverTheLimitsAreRefusedBeforeAnyWork) {
  ToyModel model(at::kCPU);
  Decoder decoder = toy_decoder(model, toy_options(2, 8, false), at::kCPU);
  const at::Tensor three_rows = at::zeros({3, 2}, at::kLong);
  EXPECT_THROW_WITH(decoder.generate(three_rows, at::Tensor(), 2), graphed::Error,
                    "max_batch >= 3");
  const at::Tensor long_prompt = at::zeros({1, 6}, at::kLong);
  EXPECT_THROW_WITH(decoder.generate(long_prompt, at::Tensor(), 4), graphed::Error,
                    "needs 9 cache positions");
  EXPECT_EQ(to_vector(model.length), (std::vector<int64_t>{0}));
}

TEST(DecoderLoop, TokenIdsOutsideTheVocabularyAreRefusedOrNeverEndARow) {
  // Note [Token ids are checked on the host].
  ToyModel model(at::kCPU);
  DecoderOptions options = toy_options(4, 32, false);
  options.vocab_size = kVocab;
  options.eos_token_ids = {5};
  options.pad_token_id = 50000;
  EXPECT_THROW_WITH(toy_decoder(model, options, at::kCPU), graphed::Error,
                    "Expected pad_token_id within the model's vocabulary [0, 11), got 50000");
  // GPT-2's default eos (50256) in a small vocabulary, as its pad too: no row
  // ever finishes, as in transformers, and the rows padding the batch to its
  // bucket read token 0.
  options.eos_token_ids = {50256};
  options.pad_token_id = 50256;
  options.reset_cache = [&model] { model.length.zero_(); };
  // Every id the model is handed must be in its vocabulary (the padding row
  // too, which starts finished and emits what finished rows emit).
  const auto in_vocab = [](const at::Tensor& ids) {
    EXPECT_TRUE(ids.ge(0).logical_and(ids.lt(kVocab)).all().item<bool>()) << ids;
  };
  Decoder decoder(
      [&](const DecodeInputs& in) {
        in_vocab(in.input_ids);
        return model.step(in);
      },
      [&](const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& pos) {
        in_vocab(ids);
        return model.prefill(ids, mask, pos);
      },
      options, at::kCPU);
  const at::Tensor ids = at::tensor({1, 3, 4}, at::kLong).view({3, 1});
  const graphed::DecodeResult result = decoder.generate(ids, at::Tensor(), 6, /*min_new_tokens=*/2);
  EXPECT_EQ(result.steps, 6);
  const auto expected = model.expected({{1}, {3}, {4}}, {1, 1, 1}, 6);
  for (int64_t row = 0; row < 3; ++row) {
    EXPECT_EQ(to_vector(result.tokens[row]), expected[row]) << "row " << row;
  }
  model.length.zero_();
  EXPECT_THROW_WITH(decoder.generate(at::tensor({2, 11}, at::kLong).view({1, 2}), at::Tensor(), 3),
                    graphed::Error, "Expected prompt token ids in [0, 11) (the model's "
                    "vocabulary), got ids from 2 to 11");
  EXPECT_THROW_WITH(decoder.generate(at::tensor({-1}, at::kLong).view({1, 1}), at::Tensor(), 3),
                    graphed::Error, "got ids from -1 to -1");
  EXPECT_EQ(to_vector(model.length), (std::vector<int64_t>{0}));
}

class DecoderOnGpu : public ::testing::Test {
 protected:
  void SetUp() override { GRAPHED_REQUIRE_GPU(); }
};

TEST_F(DecoderOnGpu, GraphsGiveTheEagerTokensForEveryBucket) {
  const c10::Device gpu(c10::kCUDA, 0);
  ToyModel graphed_model(gpu);
  ToyModel eager_model(gpu);
  DecoderOptions options = toy_options(8, 64, true);
  options.eos_token_ids = {5};
  options.pad_token_id = 10;
  Decoder captured = toy_decoder(graphed_model, options, gpu);
  options.use_graphs = false;
  Decoder eager = toy_decoder(eager_model, options, gpu);
  captured.capture_all();
  for (int64_t batch : {1, 3, 8}) {
    const at::Tensor ids =
        at::randint(0, kVocab, {batch, 5}, at::TensorOptions().dtype(at::kLong).device(gpu));
    const auto a = captured.generate(ids, at::Tensor(), 40);
    const auto b = eager.generate(ids, at::Tensor(), 40);
    EXPECT_TRUE(at::equal(a.tokens, b.tokens)) << "batch " << batch;
  }
  for (const graphed::BucketReport& report : captured.memory_report()) {
    EXPECT_TRUE(report.captured) << "bucket " << report.batch;
    EXPECT_GT(report.kernels, 0);
  }
}

TEST_F(DecoderOnGpu, ReplaysDrawNewRandomNumbers) {
  const c10::Device gpu(c10::kCUDA, 0);
  expect_sampling_follows_distribution(gpu);
  // A step whose logits are uniform: every replay samples anew.
  at::Tensor length = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(gpu));
  DecoderOptions options = toy_options(32, 64, true);
  options.sampling.do_sample = true;
  // Eager prefills throughout, so that the seeded requests below draw the
  // first token the same way (the prefill graphs are tested on their own).
  options.prefill_graphs = 0;
  Decoder decoder(
      [](const DecodeInputs& in) {
        return at::zeros({in.batch, 1000}, in.input_ids.options().dtype(at::kFloat));
      },
      [](const at::Tensor& ids, const at::Tensor&, const at::Tensor&) {
        return at::zeros({ids.size(0), 1000}, ids.options().dtype(at::kFloat));
      },
      options, gpu);
  at::manual_seed(1);
  const at::Tensor ids = at::zeros({32, 1}, at::TensorOptions().dtype(at::kLong).device(gpu));
  const at::Tensor first = decoder.generate(ids, at::Tensor(), 50).tokens;
  const at::Tensor second = decoder.generate(ids, at::Tensor(), 50).tokens;
  EXPECT_FALSE(at::equal(first, second));
  // Columns differ too: the graph does not replay the same draw.
  EXPECT_FALSE(at::equal(first.select(1, 10), first.select(1, 11)));
  at::manual_seed(1);
  EXPECT_TRUE(at::equal(decoder.generate(ids, at::Tensor(), 50).tokens, first));
}

TEST_F(DecoderOnGpu, MemoryBudgetEvictsLeastRecentlyUsedBuckets) {
  const c10::Device gpu(c10::kCUDA, 0);
  ToyModel model(gpu);
  DecoderOptions options = toy_options(4, 16, true);
  options.memory_budget_bytes = 1;
  Decoder decoder = toy_decoder(model, options, gpu);
  const auto ids = [&](int64_t batch) {
    return at::ones({batch, 2}, at::TensorOptions().dtype(at::kLong).device(gpu));
  };
  (void)decoder.generate(ids(1), at::Tensor(), 4);
  (void)decoder.generate(ids(4), at::Tensor(), 4);
  int64_t captured = 0;
  for (const graphed::BucketReport& report : decoder.memory_report()) {
    captured += report.captured ? 1 : 0;
  }
  // The budget is below any graph: only the bucket in use stays.
  EXPECT_LE(captured, 1);
  EXPECT_TRUE(decoder.memory_report().back().captured);
}

std::vector<graphed::BucketReport> prefill_rows(const Decoder& decoder) {
  std::vector<graphed::BucketReport> rows;
  for (const graphed::BucketReport& report : decoder.memory_report()) {
    if (report.kind == graphed::GraphKind::kPrefill) {
      rows.push_back(report);
    }
  }
  return rows;
}

TEST_F(DecoderOnGpu, PrefillGraphIsCapturedAfterWarmupAndGivesTheEagerTokens) {
  const c10::Device gpu(c10::kCUDA, 0);
  ToyModel graphed_model(gpu);
  ToyModel eager_model(gpu);
  DecoderOptions options = toy_options(4, 64, true);
  options.eos_token_ids = {5};
  options.pad_token_id = 10;
  options.warmup_iters = 2;
  Decoder captured = toy_decoder(graphed_model, options, gpu);
  options.use_graphs = false;
  Decoder eager = toy_decoder(eager_model, options, gpu);
  const auto longs = at::TensorOptions().dtype(at::kLong).device(gpu);
  for (int request = 1; request <= 4; ++request) {
    // The same shape each time (batch 3 in bucket 4, prompt length 3, no
    // padding), different tokens and min_new_tokens.
    const at::Tensor ids = at::randint(0, kVocab, {3, 3}, longs);
    const int64_t min_new = request % 2 == 0 ? 6 : 0;
    const auto a = captured.generate(ids, at::Tensor(), 30, min_new);
    const auto b = eager.generate(ids, at::Tensor(), 30, min_new);
    EXPECT_TRUE(at::equal(a.tokens, b.tokens)) << "request " << request;
    const auto rows = prefill_rows(captured);
    if (request <= 2) {
      EXPECT_TRUE(rows.empty()) << "request " << request << " should run the prefill eagerly";
    } else {
      ASSERT_EQ(rows.size(), 1u);
      EXPECT_TRUE(rows[0].captured);
      EXPECT_EQ(rows[0].batch, 4);
      EXPECT_EQ(rows[0].prompt_len, 3);
      EXPECT_FALSE(rows[0].padded);
      EXPECT_GT(rows[0].kernels, 0);
      EXPECT_EQ(rows[0].replays, request - 2);
    }
  }
  // A padded mask is another shape; a full batch of the same length too.
  for (int request = 1; request <= 3; ++request) {
    const at::Tensor ids = at::randint(0, kVocab, {2, 3}, longs);
    const at::Tensor mask = at::tensor({0, 1, 1, 1, 1, 1}, longs).view({2, 3});
    EXPECT_TRUE(at::equal(captured.generate(ids, mask, 20).tokens,
                          eager.generate(ids, mask, 20).tokens));
  }
  const auto rows = prefill_rows(captured);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_NE(rows[0].padded, rows[1].padded);
}

TEST_F(DecoderOnGpu, PrefillGraphsAreBoundedLeastRecentlyUsedFirst) {
  const c10::Device gpu(c10::kCUDA, 0);
  ToyModel model(gpu);
  DecoderOptions options = toy_options(2, 32, true);
  options.warmup_iters = 1;
  options.prefill_graphs = 2;
  Decoder decoder = toy_decoder(model, options, gpu);
  const auto longs = at::TensorOptions().dtype(at::kLong).device(gpu);
  for (int64_t length : {2, 3, 4}) {
    for (int request = 0; request < 2; ++request) {
      (void)decoder.generate(at::ones({1, length}, longs), at::Tensor(), 4);
    }
  }
  const auto rows = prefill_rows(decoder);
  ASSERT_EQ(rows.size(), 3u);
  for (const graphed::BucketReport& row : rows) {
    EXPECT_EQ(row.captured, row.prompt_len != 2) << "prompt length " << row.prompt_len;
    EXPECT_EQ(row.evictions, row.prompt_len == 2 ? 1 : 0);
  }
  // Used again, the evicted shape is captured again at once (it was seen enough).
  (void)decoder.generate(at::ones({1, 2}, longs), at::Tensor(), 4);
  int64_t held = 0;
  for (const graphed::BucketReport& row : prefill_rows(decoder)) {
    held += row.captured ? 1 : 0;
    if (row.prompt_len == 2) {
      EXPECT_TRUE(row.captured);
    }
  }
  EXPECT_EQ(held, 2);
}

TEST_F(DecoderOnGpu, PrefillThatCannotBeCapturedStaysEager) {
  const c10::Device gpu(c10::kCUDA, 0);
  ToyModel model(gpu);
  ToyModel reference(gpu);
  DecoderOptions options = toy_options(1, 32, true);
  options.warmup_iters = 1;
  options.reset_cache = [&model] { model.length.zero_(); };
  Decoder decoder(
      [&model](const DecodeInputs& in) { return model.step(in); },
      [&model](const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& pos) {
        (void)ids.sum().item<int64_t>();  // a host read: breaks capture
        return model.prefill(ids, mask, pos);
      },
      options, gpu);
  options.use_graphs = false;
  Decoder eager = toy_decoder(reference, options, gpu);
  const at::Tensor ids = at::ones({1, 3}, at::TensorOptions().dtype(at::kLong).device(gpu));
  for (int request = 0; request < 3; ++request) {
    EXPECT_TRUE(at::equal(decoder.generate(ids, at::Tensor(), 8).tokens,
                          eager.generate(ids, at::Tensor(), 8).tokens));
  }
  EXPECT_TRUE(prefill_rows(decoder).empty());
}

}  // namespace
