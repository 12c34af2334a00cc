# ForkattnOffload.cmake -- OpenMP target offload to NVIDIA GPUs (clang >= 19 + CUDA toolkit).
#
# Input (cache):
#   FORKATTN_OFFLOAD         OFF | nvptx:sm_XX | nvptx:sm_XXa       (e.g. nvptx:sm_90)
#   FORKATTN_NVLINK_ELF_FIX  ON: link through the nvlink wrapper that relabels CUDA 13 cubins
#                            to the ELF ABI LLVM 19's libomptarget accepts (no-op on old-ABI output)
#   CUDAToolkit_ROOT         where to look for the CUDA toolkit (as FindCUDAToolkit)
# Output:
#   FORKATTN_HAVE_OFFLOAD      TRUE when offload is configured, else FALSE
#   FORKATTN_OFFLOAD_ARCH      sm_XX[a]
#   FORKATTN_HAVE_WGMMA        TRUE for sm_90a (the warpgroup tensor-core kernels are built)
#   FORKATTN_OFFLOAD_FLAGS     compile (and link) flags for device-code sources
#   FORKATTN_OFFLOAD_BC        device runtime bitcode libomptarget-nvptx-sm_XX.bc
#   FORKATTN_OFFLOAD_DEVICERTL the device runtime archive repackaged for sm_XXa (else empty)
#   FORKATTN_LLVM_LIBDIR       LLVM's libdir (libomptarget.so, libomp.so)
#   FORKATTN_CUDA_ROOT         the real CUDA toolkit root
#   FORKATTN_OFFLOAD_CUDA_PATH what --cuda-path points to (the fake root when the ELF fix is on)
#   forkattn_enable_offload(<target> <source>...)
# See docs/toolchain-notes.md.

include_guard(GLOBAL)

set(FORKATTN_OFFLOAD "OFF" CACHE STRING "GPU offload: OFF or nvptx:sm_XX (e.g. nvptx:sm_90)")
set(_forkattn_offload_dir "${CMAKE_CURRENT_LIST_DIR}")
get_filename_component(_forkattn_check_script
  "${CMAKE_CURRENT_LIST_DIR}/../tests/check_device_image.sh" ABSOLUTE)
set(FORKATTN_HAVE_OFFLOAD FALSE)

# forkattn_enable_offload(<target> <source>...): compile <source>... as device code for
# FORKATTN_OFFLOAD_ARCH, link <target> with the offload linker flags and libomptarget, and
# register the CTest device_image_header on the built file. No-op without offload.
function(forkattn_enable_offload target)
  if(NOT FORKATTN_HAVE_OFFLOAD)
    return()
  endif()
  # Only these sources carry device code; the others compile as plain host code.
  set_property(SOURCE ${ARGN} TARGET_DIRECTORY ${target}
               APPEND PROPERTY COMPILE_OPTIONS ${FORKATTN_OFFLOAD_FLAGS})
  # The clang linker wrapper runs the device link (nvlink) when the host link sees these flags.
  target_link_options(${target} PRIVATE ${FORKATTN_OFFLOAD_FLAGS}
                      "LINKER:-rpath,${FORKATTN_LLVM_LIBDIR}")
  # Depend on LLVM's libomptarget explicitly (DT_NEEDED + rpath), so that omp_target_* resolve
  # to it even in a process that already loaded libgomp.
  target_link_directories(${target} PRIVATE "${FORKATTN_LLVM_LIBDIR}")
  target_link_libraries(${target} PRIVATE "-Wl,--push-state,--no-as-needed" omptarget
                        "-Wl,--pop-state" ${FORKATTN_OFFLOAD_DEVICERTL})
  # add_test() may run before enable_testing() in the same directory: CMake emits the test
  # when testing ends up enabled there and ignores it otherwise.
  set(test_name device_image_header)
  if(TEST ${test_name})
    set(test_name device_image_header_${target})
  endif()
  add_test(NAME ${test_name}
           COMMAND sh "${_forkattn_check_script}" "$<TARGET_FILE:${target}>" "${FORKATTN_OFFLOAD_ARCH}")
  set_tests_properties(${test_name} PROPERTIES LABELS offload)
endfunction()

if(NOT FORKATTN_OFFLOAD)
  return()
endif()

