# Exports meshrt as a CMake package, usable from the build tree and from an install
# prefix: find_package(meshrt CONFIG) gives meshrt::meshrt; the testing component adds
# meshrt::gtest_main and meshrt_add_mpi_test(), the cuda component meshrt::cuda
# (cmake/meshrtConfig.cmake.in).
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

set(MESHRT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/meshrt)

install(TARGETS meshrt EXPORT meshrtTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# The test main (it needs GTest) in its own export set: only the testing component loads it.
if(MESHRT_HAVE_GTEST)
  install(TARGETS meshrt_gtest_main EXPORT meshrtTestingTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
endif()
# include/meshrt/internal/ (the wire protocol, the transport, the worker, the device
# runtime, settings) is the library's own: not installed.
install(DIRECTORY include/meshrt DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} PATTERN internal EXCLUDE)
install(FILES ${PROJECT_BINARY_DIR}/include/meshrt/config.hpp DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/meshrt)
install(EXPORT meshrtTargets NAMESPACE meshrt:: DESTINATION ${MESHRT_INSTALL_CMAKEDIR})
export(EXPORT meshrtTargets NAMESPACE meshrt:: FILE ${PROJECT_BINARY_DIR}/meshrtTargets.cmake)
if(MESHRT_HAVE_GTEST)
  install(EXPORT meshrtTestingTargets NAMESPACE meshrt:: DESTINATION ${MESHRT_INSTALL_CMAKEDIR})
  export(EXPORT meshrtTestingTargets NAMESPACE meshrt:: FILE ${PROJECT_BINARY_DIR}/meshrtTestingTargets.cmake)
endif()

write_basic_package_version_file(${PROJECT_BINARY_DIR}/meshrtConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
# Build tree: the config finds MeshrtTesting.cmake in the source tree.
set(MESHRT_CONFIG_CMAKE_DIR "${PROJECT_SOURCE_DIR}/cmake")
configure_file(cmake/meshrtConfig.cmake.in ${PROJECT_BINARY_DIR}/meshrtConfig.cmake @ONLY)
# Install prefix: next to the config file.
set(MESHRT_CONFIG_CMAKE_DIR "\${CMAKE_CURRENT_LIST_DIR}")
configure_file(cmake/meshrtConfig.cmake.in ${PROJECT_BINARY_DIR}/install/meshrtConfig.cmake @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/install/meshrtConfig.cmake
              ${PROJECT_BINARY_DIR}/meshrtConfigVersion.cmake
              cmake/MeshrtTesting.cmake
        DESTINATION ${MESHRT_INSTALL_CMAKEDIR})
install(PROGRAMS cmake/meshrt_expect_output.sh DESTINATION ${MESHRT_INSTALL_CMAKEDIR})

# A module file for Lmod and Environment Modules, written at install time so that it names
# the prefix actually installed to (cmake --install --prefix ...):
# <prefix>/share/modulefiles/meshrt/<version>; `module use <prefix>/share/modulefiles`.
set(MESHRT_MPI_DESCRIPTION "its mpiexec: ${MPIEXEC_EXECUTABLE}")
set(MESHRT_MODULE_PYTHON "")
if(MESHRT_HAVE_PYTHON)
  set(MESHRT_MODULE_PYTHON "prepend-path PYTHONPATH $prefix/${MESHRT_PYTHON_INSTALL_DIR}")
endif()
set(MESHRT_MODULE_PREFIX "@MESHRT_MODULE_PREFIX@")  # kept for the install-time pass
configure_file(cmake/meshrt.modulefile.in ${PROJECT_BINARY_DIR}/modulefile.in @ONLY)
install(CODE "
  set(MESHRT_MODULE_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
  configure_file(\"${PROJECT_BINARY_DIR}/modulefile.in\"
                 \"${PROJECT_BINARY_DIR}/install/modulefiles/meshrt/${PROJECT_VERSION}\" @ONLY)
")
install(FILES ${PROJECT_BINARY_DIR}/install/modulefiles/meshrt/${PROJECT_VERSION}
        DESTINATION ${CMAKE_INSTALL_DATADIR}/modulefiles/meshrt)
