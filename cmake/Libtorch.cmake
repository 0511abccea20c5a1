# Finds libtorch inside the pinned PyTorch wheel and exposes it as lvx::torch.
# We only include ATen/c10/c10d headers (never torch/torch.h), which keeps compile times low.
# Inputs: LVX_PYTHON (interpreter whose site-packages hold torch) or LVX_TORCH_DIR.
if(NOT LVX_TORCH_DIR)
  execute_process(
    COMMAND ${LVX_PYTHON} -c "import os, torch; print(os.path.dirname(torch.__file__))"
    OUTPUT_VARIABLE LVX_TORCH_DIR OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "lvx: could not import torch with ${LVX_PYTHON}; run setup.sh, "
                        "or pass -DLVX_TORCH_DIR=<site-packages>/torch")
  endif()
endif()
set(LVX_TORCH_DIR ${LVX_TORCH_DIR} CACHE PATH "torch package directory (holds include/ and lib/)")
execute_process(
  COMMAND ${LVX_PYTHON} -c "import torch; print(torch.__version__)"
  OUTPUT_VARIABLE LVX_TORCH_VERSION OUTPUT_STRIP_TRAILING_WHITESPACE)
message(STATUS "lvx: libtorch ${LVX_TORCH_VERSION} from ${LVX_TORCH_DIR}")

add_library(lvx_torch INTERFACE)
add_library(lvx::torch ALIAS lvx_torch)
# csrc/api/include only because c10d headers reach torch/types.h; we never include torch/torch.h.
target_include_directories(lvx_torch SYSTEM INTERFACE ${LVX_TORCH_DIR}/include
                                                    ${LVX_TORCH_DIR}/include/torch/csrc/api/include)
set(_libs ${LVX_TORCH_DIR}/lib/libtorch_cpu.so ${LVX_TORCH_DIR}/lib/libc10.so)
set(LVX_TORCH_HAS_CUDA OFF)
if(EXISTS ${LVX_TORCH_DIR}/lib/libtorch_cuda.so)
  set(LVX_TORCH_HAS_CUDA ON)
endif()
# libtorch_cpu and c10 only: libtorch.so is the stub whose NEEDED entries load libtorch_cuda.so
# and the CUDA libraries (~350 MB resident in every process, at every start). A CUDA build links
# libtorch_cuda itself (lvx_cuda, CMakeLists.txt); a CPU build loads it when a command first asks
# for CUDA on a machine with an NVIDIA driver (src/runtime/device.cpp, load_cuda_runtime).
target_link_libraries(lvx_torch INTERFACE "-Wl,--push-state,--no-as-needed" ${_libs}
                      "-Wl,--pop-state")
# c10d's Gloo process group is compiled into libtorch_cpu; its header needs this define and
# the gloo headers (Debian's libgloo-dev; only declarations are used, the code is libtorch's).
target_compile_definitions(lvx_torch INTERFACE USE_C10D_GLOO)
target_link_options(lvx_torch INTERFACE "LINKER:-rpath,${LVX_TORCH_DIR}/lib"
  # libtorch.so exports its own copies of std::filesystem symbols (remove_all among them) that
  # crash when called from our code; loading libstdc++ first makes symbol lookup find the real ones.
  "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
