# Every dependency is found the standard way; CUDA and NCCL are optional.
find_package(MPI 3.0 REQUIRED COMPONENTS CXX)
# Boost.Stacktrace's libbacktrace backend names a crash's frames with file:line (Debian:
# libboost-stacktrace-dev).
find_package(Boost 1.74 REQUIRED COMPONENTS serialization log log_setup stacktrace_backtrace)
find_package(fmt REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(Threads REQUIRED)
# DLPack is one header (Debian: libdlpack-dev), used inside libmeshrt only: the installed
# tensor.hpp forward-declares DLManagedTensor.
find_path(DLPACK_INCLUDE_DIR dlpack/dlpack.h)
if(NOT DLPACK_INCLUDE_DIR)
  message(FATAL_ERROR "meshrt needs dlpack/dlpack.h (Debian: apt-get install libdlpack-dev), found none; "
                      "set DLPACK_INCLUDE_DIR to the folder that holds dlpack/dlpack.h")
endif()
# GoogleTest for meshrt's own tests and the testing component (meshrt::gtest_main for
# users' MPI tests); the runtime itself builds without it.
if(MESHRT_BUILD_TESTS)
  find_package(GTest REQUIRED)
else()
  find_package(GTest)
endif()
set(MESHRT_HAVE_GTEST ${GTest_FOUND})
if(MESHRT_BUILD_APPS)
  find_package(benchmark REQUIRED)
endif()

set(MESHRT_HAVE_CUDA OFF)
set(MESHRT_HAVE_NCCL OFF)
string(TOUPPER "${MESHRT_WITH_CUDA}" _meshrt_cuda)
if(NOT _meshrt_cuda STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Hopper (H100/H200) and Ampere; override with -DCMAKE_CUDA_ARCHITECTURES=... (in the
      # cache, so that what a build was made for can be read back: gpu-bundle.sh's MANIFEST).
      set(CMAKE_CUDA_ARCHITECTURES 80 90 CACHE STRING "The GPU architectures meshrt's CUDA kernels are built for")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    # 2.14: non-blocking communicators (ncclConfig_t), ncclCommFinalize and the async
    # error of an in-progress call, which the device layer's deadlines rest on.
    find_package(NCCL 2.14)
    if(NCCL_FOUND)
      set(MESHRT_HAVE_CUDA ON)
      set(MESHRT_HAVE_NCCL ON)
    elseif(_meshrt_cuda STREQUAL "ON")
      message(FATAL_ERROR "MESHRT_WITH_CUDA=ON but NCCL was not found: set NCCL_ROOT to the folder that holds include/nccl.h")
    else()
      message(STATUS "meshrt: CUDA found but NCCL not; building without the CUDA side")
    endif()
  elseif(_meshrt_cuda STREQUAL "ON")
    message(FATAL_ERROR "MESHRT_WITH_CUDA=ON but no CUDA compiler was found: put nvcc on PATH or set CMAKE_CUDA_COMPILER")
  else()
    message(STATUS "meshrt: no CUDA compiler; building without the CUDA side")
  endif()
endif()

# The Python package (python/, docs/python.md): Debian's own Python 3 (the interpreter its
# python3-* packages install into, /usr/bin/python3), never the first python3 on PATH, and
# Debian's pybind11. AUTO builds it when both are found.
set(MESHRT_HAVE_PYTHON OFF)
string(TOUPPER "${MESHRT_PYTHON}" _meshrt_python)
if(NOT _meshrt_python STREQUAL "OFF")
  if(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python3_EXECUTABLE /usr/bin/python3 CACHE FILEPATH "The Python the meshrt package is built for")
  endif()
  find_package(Python3 3.9 COMPONENTS Interpreter Development.Module)
  if(Python3_FOUND)
    find_package(pybind11 2.6 CONFIG)
  endif()
  if(Python3_FOUND AND pybind11_FOUND)
    set(MESHRT_HAVE_PYTHON ON)
  elseif(_meshrt_python STREQUAL "ON")
    message(FATAL_ERROR "MESHRT_PYTHON=ON but Python 3 development files or pybind11 were not found "
                        "(Debian: apt-get install python3-dev pybind11-dev)")
  else()
    message(STATUS "meshrt: Python 3 development files or pybind11 not found; building without the Python package")
  endif()
endif()
