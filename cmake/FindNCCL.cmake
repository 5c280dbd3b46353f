# FindNCCL
# --------
# Finds NVIDIA's NCCL. Looks under NCCL_ROOT (variable or environment), then under the
# CUDA toolkit's root, then the system. Defines NCCL_FOUND, NCCL_VERSION and NCCL::nccl;
# find_package(NCCL <version>) refuses an older one.
include(FindPackageHandleStandardArgs)

set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_hints "${CUDAToolkit_LIBRARY_ROOT}")
endif()
if(CUDAToolkit_BIN_DIR)
  get_filename_component(_nccl_cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  list(APPEND _nccl_hints "${_nccl_cuda_root}")
endif()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
# libnccl.so.2 too: pip's nvidia-nccl wheels ship no unversioned link.
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_major REGEX "^#define NCCL_MAJOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_minor REGEX "^#define NCCL_MINOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_patch REGEX "^#define NCCL_PATCH +[0-9]+")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _nccl_major "${_nccl_major}")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _nccl_minor "${_nccl_minor}")
  string(REGEX REPLACE ".* ([0-9]+)$" "\\1" _nccl_patch "${_nccl_patch}")
  set(NCCL_VERSION "${_nccl_major}.${_nccl_minor}.${_nccl_patch}")
endif()

find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
