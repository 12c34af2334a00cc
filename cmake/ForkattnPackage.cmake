# ForkattnPackage.cmake -- `cmake --install`: libraries (VERSION/SOVERSION), the headers,
# the command-line program, a CMake package exporting forkattn::forkattn (and
# forkattn::forkattn_static in CPU builds) with a same-major version file, and forkattn.pc.
include(CMakePackageConfigHelpers)

set(_fa_targets forkattn)
if(TARGET forkattn_static)
  list(APPEND _fa_targets forkattn_static)
endif()
install(TARGETS ${_fa_targets} EXPORT forkattnTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
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
