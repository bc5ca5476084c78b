#pragma once

/// \file module_selection.h
/// Which modules of a model graphed.auto manages: by default the largest
/// repeated blocks (select_repeated_blocks), or the user's choice, checked by
/// validate_module_selection. Pure host logic on a description of the model's
/// modules (ModuleInfo), built by python/graphed/auto.py.

#include <cstdint>
#include <string>
#include <vector>

namespace graphed {

/// A module of the model, as module selection sees it.
struct ModuleInfo {
  /// Qualified name ("" for the root, "blocks.0", "blocks.0.mlp").
  std::string name;
  /// Class name, e.g. "GPTBlock".
  std::string type;
  /// Parameters of the module and its descendants (elements).
  int64_t parameters = 0;
  /// True for containers of repeated children (ModuleList, Sequential).
  bool is_container = false;
  /// Names of the classes `type` derives from, nearest first (Module itself
  /// left out): a layer subclassed to change one block still repeats its
  /// siblings (Note [Choosing repeated blocks]).
  std::vector<std::string> bases;
};

/// The modules graphed.auto captures by default: the largest repeated blocks.
///
/// Note [Choosing repeated blocks]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// Repeated blocks are the children of one container (ModuleList, Sequential)
/// that share a class with at least one sibling: a transformer's layers, a
/// residual MLP's blocks. A child whose own class has no sibling joins the
/// siblings of its nearest base class, so that one layer replaced by a
/// subclass (a block with logging, say) is still managed with the others,
/// and if it cannot be captured it is counted as a fallback rather than
/// silently left out. Each such group is a candidate; candidates are
/// taken by the parameters they cover, largest first, skipping any that
/// nests within or contains one already taken, so that a model's layers win
/// over the Linear layers inside each of them and an encoder and a decoder
/// are both taken. Graphing at this level keeps graphs few and large (one
/// launch per layer), leaves code between layers (embeddings, losses, host
/// logic) eager, and gives the graphs of a layer one signature per call
/// size. Without any repeated block the whole model ("") is captured.
/// `modules` lists every module in named_modules() order.
std::vector<std::string> select_repeated_blocks(const std::vector<ModuleInfo>& modules);

/// The parts of module `blocked` that graphed.auto graphs when `blocked`
/// itself cannot be captured: see Note [Graphing the parts of a block].
/// `modules` lists every module in named_modules() order; returns names in
/// that order. Throws graphed::Error when `blocked` is not among them.
///
/// Note [Graphing the parts of a block]
/// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
/// One operation that cannot be captured (a nonzero, a host read, a copy
/// from pageable memory) sends a whole block back to eager, attention and
/// all. Megatron's answer for mixture-of-experts layers is to graph what can
/// be graphed inside the layer (attention, router) and leave the token
/// dispatch eager; graphed.auto does the same at module granularity, on
/// demand: once a managed module falls back for good, its children are
/// managed in its place, each warmed up, checked and captured on its own
/// (training graphs of the parts captured together as one more training
/// group), and a part that cannot be captured either is descended into in
/// turn. The children taken are those worth a graph: the elements of a
/// ModuleList or ModuleDict child (a list of experts) stand for it; a child without
/// parameters (an activation, a dropout, a rotary table) and a leaf that is
/// one torch operation (Linear, Embedding, the torch norms, convolutions)
/// are left out, because a graph of one kernel replays no faster than the
/// kernel launches, while its copies in and out cost more. Parts are also
/// managed with steady shapes only (ModuleSpec::steady_shapes): an expert
/// whose token count changes from call to call would need a graph per
/// count, so a part whose warm-up calls come at different shapes stays
/// eager, with that reason in stats(). Operations of the block outside any
/// part (the dispatch loop, the functional attention of a hand-written block)
/// run eagerly between the parts' replays.
std::vector<std::string> parts_to_graph(const std::string& blocked,
                                        const std::vector<ModuleInfo>& modules);

/// Checks a user's choice of modules: every name exists in `modules` and no
/// chosen module contains another. Throws graphed::Error naming the problem
/// and the fix.
void validate_module_selection(const std::vector<std::string>& chosen,
                               const std::vector<ModuleInfo>& modules);

}  // namespace graphed
