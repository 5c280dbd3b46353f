# meshrt_add_mpi_test(NAME <name> SOURCES <src>... NP <ranks> [TIMEOUT <s>] [LABELS <l>...]
#                     [LIBRARIES <lib>...] [ARGS <arg>...])
#   Builds a GoogleTest binary with meshrt's MPI test main (MPI init/finalize, failures
#   of every rank reported, a watchdog that aborts a hung job) and registers it with
#   CTest as: MPIEXEC_EXECUTABLE MPIEXEC_NUMPROC_FLAG <np> MPIEXEC_PREFLAGS <binary>
#   MPIEXEC_POSTFLAGS <args>.
#
# meshrt_add_mpi_command_test(NAME <name> NP <ranks> COMMAND <exe> [args...]
#                             [TIMEOUT <s>] [LABELS <l>...] [EXPECT <regex>...])
#   Registers any program (an example, a tool) the same way. With EXPECT, the test also
#   requires every regex in the output (and still a zero exit code).
#
# Both work as root and oversubscribed on a small machine: the Open MPI settings below
# are passed in the test's environment (MPICH ignores them). Every test has a timeout
# and runs serially so that `ctest -j` cannot starve it.
include_guard(GLOBAL)
set(MESHRT_TESTING_DIR "${CMAKE_CURRENT_LIST_DIR}")

if(NOT MPIEXEC_EXECUTABLE)
  find_package(MPI REQUIRED COMPONENTS CXX)
endif()

set(MESHRT_MPI_TEST_ENVIRONMENT
  OMPI_ALLOW_RUN_AS_ROOT=1
  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OMPI_MCA_rmaps_base_oversubscribe=1
  # Without it oversubscribed ranks busy-poll and run about 1000x slower.
  OMPI_MCA_mpi_yield_when_idle=1
  PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
  CACHE STRING "Environment of every MPI test")

