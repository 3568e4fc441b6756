#pragma once
/// SEQPAR_HD marks index math shared by host code and CUDA kernels: the very same
/// functions compute layouts on the CPU reference and inside GPU kernels.
#if defined(__CUDACC__)
#define SEQPAR_HD __host__ __device__ inline
#else
#define SEQPAR_HD inline
#endif
