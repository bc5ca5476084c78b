// Module selection (module_selection.h): the repeated blocks graphed.auto
// takes by default, and the checks of a user's choice. Host logic only.

#include "graphed/check.h"
#include "graphed/module_selection.h"
#include "test_support.h"

namespace graphed {
namespace {

std::vector<ModuleInfo> gpt_modules(int layers) {
  std::vector<ModuleInfo> modules{{"", "GPT", 0, false}, {"token", "Embedding", 1000, false},
                                  {"blocks", "ModuleList", 0, true}};
  for (int i = 0; i < layers; ++i) {
    const std::string block = c10::str("blocks.", i);
    modules.push_back({block, "GPTBlock", 700, false});
    modules.push_back({block + ".qkv", "Linear", 300, false});
    modules.push_back({block + ".proj", "Linear", 100, false});
    modules.push_back({block + ".mlp", "Sequential", 300, true});
    modules.push_back({block + ".mlp.0", "Linear", 150, false});
    modules.push_back({block + ".mlp.1", "GELU", 0, false});
    modules.push_back({block + ".mlp.2", "Linear", 150, false});
  }
  modules.push_back({"head", "Linear", 1000, false});
  return modules;
}

TEST(SelectRepeatedBlocks, TakesTheLayersNotTheLinearsInside) {
  EXPECT_EQ(select_repeated_blocks(gpt_modules(3)),
            (std::vector<std::string>{"blocks.0", "blocks.1", "blocks.2"}));
}

TEST(SelectRepeatedBlocks, TakesEveryNonOverlappingGroup) {
  const std::vector<ModuleInfo> modules{
      {"", "Seq2Seq", 0, false},        {"encoder", "ModuleList", 0, true},
      {"encoder.0", "EncLayer", 50, false}, {"encoder.1", "EncLayer", 50, false},
      {"decoder", "ModuleList", 0, true},   {"decoder.0", "DecLayer", 80, false},
      {"decoder.1", "DecLayer", 80, false}, {"decoder.2", "Norm", 1, false}};
  EXPECT_EQ(select_repeated_blocks(modules),
            (std::vector<std::string>{"encoder.0", "encoder.1", "decoder.0", "decoder.1"}));
}

TEST(SelectRepeatedBlocks, TakesALayerSubclassedForOneBlockWithItsSiblings) {
  std::vector<ModuleInfo> modules = gpt_modules(4);
  for (ModuleInfo& module : modules) {
    if (module.name == "blocks.2") {
      module.type = "HostReadGPTBlock";
      module.bases = {"GPTBlock"};
    }
  }
  EXPECT_EQ(select_repeated_blocks(modules),
            (std::vector<std::string>{"blocks.0", "blocks.1", "blocks.2", "blocks.3"}));

  // Unrelated classes with a common base keep to their own kind.
  const std::vector<ModuleInfo> mixed{
      {"", "Net", 0, false},
      {"layers", "ModuleList", 0, true},
      {"layers.0", "Attention", 40, false, {"Layer"}},
      {"layers.1", "FeedForward", 60, false, {"Layer"}},
      {"layers.2", "Attention", 40, false, {"Layer"}},
      {"layers.3", "FeedForward", 60, false, {"Layer"}}};
  EXPECT_EQ(select_repeated_blocks(mixed),
            (std::vector<std::string>{"layers.0", "layers.1", "layers.2", "layers.3"}));
  const std::vector<ModuleInfo> one_odd{
      {"", "Net", 0, false},
      {"layers", "ModuleList", 0, true},
      {"layers.0", "Attention", 40, false, {"Layer"}},
      {"layers.1", "Attention", 40, false, {"Layer"}},
      {"layers.2", "FeedForward", 60, false, {"Layer"}}};
  EXPECT_EQ(select_repeated_blocks(one_odd), (std::vector<std::string>{"layers.0", "layers.1"}));
}

TEST(SelectRepeatedBlocks, WithoutRepeatsTakesTheWholeModel) {
  const std::vector<ModuleInfo> modules{{"", "Net", 10, false}, {"fc", "Linear", 10, false},
                                        {"layers", "ModuleList", 0, true},
                                        {"layers.0", "Linear", 5, false}};
  EXPECT_EQ(select_repeated_blocks(modules), (std::vector<std::string>{""}));
}

std::vector<ModuleInfo> moe_block_modules() {
  // A block with its attention as a module, norms, and a mixture-of-experts
  // layer: a router Linear and a ModuleList of MLP experts.
  std::vector<ModuleInfo> modules{{"", "LM", 0, false},
                                  {"blocks", "ModuleList", 0, true},
                                  {"blocks.0", "Block", 900, false},
                                  {"blocks.0.norm1", "LayerNorm", 2, false},
                                  {"blocks.0.attn", "Attention", 400, false},
                                  {"blocks.0.attn.qkv", "Linear", 300, false},
                                  {"blocks.0.attn.proj", "Linear", 100, false},
                                  {"blocks.0.attn.rotary", "Rotary", 0, false},
                                  {"blocks.0.act", "GELU", 0, false},
                                  {"blocks.0.moe", "MoE", 500, false},
                                  {"blocks.0.moe.router", "Linear", 20, false},
                                  {"blocks.0.moe.experts", "ModuleList", 480, true}};
  for (int e = 0; e < 2; ++e) {
    const std::string expert = c10::str("blocks.0.moe.experts.", e);
    modules.push_back({expert, "Sequential", 240, true});
    modules.push_back({expert + ".0", "Linear", 120, false});
    modules.push_back({expert + ".1", "GELU", 0, false});
    modules.push_back({expert + ".2", "Linear", 120, false});
  }
  modules.push_back({"blocks.0.moe.gate", "TopKRouter", 20, false});
  return modules;
}

TEST(PartsToGraph, TakesChildrenWorthAGraphNotOneOperationLayers) {
  // Norm and router Linear are one operation each; the activation has no
  // parameters; a leaf of the model's own class (a router) is a part.
  EXPECT_EQ(parts_to_graph("blocks.0", moe_block_modules()),
            (std::vector<std::string>{"blocks.0.attn", "blocks.0.moe"}));
}

TEST(PartsToGraph, TakesTheElementsOfAModuleListAndKeepsASequentialWhole) {
  EXPECT_EQ(parts_to_graph("blocks.0.moe", moe_block_modules()),
            (std::vector<std::string>{"blocks.0.moe.experts.0", "blocks.0.moe.experts.1",
                                      "blocks.0.moe.gate"}));
}

TEST(PartsToGraph, FindsNothingInsideAnMlpOfSingleOperations) {
  EXPECT_TRUE(parts_to_graph("blocks.0.moe.experts.0", moe_block_modules()).empty());
  EXPECT_TRUE(parts_to_graph("blocks.0.attn", moe_block_modules()).empty());
}

TEST(PartsToGraph, RejectsAnUnknownModule) {
  EXPECT_THROW_WITH(parts_to_graph("blocks.7", moe_block_modules()), Error, "named_modules()");
}

TEST(ValidateModuleSelection, NamesTheProblem) {
  const std::vector<ModuleInfo> modules = gpt_modules(2);
  EXPECT_NO_THROW(validate_module_selection({"blocks.0", "blocks.1"}, modules));
  EXPECT_THROW_WITH(validate_module_selection({"blocks.7"}, modules), Error,
                    "Expected the name of a submodule of the model, got 'blocks.7'");
  EXPECT_THROW_WITH(validate_module_selection({"blocks.0", "blocks.0.mlp"}, modules), Error,
                    "Module 'blocks.0' contains module 'blocks.0.mlp', and both are chosen");
  EXPECT_THROW_WITH(validate_module_selection({"", "head"}, modules), Error,
                    "Module '<root>' contains module 'head'");
  EXPECT_THROW_WITH(validate_module_selection({"head", "head"}, modules), Error, "chosen twice");
  EXPECT_THROW_WITH(validate_module_selection({}, modules), Error, "at least one module");
}

}  // namespace
}  // namespace graphed
