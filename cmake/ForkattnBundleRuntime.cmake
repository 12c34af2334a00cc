# ForkattnBundleRuntime.cmake -- install-time script (install(SCRIPT), see ForkattnPackage.cmake):
# copies LLVM's offload runtime that an offload libforkattn loads (libomptarget with its built-in
# CUDA plugin, libomp) and what those load that a node with only the NVIDIA driver lacks (libLLVM,
# libz3) into FORKATTN_BUNDLE_DEST, each as one file under the name the loader asks for (its
# soname), with runpaths set to $ORIGIN so that they find each other there.
# The installed libforkattn's runpath becomes $ORIGIN alone (the build's LLVM libdir would come
# first). Input: FORKATTN_BUNDLE_LIB (the built libforkattn), FORKATTN_BUNDLE_DEST (the install
# folder), FORKATTN_BUNDLE_INSTALLED (the installed library's file name there),
# FORKATTN_BUNDLE_DIRS (LLVM's libdir: where libomptarget is found).

file(GET_RUNTIME_DEPENDENCIES LIBRARIES "${FORKATTN_BUNDLE_LIB}"
  RESOLVED_DEPENDENCIES_VAR _deps UNRESOLVED_DEPENDENCIES_VAR _missing
  PRE_INCLUDE_REGEXES "^lib(omptarget|omp|LLVM|z3)[.-]" PRE_EXCLUDE_REGEXES "."
  DIRECTORIES ${FORKATTN_BUNDLE_DIRS})
if(_missing)
  message(FATAL_ERROR "FORKATTN_BUNDLE_OFFLOAD_RUNTIME: ${FORKATTN_BUNDLE_LIB} needs ${_missing}, "
    "not found (install clang-19 and libomp-19-dev)")
endif()
if(NOT _deps MATCHES "libomptarget")
  message(FATAL_ERROR "FORKATTN_BUNDLE_OFFLOAD_RUNTIME: ${FORKATTN_BUNDLE_LIB} does not load libomptarget")
endif()
set(_dest "$ENV{DESTDIR}${FORKATTN_BUNDLE_DEST}")
file(MAKE_DIRECTORY "${_dest}")
foreach(_dep IN LISTS _deps)
  get_filename_component(_name "${_dep}" NAME)
  message(STATUS "Installing: ${_dest}/${_name} (from ${_dep})")
  # COPY_FILE follows symlinks: one file (a wheel would store a link as a second copy)
  file(COPY_FILE "${_dep}" "${_dest}/${_name}")
  list(APPEND CMAKE_INSTALL_MANIFEST_FILES "${_dest}/${_name}")
  unset(_runpath)
  file(READ_ELF "${_dest}/${_name}" RUNPATH _runpath)
  # Debian's libLLVM has $ORIGIN/../lib (its own tree): point it at its new folder for libz3.
  # The new value must fit in the old string's space, which "$ORIGIN" always does.
  if(_runpath AND NOT _runpath STREQUAL "$ORIGIN")
    file(RPATH_SET FILE "${_dest}/${_name}" NEW_RPATH "$ORIGIN")
  endif()
endforeach()
file(RPATH_SET FILE "${_dest}/${FORKATTN_BUNDLE_INSTALLED}" NEW_RPATH "$ORIGIN")
