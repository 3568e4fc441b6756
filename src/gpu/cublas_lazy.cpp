#include "gpu/cublas_lazy.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <string>
#include <type_traits>

#include "core/error.hpp"

namespace seqpar::gpu {

namespace {

cublas_api load() {
  const std::string versioned = fmt::format("libcublas.so.{}", CUBLAS_VER_MAJOR);
  void* lib = dlopen(versioned.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) lib = dlopen("libcublas.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    throw backend_error("dlopen", 0,
                        fmt::format("cannot load cuBLAS ({} or libcublas.so): {}; put the CUDA "
                                    "toolkit's lib64 on LD_LIBRARY_PATH",
                                    versioned, why ? why : "unknown"),
                        0, "");
  }
  cublas_api api;
  const auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (fn == nullptr)
      throw backend_error("dlsym", 0, fmt::format("{} has no symbol {}", versioned, name), 0, "");
  };
  sym(api.create, "cublasCreate_v2");
  sym(api.destroy, "cublasDestroy_v2");
  sym(api.set_stream, "cublasSetStream_v2");
  sym(api.gemm_ex, "cublasGemmEx");
  sym(api.status_string, "cublasGetStatusString");
  return api;  // the library stays loaded for the process's lifetime
}

}  // namespace

const cublas_api& cublas() {
  static const cublas_api api = load();
  return api;
}

}  // namespace seqpar::gpu
