# Finds LibTorch and the CUDA toolkit, for graphed's own build and for programs
# that use graphed through find_package(graphed). It smooths over two ways
# torch's CMake files trip over common installations:
# - torch's CUDA lookup (FindCUDA) starts from the directory of the nvcc on the
#   PATH, which is wrong when that nvcc is a wrapper script; CUDAToolkit asks
#   nvcc itself where the toolkit is;
# - pip wheels of torch keep nvrtc and the math libraries' headers (cusparse.h,
#   which ATen's CUDA headers include) in the nvidia-* packages beside torch,
#   not in a minimal toolkit.
# Defines GRAPHED_CUDA_MATH_INCLUDE_DIR when those headers live outside the toolkit.
include_guard(GLOBAL)

find_package(CUDAToolkit REQUIRED)
if(NOT CUDA_TOOLKIT_ROOT_DIR)
  set(CUDA_TOOLKIT_ROOT_DIR "${CUDAToolkit_LIBRARY_ROOT}")
endif()

# torch.utils.cmake_prefix_path is <site-packages>/torch/share/cmake.
set(_graphed_nvidia_roots)
foreach(_graphed_prefix IN LISTS CMAKE_PREFIX_PATH)
  list(APPEND _graphed_nvidia_roots "${_graphed_prefix}/../../../nvidia/cu13"
                                    "${_graphed_prefix}/../../../nvidia/cuda_nvrtc")
endforeach()
find_library(CUDA_nvrtc_LIBRARY NAMES nvrtc libnvrtc.so.13 libnvrtc.so.12
  HINTS "${CUDAToolkit_LIBRARY_DIR}" ${_graphed_nvidia_roots} PATH_SUFFIXES lib)

find_path(_graphed_toolkit_math_include cusparse.h HINTS ${CUDAToolkit_INCLUDE_DIRS}
          NO_DEFAULT_PATH)
if(NOT _graphed_toolkit_math_include)
  find_path(GRAPHED_CUDA_MATH_INCLUDE_DIR cusparse.h HINTS ${_graphed_nvidia_roots}
            PATH_SUFFIXES include)
endif()

# TorchConfig wants target architectures: Hopper, with PTX for newer GPUs (the
# same targets graphed compiles its own kernels for, CMAKE_CUDA_ARCHITECTURES).
if(NOT TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "9.0+PTX")
endif()
find_package(Torch REQUIRED)