# ---- target architecture ---------------------------------------------------------------
if(NOT FORKATTN_OFFLOAD MATCHES "^nvptx:(sm_([0-9]+))(a?)$")
  message(FATAL_ERROR "FORKATTN_OFFLOAD='${FORKATTN_OFFLOAD}': expected OFF or nvptx:sm_XX "
                      "(e.g. nvptx:sm_90 or nvptx:sm_90a)")
endif()
set(FORKATTN_OFFLOAD_ARCH "${CMAKE_MATCH_1}${CMAKE_MATCH_3}")
set(_bc_arch "${CMAKE_MATCH_1}")   # sm_90a uses the sm_90 device runtime
# The warpgroup (wgmma) kernels need the arch-specific sm_90a target.
set(FORKATTN_HAVE_WGMMA FALSE)
if(FORKATTN_OFFLOAD_ARCH STREQUAL "sm_90a")
  set(FORKATTN_HAVE_WGMMA TRUE)
endif()

# ---- compiler: clang >= 19 ---------------------------------------------------------------
if(NOT CMAKE_C_COMPILER_ID STREQUAL "Clang" OR CMAKE_C_COMPILER_VERSION VERSION_LESS 19)
  message(FATAL_ERROR "FORKATTN_OFFLOAD=${FORKATTN_OFFLOAD} needs Clang >= 19 with OpenMP "
    "offload, but the C compiler is ${CMAKE_C_COMPILER_ID} ${CMAKE_C_COMPILER_VERSION} "
    "(${CMAKE_C_COMPILER}). Configure with -DCMAKE_C_COMPILER=clang-19 (in a fresh build "
    "directory), or use -DFORKATTN_OFFLOAD=OFF.")
endif()
string(REGEX MATCH "^[0-9]+" _llvm_major "${CMAKE_C_COMPILER_VERSION}")

# ---- LLVM libdir and device runtime bitcode ------------------------------------------------
# Candidates: llvm-config of the same major version, the compiler's resource dir (lib/clang/N
# -> lib), and <real compiler dir>/../lib.
file(REAL_PATH "${CMAKE_C_COMPILER}" _clang_real)
get_filename_component(_clang_bindir "${_clang_real}" DIRECTORY)
set(_llvm_libdirs)
find_program(FORKATTN_LLVM_CONFIG NAMES llvm-config-${_llvm_major} llvm-config
             HINTS "${_clang_bindir}")
if(FORKATTN_LLVM_CONFIG)
  execute_process(COMMAND "${FORKATTN_LLVM_CONFIG}" --version --libdir
                  OUTPUT_VARIABLE _out RESULT_VARIABLE _rc OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_rc EQUAL 0 AND _out MATCHES "^${_llvm_major}\\.[^\n]*\n(.+)$")
    list(APPEND _llvm_libdirs "${CMAKE_MATCH_1}")
  endif()
