// See nvtx_recorder.h. NVTX v3 finds a tool through the exported C function
// InitializeInjectionNvtx2, which replaces the entry points it implements in
// the table of NVTX's core module; the others stay no-ops.

#include "nvtx_recorder.h"

// Declarations only: this library is an NVTX tool, not an NVTX user.
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <atomic>
#include <mutex>

namespace {

std::mutex events_mutex;
std::vector<std::string> events;
std::atomic<bool> attached{false};

int record_push(const char* name) {
  std::lock_guard<std::mutex> lock(events_mutex);
  events.push_back(std::string("push ") + (name == nullptr ? "" : name));
  return 0;
}

int record_pop() {
  std::lock_guard<std::mutex> lock(events_mutex);
  events.emplace_back("pop");
  return 0;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjectionNvtx2(
    NvtxGetExportTableFunc_t get_export_table) {
  const auto* callbacks =
      static_cast<const NvtxExportTableCallbacks*>(get_export_table(NVTX_ETID_CALLBACKS));
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (callbacks == nullptr ||
      !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size) ||
      size <= NVTX_CBID_CORE_RangePop) {
    return 0;
  }
  *table[NVTX_CBID_CORE_RangePushA] = reinterpret_cast<NvtxFunctionPointer>(&record_push);
  *table[NVTX_CBID_CORE_RangePop] = reinterpret_cast<NvtxFunctionPointer>(&record_pop);
  attached = true;
  return 1;
}

namespace graphed::nvtx_test {

bool nvtx_recorder_attached() { return attached; }

std::vector<std::string> take_nvtx_events() {
  std::lock_guard<std::mutex> lock(events_mutex);
  std::vector<std::string> taken;
  taken.swap(events);
  return taken;
}

}  // namespace graphed::nvtx_test
