#include "graphed/module_selection.h"

#include "graphed/check.h"

#include <algorithm>
#include <sstream>
#include <unordered_map>

namespace graphed {

namespace {

// True when `inner` is `outer` or lies inside it ("blocks.0.mlp" in "blocks.0").
bool is_within(const std::string& inner, const std::string& outer) {
  if (outer.empty()) return true;
  return inner == outer ||
         (inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 &&
          inner[outer.size()] == '.');
}

std::string parent_of(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

std::string shown(const std::string& name) { return name.empty() ? "<root>" : name; }

// torch.nn layers that run one operation (or one fused kernel): see Note
// [Graphing the parts of a block]. HF GPT-2's Conv1D is a Linear.
bool is_single_operation_layer(const ModuleInfo& module) {
  static const char* const kSingle[] = {
      "Linear", "NonDynamicallyQuantizableLinear", "Conv1D", "Embedding", "EmbeddingBag",
      "LayerNorm", "GroupNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
      "InstanceNorm1d", "InstanceNorm2d", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d",
      "ConvTranspose2d", "Dropout", "Identity"};
  for (const char* name : kSingle) {
    if (module.type == name) return true;
  }
  return false;
}

}  // namespace

std::vector<std::string> parts_to_graph(const std::string& blocked,
                                        const std::vector<ModuleInfo>& modules) {
  std::unordered_map<std::string, size_t> index_of;
  for (size_t i = 0; i < modules.size(); ++i) index_of[modules[i].name] = i;
  GRAPHED_CHECK(index_of.count(blocked) != 0, "Expected '", shown(blocked),
                "' to be a module of the model, but named_modules() has no such name.");
  std::unordered_map<std::string, bool> has_children;
  for (const ModuleInfo& module : modules) {
    if (!module.name.empty()) has_children[parent_of(module.name)] = true;
  }
  // Children of `parent`, a container's elements standing for the container.
  std::vector<std::string> parts;
  std::vector<std::string> pending{blocked};
  while (!pending.empty()) {
    const std::string parent = pending.back();
    pending.pop_back();
    for (const ModuleInfo& module : modules) {
      if (module.name.empty() || module.name == parent || parent_of(module.name) != parent) {
        continue;
      }
      // A ModuleList or ModuleDict has no forward: its elements are called.
      // A Sequential has one, and is a part like any other.
      if (module.is_container && module.type != "Sequential") {
        pending.push_back(module.name);
      } else if (module.parameters > 0 &&
                 !(is_single_operation_layer(module) && !has_children[module.name])) {
        parts.push_back(module.name);
      }
    }
  }
  std::sort(parts.begin(), parts.end(), [&](const std::string& a, const std::string& b) {
    return index_of[a] < index_of[b];
  });
  return parts;
}

std::vector<std::string> select_repeated_blocks(const std::vector<ModuleInfo>& modules) {
  struct Group {
    std::vector<std::string> names;
    int64_t parameters = 0;
    size_t first_index = 0;
  };
  std::unordered_map<std::string, size_t> index_of;
  for (size_t i = 0; i < modules.size(); ++i) index_of[modules[i].name] = i;

  const auto in_container = [&](const ModuleInfo& module) {
    if (module.name.empty()) return false;
    const auto parent = index_of.find(parent_of(module.name));
    return parent != index_of.end() && modules[parent->second].is_container;
  };
  // How many children of each container have each class, as their own class
  // or as a base.
  std::unordered_map<std::string, int64_t> children_with;  // "container\0class" -> count
  for (const ModuleInfo& module : modules) {
    if (!in_container(module)) continue;
    const std::string container = parent_of(module.name) + '\0';
    ++children_with[container + module.type];
    for (const std::string& base : module.bases) ++children_with[container + base];
  }

  // Children of each container, grouped by their own class if a sibling
  // shares it, else by their nearest base a sibling shares.
  std::vector<Group> groups;
  std::unordered_map<std::string, size_t> group_of;  // "container\0class" -> group
  for (size_t i = 0; i < modules.size(); ++i) {
    const ModuleInfo& module = modules[i];
    if (!in_container(module)) continue;
    const std::string container = parent_of(module.name) + '\0';
    std::string group_key = container + module.type;
    if (children_with[group_key] < 2) {
      for (const std::string& base : module.bases) {
        if (children_with[container + base] >= 2) {
          group_key = container + base;
          break;
        }
      }
    }
    auto [found, inserted] = group_of.emplace(group_key, groups.size());
    if (inserted) {
      groups.push_back(Group{{}, 0, i});
    }
    Group& group = groups[found->second];
    group.names.push_back(module.name);
    group.parameters += module.parameters;
  }
  groups.erase(std::remove_if(groups.begin(), groups.end(),
                              [](const Group& g) { return g.names.size() < 2; }),
               groups.end());
  std::stable_sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    return a.parameters > b.parameters;
  });
  std::vector<std::string> chosen;
  std::vector<size_t> chosen_groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    bool overlaps = false;
    for (const std::string& name : groups[g].names) {
      for (const std::string& taken : chosen) {
        overlaps = overlaps || is_within(name, taken) || is_within(taken, name);
      }
    }
    if (overlaps) continue;
    chosen.insert(chosen.end(), groups[g].names.begin(), groups[g].names.end());
    chosen_groups.push_back(g);
  }
  if (chosen.empty()) {
    return {std::string()};
  }
  // Back to the model's order, so that stats list modules as the model does.
  std::sort(chosen.begin(), chosen.end(), [&](const std::string& a, const std::string& b) {
    return index_of[a] < index_of[b];
  });
  return chosen;
}

void validate_module_selection(const std::vector<std::string>& chosen,
                               const std::vector<ModuleInfo>& modules) {
  GRAPHED_CHECK(!chosen.empty(), "Expected at least one module to capture, got none. Pass "
                "modules=None to capture the largest repeated blocks, or name the modules "
                "(e.g. modules=[\"blocks.0\"] or modules=[MyBlock]).");
  std::unordered_map<std::string, bool> known;
  for (const ModuleInfo& module : modules) known[module.name] = true;
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (known.count(chosen[i]) == 0) {
      std::ostringstream names;
      size_t listed = 0;
      for (const ModuleInfo& module : modules) {
        if (listed == 12) {
          names << ", ...";
          break;
        }
        names << (listed == 0 ? "" : ", ") << "'" << module.name << "'";
        ++listed;
      }
      GRAPHED_THROW(Error, "Expected the name of a submodule of the model, got '", chosen[i],
                    "'. Names are those of model.named_modules(): ", names.str(), ".");
    }
    for (size_t j = 0; j < chosen.size(); ++j) {
      if (i == j) continue;
      GRAPHED_CHECK(chosen[i] != chosen[j], "Module '", shown(chosen[i]),
                    "' is chosen twice; list each module once.");
      GRAPHED_CHECK(!is_within(chosen[j], chosen[i]), "Module '", shown(chosen[i]),
                    "' contains module '", shown(chosen[j]), "', and both are chosen. A graph "
                    "of the outer module already records the inner one; choose one of them.");
    }
  }
}

}  // namespace graphed
