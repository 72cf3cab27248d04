# Install rules: the headers (include/mhc/), libmhc (static, or shared with BUILD_SHARED_LIBS=ON),
# libmhc_cuda when the CUDA backend is built, the CMake package (find_package(mhc): mhc::mhc, and
# mhc::cuda with COMPONENTS cuda) and a pkg-config file for libmhc (mhc.pc).
# Tests, benchmarks, examples, the fuzzer and the Python extension are not installed.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)
set(mhc_cmake_dir "${CMAKE_INSTALL_LIBDIR}/cmake/mhc")

install(TARGETS mhc EXPORT mhcTargets
  ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
  LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
  INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
set(mhc_header_excludes "")
if(NOT MHC_BUILD_CUDA)
  set(mhc_header_excludes PATTERN "cuda.h" EXCLUDE)
endif()
install(DIRECTORY include/mhc DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
  FILES_MATCHING PATTERN "*.h" ${mhc_header_excludes})
install(EXPORT mhcTargets NAMESPACE mhc:: DESTINATION "${mhc_cmake_dir}")

# mhc::cuda in an export set of its own, loaded only for COMPONENTS cuda: a CPU-only user of an
# install that has it never needs the CUDA toolkit.
if(MHC_BUILD_CUDA)
  set_target_properties(mhc_cuda PROPERTIES EXPORT_NAME cuda)
  install(TARGETS mhc_cuda EXPORT mhcCudaTargets ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}")
  install(EXPORT mhcCudaTargets NAMESPACE mhc:: DESTINATION "${mhc_cmake_dir}")
endif()

configure_package_config_file(cmake/mhcConfig.cmake.in "${PROJECT_BINARY_DIR}/mhcConfig.cmake"
  INSTALL_DESTINATION "${mhc_cmake_dir}")
# Before 1.0 a minor release may change the API: only the same MAJOR.MINOR is compatible.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/mhcConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/mhcConfig.cmake" "${PROJECT_BINARY_DIR}/mhcConfigVersion.cmake"
  DESTINATION "${mhc_cmake_dir}")

# mhc.pc, relocatable: paths relative to the file's own folder, so `cmake --install --prefix`
# anywhere works. The static library's users also need MHC_STATIC and the thread library.
set(mhc_pc_dir "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
file(RELATIVE_PATH mhc_pc_prefix "/${mhc_pc_dir}" "/")
string(REGEX REPLACE "/$" "" mhc_pc_prefix "${mhc_pc_prefix}")
if(mhc_type STREQUAL "STATIC_LIBRARY")
  set(mhc_pc_cflags " -DMHC_STATIC")
  set(mhc_pc_libs " -pthread")
  set(mhc_pc_libs_private "")
else()
  set(mhc_pc_cflags "")
  set(mhc_pc_libs "")
  set(mhc_pc_libs_private "-pthread")
endif()
configure_file(cmake/mhc.pc.in "${PROJECT_BINARY_DIR}/mhc.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/mhc.pc" DESTINATION "${mhc_pc_dir}")
