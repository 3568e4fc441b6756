#pragma once
// cuBLAS, loaded on first use. Linking libcublas makes every process that links the GPU backend
// (the whole seqpar CLI) run cuBLASLt's static initialisers at start-up — about 0.5–0.8 s of
// allocation and page faults per process on the development machines, for commands that never
// touch a GPU. The few entry points seqpar calls are resolved with dlopen/dlsym instead, the
// first time a GPU computation needs them.
#include <cublas_v2.h>

namespace seqpar::gpu {

struct cublas_api {
  cublasStatus_t (*create)(cublasHandle_t*) = nullptr;
  cublasStatus_t (*destroy)(cublasHandle_t) = nullptr;
  cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t) = nullptr;
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t) = nullptr;
  const char* (*status_string)(cublasStatus_t) = nullptr;
};

/// The cuBLAS entry points (libcublas.so.<major of the toolkit built against>, then
/// libcublas.so), loaded once, thread-safe. Throws backend_error naming the library and
/// dlerror() when it cannot be loaded or lacks a symbol.
const cublas_api& cublas();

}  // namespace seqpar::gpu
