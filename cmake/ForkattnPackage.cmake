# ForkattnPackage.cmake -- `cmake --install`: libraries (VERSION/SOVERSION), the headers,
# the command-line program, a CMake package exporting forkattn::forkattn (and
# forkattn::forkattn_static in CPU builds) with a same-major version file, and forkattn.pc.
# FORKATTN_PYTHON_WHEEL: the library alone (the wheel's forkattn/ folder is the prefix);
# FORKATTN_BUNDLE_OFFLOAD_RUNTIME: every library it loads beyond glibc and the compiler runtime
# (LLVM's offload runtime, OpenBLAS, hwloc, ...) beside it (ForkattnBundleRuntime.cmake).
include(CMakePackageConfigHelpers)

if(FORKATTN_PYTHON_WHEEL)
  set(_fa_libdir .)
else()
  set(_fa_libdir ${CMAKE_INSTALL_LIBDIR})
endif()
set(_fa_bundle OFF)
if(FORKATTN_BUNDLE_OFFLOAD_RUNTIME AND FORKATTN_HAVE_OFFLOAD)
  set(_fa_bundle ON)
elseif(FORKATTN_BUNDLE_OFFLOAD_RUNTIME AND NOT FORKATTN_PYTHON_WHEEL)
  message(WARNING "FORKATTN_BUNDLE_OFFLOAD_RUNTIME=ON in a CPU build (FORKATTN_OFFLOAD=OFF): nothing to bundle")
endif()
if(FORKATTN_PYTHON_WHEEL OR _fa_bundle)
  # the bundled runtime (or, in a wheel, nothing but the system's) lies beside the library
  set_target_properties(forkattn PROPERTIES INSTALL_RPATH "$ORIGIN")
endif()

# Install rule: the libraries it loads beside the installed library (named FILE_NAME in
# _fa_libdir), whose runpath then becomes $ORIGIN alone: the build's LLVM libdir would come first.
set(_fa_system_libs ${CMAKE_CURRENT_LIST_DIR}/forkattn_system_libraries.txt)
function(_fa_install_bundled_runtime file_name)
  if(IS_ABSOLUTE "${_fa_libdir}")
    set(dest "${_fa_libdir}")
  else()
    set(dest "\${CMAKE_INSTALL_PREFIX}/${_fa_libdir}")
  endif()
  install(CODE "set(FORKATTN_BUNDLE_LIB \"$<TARGET_FILE:forkattn>\")
    set(FORKATTN_BUNDLE_DEST \"${dest}\")
    set(FORKATTN_BUNDLE_INSTALLED \"${file_name}\")
    set(FORKATTN_BUNDLE_DIRS \"${FORKATTN_LLVM_LIBDIR}\")
    set(FORKATTN_BUNDLE_SYSTEM_LIBS \"${_fa_system_libs}\")")
  install(SCRIPT ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/ForkattnBundleRuntime.cmake)
endfunction()

if(FORKATTN_PYTHON_WHEEL)
  # A wheel is a zip, which would store the soname symlinks as copies: one file, named by its
  # soname, already linked with the install runpath.
  set_target_properties(forkattn PROPERTIES BUILD_WITH_INSTALL_RPATH ON)
  install(CODE "file(INSTALL DESTINATION \"\${CMAKE_INSTALL_PREFIX}\" TYPE PROGRAM
    FILES \"$<TARGET_FILE:forkattn>\" RENAME \"$<TARGET_SONAME_FILE_NAME:forkattn>\")")
  if(_fa_bundle)
    _fa_install_bundled_runtime("$<TARGET_SONAME_FILE_NAME:forkattn>")
    # the allow-list of what may resolve outside the package, for tests/test_wheel_runtime.py
    install(FILES ${_fa_system_libs} DESTINATION . RENAME system_libraries.txt)
  endif()
  return()
endif()

set(_fa_targets forkattn)
if(TARGET forkattn_static)
  list(APPEND _fa_targets forkattn_static)
endif()
install(TARGETS ${_fa_targets} EXPORT forkattnTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(_fa_bundle)
  _fa_install_bundled_runtime("$<TARGET_FILE_NAME:forkattn>")
endif()
install(TARGETS forkattn_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(FILES include/forkattn.h include/forkattn_experimental.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
if(FORKATTN_MPI)
  install(FILES include/forkattn_mpi.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endif()

set(FORKATTN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/forkattn)
install(EXPORT forkattnTargets NAMESPACE forkattn:: DESTINATION ${FORKATTN_CMAKE_DIR})
if(TARGET forkattn_static)
  set(FORKATTN_PACKAGE_HAS_STATIC ON)
else()
  set(FORKATTN_PACKAGE_HAS_STATIC OFF)
endif()
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/forkattnConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/forkattnConfig.cmake INSTALL_DESTINATION ${FORKATTN_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/forkattnConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/forkattnConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/forkattnConfigVersion.cmake
        DESTINATION ${FORKATTN_CMAKE_DIR})

# pkg-config: the shared library carries its dependencies; --static lists them for libforkattn.a.
set(FORKATTN_PC_OFFLOAD "${FORKATTN_OFFLOAD}")
set(FORKATTN_PC_REQUIRES "")
if(FORKATTN_MPI)
  set(FORKATTN_PC_REQUIRES "Requires: mpi-c\n")   # forkattn_mpi.h includes mpi.h
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/forkattn.pc.in ${CMAKE_CURRENT_BINARY_DIR}/forkattn.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/forkattn.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
