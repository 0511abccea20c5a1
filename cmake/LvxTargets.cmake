# One precompiled header (ATen, the heaviest include of every file) built once and reused by
# every C++ target: about 4x less compile time per file. Libraries and executables alike compile
# with -fPIC (not CMake's -fPIE for executables) so that the PCH flags match. LVX_PCH=OFF turns
# it off.
option(LVX_PCH "Precompile the ATen headers once for all targets" ON)
target_compile_options(lvx_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-fPIC>)
# OpenMP, as libtorch is built: ATen's at::parallel_for is a template that runs its loop on the
# intra-op threads only where the including file is compiled with OpenMP (_OPENMP); without it,
# lvx's own CPU kernels (kernels/*_cpu.cpp) ran on one thread whatever --threads said. The
# runtime is the one libtorch loads (torch/lib/libgomp.so.1, found first through the rpath): one
# OpenMP runtime and one thread pool per process.
target_compile_options(lvx_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-fopenmp>)
target_link_options(lvx_warnings INTERFACE -fopenmp)
add_library(lvx_pch STATIC ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)
target_link_libraries(lvx_pch PRIVATE lvx::torch lvx_warnings)
if(LVX_PCH)
  target_precompile_headers(lvx_pch PRIVATE <ATen/ATen.h>)
endif()

# lvx_use_pch(<target>): reuse the shared precompiled header.
function(lvx_use_pch target)
  if(LVX_PCH)
    target_precompile_headers(${target} REUSE_FROM lvx_pch)
  endif()
endfunction()

# lvx_library(<name> <folder> [DEPS ...]): one static library per folder of the architecture.
# Sources are globbed (*.cpp, and *.cu when CUDA is on), so adding a file needs no CMake edit.
# Includes are rooted at the project: #include "src/dist/process_group.h", "kernels/attention.h".
function(lvx_library name folder)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  # A library is its folder with every subfolder (models/: shared blocks, then one folder per
  # family).
  file(GLOB_RECURSE _srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/${folder}/*.cpp)
  if(LVX_WITH_CUDA)
    file(GLOB_RECURSE _cu CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/${folder}/*.cu)
    list(APPEND _srcs ${_cu})
  endif()
  list(FILTER _srcs EXCLUDE REGEX ".*/main\\.cpp$")
  # preload/: libraries loaded into other processes (LD_PRELOAD), never linked into ours.
  list(FILTER _srcs EXCLUDE REGEX ".*/preload/.*")
  if(_srcs)
    add_library(${name} STATIC ${_srcs})
    target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} PUBLIC lvx::torch ${ARG_DEPS} PRIVATE lvx_warnings)
    lvx_use_pch(${name})
  else()
    add_library(${name} INTERFACE)
    target_include_directories(${name} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} INTERFACE lvx::torch ${ARG_DEPS})
  endif()
endfunction()
