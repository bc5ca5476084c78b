#pragma once

// An NVTX tool for tests/cpp/test_nvtx.cpp: a shared library that NVTX loads
// when NVTX_INJECTION64_PATH names it (ctest sets it for test_nvtx), and that
// records every range pushed and popped in the process, as a profiler would.

#include <string>
#include <vector>

namespace graphed::nvtx_test {

// True once NVTX loaded this library as its tool (on the process's first
// NVTX call).
bool nvtx_recorder_attached();

// The events recorded since the last call: "push <name>" and "pop", in order.
std::vector<std::string> take_nvtx_events();

}  // namespace graphed::nvtx_test