endif()
execute_process(COMMAND "${CMAKE_C_COMPILER}" -print-resource-dir
                OUTPUT_VARIABLE _out RESULT_VARIABLE _rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(_rc EQUAL 0 AND _out)
  get_filename_component(_out "${_out}/../.." ABSOLUTE)
  list(APPEND _llvm_libdirs "${_out}")
endif()
get_filename_component(_out "${_clang_bindir}/../lib" ABSOLUTE)
list(APPEND _llvm_libdirs "${_out}")
list(REMOVE_DUPLICATES _llvm_libdirs)

set(FORKATTN_OFFLOAD_BC "")
set(FORKATTN_LLVM_LIBDIR "")
foreach(_dir IN LISTS _llvm_libdirs)
  if(NOT FORKATTN_OFFLOAD_BC AND EXISTS "${_dir}/libomptarget-nvptx-${_bc_arch}.bc")
    set(FORKATTN_OFFLOAD_BC "${_dir}/libomptarget-nvptx-${_bc_arch}.bc")
  endif()
  if(NOT FORKATTN_LLVM_LIBDIR AND EXISTS "${_dir}/libomptarget.so")
    set(FORKATTN_LLVM_LIBDIR "${_dir}")
  endif()
endforeach()
if(NOT FORKATTN_OFFLOAD_BC)
  message(FATAL_ERROR "No OpenMP device runtime libomptarget-nvptx-${_bc_arch}.bc for clang "
    "${CMAKE_C_COMPILER_VERSION} in: ${_llvm_libdirs}. Install libomp-${_llvm_major}-dev.")
endif()
if(NOT FORKATTN_LLVM_LIBDIR)
  message(FATAL_ERROR "No libomptarget.so in: ${_llvm_libdirs}. Install libomp-${_llvm_major}-dev.")
endif()

# ---- device runtime for an arch-specific target (sm_90a) ---------------------------------------
# The linker wrapper takes the device runtime from libomptarget.devicertl.a, whose members are
# per plain arch (devicertl-nvptx-sm_90.o) and chosen by exact arch name: for sm_90a none
# matches, and runtime calls the device compiler adds stay unresolved at nvlink. sm_90a is sm_90
# plus arch-specific instructions, so the sm_90 member's bitcode is repackaged under the sm_90a
# name into an archive of our own that the offload targets link.
set(FORKATTN_OFFLOAD_DEVICERTL "")
if(NOT FORKATTN_OFFLOAD_ARCH STREQUAL _bc_arch)
  find_program(FORKATTN_OFFLOAD_PACKAGER NAMES clang-offload-packager-${_llvm_major} clang-offload-packager
               HINTS "${_clang_bindir}")
  find_program(FORKATTN_LLVM_OBJCOPY NAMES llvm-objcopy-${_llvm_major} llvm-objcopy HINTS "${_clang_bindir}")
  find_program(FORKATTN_LLVM_AR NAMES llvm-ar-${_llvm_major} llvm-ar HINTS "${_clang_bindir}")
  set(_rtl_archive "${FORKATTN_LLVM_LIBDIR}/libomptarget.devicertl.a")
  if(NOT FORKATTN_OFFLOAD_PACKAGER OR NOT FORKATTN_LLVM_OBJCOPY OR NOT FORKATTN_LLVM_AR OR
     NOT EXISTS "${_rtl_archive}")
    message(FATAL_ERROR "FORKATTN_OFFLOAD=${FORKATTN_OFFLOAD} needs clang-offload-packager, llvm-objcopy, "
      "llvm-ar and ${_rtl_archive}: install clang-tools-${_llvm_major} llvm-${_llvm_major} libomp-${_llvm_major}-dev.")
  endif()
  set(_rtl_dir "${CMAKE_BINARY_DIR}/forkattn-devicertl")
  set(_member "devicertl-nvptx-${_bc_arch}.o")
  set(FORKATTN_OFFLOAD_DEVICERTL "${_rtl_dir}/libforkattn-devicertl-${FORKATTN_OFFLOAD_ARCH}.a")
  file(MAKE_DIRECTORY "${_rtl_dir}")
  foreach(_step
      "${FORKATTN_LLVM_AR};x;${_rtl_archive};${_member}"
      "${FORKATTN_OFFLOAD_PACKAGER};${_member};--image=file=rtl.bc,arch=${_bc_arch}"
      "${FORKATTN_OFFLOAD_PACKAGER};-o;rtl.bin;--image=file=rtl.bc,triple=nvptx64-nvidia-cuda,arch=${FORKATTN_OFFLOAD_ARCH},kind=openmp"
      "${FORKATTN_LLVM_OBJCOPY};--update-section;.llvm.offloading=rtl.bin;${_member};rtl.o"
      "${CMAKE_COMMAND};-E;rm;-f;${FORKATTN_OFFLOAD_DEVICERTL}"
      "${FORKATTN_LLVM_AR};rcs;${FORKATTN_OFFLOAD_DEVICERTL};rtl.o")
    execute_process(COMMAND ${_step} WORKING_DIRECTORY "${_rtl_dir}" RESULT_VARIABLE _rc
                    OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
    if(NOT _rc EQUAL 0)
      message(FATAL_ERROR "Repackaging the ${_bc_arch} device runtime as ${FORKATTN_OFFLOAD_ARCH} failed at "
                          "'${_step}': ${_out}")
    endif()
  endforeach()
endif()

# ---- CUDA toolkit (ptxas, nvlink, nvvm/libdevice) ------------------------------------------
find_package(CUDAToolkit QUIET)
find_program(FORKATTN_NVLINK nvlink
  HINTS ${CUDAToolkit_BIN_DIR} ${CUDAToolkit_ROOT}/bin $ENV{CUDAToolkit_ROOT}/bin
        $ENV{CUDA_PATH}/bin /usr/local/cuda/bin)
if(NOT FORKATTN_NVLINK)
  message(FATAL_ERROR "CUDA toolkit not found (need nvlink and ptxas): set CUDAToolkit_ROOT.")
endif()
get_filename_component(_cuda_bindir "${FORKATTN_NVLINK}" DIRECTORY)
get_filename_component(FORKATTN_CUDA_ROOT "${_cuda_bindir}" DIRECTORY)
if(NOT EXISTS "${_cuda_bindir}/ptxas")
  message(FATAL_ERROR "No ptxas next to ${FORKATTN_NVLINK}: set CUDAToolkit_ROOT.")
endif()
execute_process(COMMAND "${FORKATTN_NVLINK}" --version OUTPUT_VARIABLE _out)
string(REGEX MATCH "release ([0-9.]+)" _out "${_out}")
set(_cuda_version "${CMAKE_MATCH_1}")

# ---- nvlink ELF fix: a fake CUDA root whose bin/nvlink is the relabelling wrapper --------------
# <build>/forkattn-cuda-root mirrors the real root with symlinks; bin/ holds symlinks to every
# real bin entry except nvlink, which is generated from nvlink-elf-fix.sh.in.
option(FORKATTN_NVLINK_ELF_FIX
  "Relabel nvlink's CUDA 13 cubins to the ELF ABI LLVM 19's libomptarget accepts" ON)
if(FORKATTN_NVLINK_ELF_FIX)
  set(_fake "${CMAKE_BINARY_DIR}/forkattn-cuda-root")
  file(MAKE_DIRECTORY "${_fake}/bin")
  # Drop the links of a previous configure (only links: never recurse into the real toolkit).
  file(GLOB _old LIST_DIRECTORIES true "${_fake}/*" "${_fake}/bin/*")
  foreach(_e IN LISTS _old)
    if(IS_SYMLINK "${_e}")
      file(REMOVE "${_e}")
    endif()
  endforeach()
  file(GLOB _entries LIST_DIRECTORIES true RELATIVE "${FORKATTN_CUDA_ROOT}" "${FORKATTN_CUDA_ROOT}/*")
  list(REMOVE_ITEM _entries bin)
  foreach(_e IN LISTS _entries)
    file(CREATE_LINK "${FORKATTN_CUDA_ROOT}/${_e}" "${_fake}/${_e}" SYMBOLIC)
  endforeach()
  file(GLOB _entries LIST_DIRECTORIES true RELATIVE "${_cuda_bindir}" "${_cuda_bindir}/*")
  list(REMOVE_ITEM _entries nvlink)
  foreach(_e IN LISTS _entries)
    file(CREATE_LINK "${_cuda_bindir}/${_e}" "${_fake}/bin/${_e}" SYMBOLIC)
  endforeach()
  set(FORKATTN_REAL_NVLINK "${FORKATTN_NVLINK}")
  set(FORKATTN_NVLINK_LOG "${_fake}/nvlink-elf-fix.log")
  configure_file("${_forkattn_offload_dir}/nvlink-elf-fix.sh.in" "${_fake}/bin/nvlink" @ONLY
    FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE
                     WORLD_READ WORLD_EXECUTE)
  set(FORKATTN_OFFLOAD_CUDA_PATH "${_fake}")
else()
  set(FORKATTN_OFFLOAD_CUDA_PATH "${FORKATTN_CUDA_ROOT}")
endif()

set(FORKATTN_OFFLOAD_FLAGS
  -fopenmp
  --offload-arch=${FORKATTN_OFFLOAD_ARCH}
  --libomptarget-nvptx-bc-path=${FORKATTN_OFFLOAD_BC}
  --cuda-path=${FORKATTN_OFFLOAD_CUDA_PATH})
set(FORKATTN_HAVE_OFFLOAD TRUE)
message(STATUS "forkattn offload: ${FORKATTN_OFFLOAD_ARCH} with clang ${CMAKE_C_COMPILER_VERSION}, "
               "CUDA ${_cuda_version} at ${FORKATTN_CUDA_ROOT}, device runtime ${FORKATTN_OFFLOAD_BC}, "
               "nvlink ELF fix ${FORKATTN_NVLINK_ELF_FIX}")