# Single copy (issue 16). Open MPI's shared-memory transport (vader) moves a message above
# its 4 KiB eager limit with one copy through the kernel (CMA: process_vm_readv), which
# needs ptrace rights over the peer; containers often forbid that, and the transfer then
# fails ("Read -1, expected N, errno = 1"). Turning single copy off
# (OMPI_MCA_btl_vader_single_copy_mechanism=none) makes every large message go twice
# through a shared buffer instead: about 5x slower at 1 MiB on the project's machine
# (87 us one-way with CMA, ~450 us without). So it is decided by a probe, once per build
# folder: two ranks exchange 1 MiB with the default mechanism and check it; only if that
# fails (or hangs for 20 s) do the tests run with single copy off. The result is cached
# as MESHRT_MPI_SINGLE_COPY (set it OFF to force it off); scripts/common.sh reads it.
# Caches written before the probe existed hold the setting unconditionally: drop it.
set(_meshrt_mpi_env ${MESHRT_MPI_TEST_ENVIRONMENT})
list(REMOVE_ITEM _meshrt_mpi_env OMPI_MCA_btl_vader_single_copy_mechanism=none)
if(NOT DEFINED MESHRT_MPI_SINGLE_COPY AND TARGET MPI::MPI_CXX)
  set(_dir ${CMAKE_BINARY_DIR}/meshrt_single_copy_probe)
  file(WRITE ${_dir}/probe.cpp [=[
// Written by MeshrtTesting.cmake: rank 0 sends 1 MiB to rank 1, which checks every byte.
#include <mpi.h>
#include <vector>
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<unsigned char> buf(1 << 20, rank == 0 ? 0x5a : 0);
  if (rank == 0) MPI_Send(buf.data(), 1 << 20, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
  if (rank == 1) MPI_Recv(buf.data(), 1 << 20, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  int bad = 0;
  for (unsigned char c : buf) bad += c != 0x5a;
  MPI_Finalize();
  return bad == 0 ? 0 : 3;
}
]=])
  try_compile(_built ${_dir}/build SOURCES ${_dir}/probe.cpp LINK_LIBRARIES MPI::MPI_CXX
              COPY_FILE ${_dir}/probe OUTPUT_VARIABLE _log)
  set(_rc "the probe did not build")
  if(_built)
    find_program(MESHRT_TIMEOUT_EXECUTABLE timeout)
    set(_limit)
    if(MESHRT_TIMEOUT_EXECUTABLE)
      set(_limit ${MESHRT_TIMEOUT_EXECUTABLE} -k 5 20)  # ends mpiexec and its ranks
    endif()
    execute_process(
      COMMAND ${CMAKE_COMMAND} -E env --unset=OMPI_MCA_btl_vader_single_copy_mechanism ${_meshrt_mpi_env}
              ${_limit} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${MPIEXEC_PREFLAGS} ${_dir}/probe
      RESULT_VARIABLE _rc OUTPUT_VARIABLE _log ERROR_VARIABLE _log TIMEOUT 40)
  endif()
  if(_rc STREQUAL "0")
    set(_works ON)
    message(STATUS "MPI shared-memory single copy: works (MPI tests run with it)")
  else()
    set(_works OFF)
    message(STATUS "MPI shared-memory single copy: does not work here (probe: ${_rc}); MPI tests run with "
                   "OMPI_MCA_btl_vader_single_copy_mechanism=none, large messages about 5x slower")
  endif()
  set(MESHRT_MPI_SINGLE_COPY ${_works} CACHE BOOL "Open MPI's shared-memory single copy works here (probed once)")
endif()
if(DEFINED MESHRT_MPI_SINGLE_COPY AND NOT MESHRT_MPI_SINGLE_COPY)
  list(APPEND _meshrt_mpi_env OMPI_MCA_btl_vader_single_copy_mechanism=none)
endif()
# Sanitizer runs (MESHRT_SANITIZE, see CMakePresets.json): every report fails the test;
# the suppressions in tests/sanitizers/ cover only Open MPI and the libraries under it,
# which are not built with sanitizers. A normal variable, so a cached environment from an
# earlier configure cannot hide it.
set(MESHRT_SANITIZER_TEST_ENVIRONMENT)      # unit tests (no Open MPI inside)
set(MESHRT_SANITIZER_MPI_TEST_ENVIRONMENT)  # tests under mpiexec
option(MESHRT_SANITIZE_MPI_LEAKS "Leak-check the MPI tests too (slow unwinder: several times slower)" OFF)
if(MESHRT_SANITIZE)
  set(_supp ${PROJECT_SOURCE_DIR}/tests/sanitizers)
  set(_ubsan "UBSAN_OPTIONS=suppressions=${_supp}/ubsan.supp:print_stacktrace=1:halt_on_error=1")
  # history_size=7 (the most): a suppression for Open MPI's copies can only match a
  # previous access whose stack TSan still restores; see tests/sanitizers/tsan.supp.
  set(_tsan "TSAN_OPTIONS=suppressions=${_supp}/tsan.supp:halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:history_size=7")
  set(_lsan "LSAN_OPTIONS=suppressions=${_supp}/lsan.supp:print_suppressions=0")
  list(APPEND MESHRT_SANITIZER_TEST_ENVIRONMENT "ASAN_OPTIONS=detect_leaks=1:abort_on_error=1" ${_lsan} ${_ubsan} ${_tsan})
  if(MESHRT_SANITIZE_MPI_LEAKS)
    # Open MPI is built without frame pointers: only the slow unwinder gives leak stacks
    # that reach its libraries (so lsan.supp matches), and its components must stay
    # loaded at exit or their frames show as "<unknown module>". Every malloc then
    # unwinds fully: runtime_2x2's 10^5-call test outlives its timeout.
    list(APPEND MESHRT_SANITIZER_MPI_TEST_ENVIRONMENT
      "ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:fast_unwind_on_malloc=0")
  else()
    # Open MPI's exit-time allocations cannot be told from meshrt's with the fast
    # unwinder (its frames are garbage), so the MPI tests check memory errors and UB
    # only; leaks in meshrt's own code are checked by the unit tests.
    list(APPEND MESHRT_SANITIZER_MPI_TEST_ENVIRONMENT "ASAN_OPTIONS=detect_leaks=0:abort_on_error=1")
  endif()
  # Open MPI's components stay loaded at exit: TSan refuses a called_from_lib
  # suppression whose library was unloaded, and LSan cannot name its frames.
  list(APPEND MESHRT_SANITIZER_MPI_TEST_ENVIRONMENT ${_lsan} ${_ubsan} ${_tsan} "OMPI_MCA_mca_base_component_disable_dlclose=1")
endif()
set(MESHRT_MPI_TEST_ENVIRONMENT ${_meshrt_mpi_env} ${MESHRT_SANITIZER_MPI_TEST_ENVIRONMENT})

set(MESHRT_MPI_TEST_DEFAULT_TIMEOUT 60 CACHE STRING "Default timeout of an MPI test, in seconds")

function(meshrt_add_mpi_command_test)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME;NP;TIMEOUT" "COMMAND;LABELS;EXPECT")
  if(NOT arg_NAME OR NOT arg_NP OR NOT arg_COMMAND)
    message(FATAL_ERROR "meshrt_add_mpi_command_test: NAME, NP and COMMAND are required")
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT ${MESHRT_MPI_TEST_DEFAULT_TIMEOUT})
  endif()
  list(POP_FRONT arg_COMMAND _exe)
  if(TARGET ${_exe})
    set(_exe $<TARGET_FILE:${_exe}>)
  endif()
  set(_wrap)
  if(arg_EXPECT)
    set(_wrap ${MESHRT_TESTING_DIR}/meshrt_expect_output.sh ${arg_EXPECT} --)
  endif()
  add_test(NAME ${arg_NAME}
           COMMAND ${_wrap} ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${arg_NP} ${MPIEXEC_PREFLAGS}
                   ${_exe} ${MPIEXEC_POSTFLAGS} ${arg_COMMAND})
  # The watchdog in the test main fires a little before CTest's timeout, so a hung rank
  # is named in the output and MPI_Abort takes every process down with it.
  math(EXPR _watchdog "${arg_TIMEOUT} * 9 / 10")
  set_tests_properties(${arg_NAME} PROPERTIES
    TIMEOUT ${arg_TIMEOUT}
    RUN_SERIAL TRUE
    PROCESSORS ${arg_NP}
    LABELS "mpi;${arg_LABELS}"
    ENVIRONMENT "${MESHRT_MPI_TEST_ENVIRONMENT};MESHRT_TEST_WATCHDOG=${_watchdog}")
endfunction()

function(meshrt_add_mpi_test)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME;NP;TIMEOUT" "SOURCES;LABELS;LIBRARIES;ARGS")
  if(NOT arg_NAME OR NOT arg_SOURCES OR NOT arg_NP)
    message(FATAL_ERROR "meshrt_add_mpi_test: NAME, SOURCES and NP are required")
  endif()
  add_executable(${arg_NAME} ${arg_SOURCES})
  target_link_libraries(${arg_NAME} PRIVATE meshrt::gtest_main ${arg_LIBRARIES})
  set(_timeout)
  if(arg_TIMEOUT)
    set(_timeout TIMEOUT ${arg_TIMEOUT})
  endif()
  meshrt_add_mpi_command_test(NAME ${arg_NAME} NP ${arg_NP} ${_timeout} LABELS ${arg_LABELS}
                              COMMAND ${arg_NAME} ${arg_ARGS})
endfunction()
