#pragma once

// Helpers shared by graphed's C++ tests.

#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>

#include <string>

// Skips the current test, with the reason, on a machine without a CUDA device.
#define GRAPHED_REQUIRE_GPU()                                                        \
  do {                                                                               \
    if (c10::cuda::device_count() == 0) {                                            \
      GTEST_SKIP() << "needs an NVIDIA GPU: CUDA reports no device on this machine"; \
    }                                                                                \
  } while (false)

// Asserts that `statement` throws `ErrorType` whose message contains `needle`.
#define EXPECT_THROW_WITH(statement, ErrorType, needle)                                \
  do {                                                                                 \
    try {                                                                              \
      statement;                                                                       \
      ADD_FAILURE() << "expected " #ErrorType " from " #statement;                     \
    } catch (const ErrorType& error) {                                                 \
      const std::string message = error.what_without_backtrace();                      \
      EXPECT_NE(message.find(needle), std::string::npos)                               \
          << "message does not mention \"" << (needle) << "\":\n" << message;          \
    }                                                                                  \
  } while (false)
