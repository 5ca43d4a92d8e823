// ampkernels: the C interface between the torch binding (ops.cpp) and the kernels (*.cu).
//
// The .cu files include no torch headers: they compile in seconds, and all torch
// glue (argument checks, allocation, streams, dtype dispatch) lives in ops.cpp.
// Every launcher returns the cudaError_t of its launch; ops.cpp checks it.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace ampk {

// Must match ampkernels/_dtypes.py.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Must match ampkernels/reference.py ACTIVATIONS (same order).
enum class Activation : int { kIdentity = 0, kReLU = 1, kGELU = 2, kGELUTanh = 3, kSiLU = 4, kSquaredReLU = 5 };

// Fused bias + activation over a row-major (rows, cols) matrix.
// y = act(z + bias); pre (optional, may be nullptr) receives z + bias in z's dtype.
// bias (optional) has bias_dtype (z's dtype or fp32). All math in fp32.
cudaError_t bias_act_forward(const void* z, const void* bias, void* y, void* pre, int64_t rows, int64_t cols,
                             DType dtype, DType bias_dtype, Activation act, cudaStream_t stream);

// dz = dy * act'(pre). When dbias_partial is not nullptr, also writes fp32 column sums of dz,
// one row of `cols` per row chunk: dbias_partial[num_chunks][cols]. Deterministic (no atomics).
cudaError_t bias_act_backward(const void* dy, const void* pre, void* dz, float* dbias_partial, int64_t rows,
                              int64_t cols, int num_chunks, DType dtype, Activation act, cudaStream_t stream);

// Rows of row chunks the backward uses for a given shape, sized to fill the GPU.
int bias_act_backward_chunks(int64_t rows, int64_t cols, int num_sms);

// out[c] = sum over chunks of partial[chunk][c], in fixed order, written in out_dtype.
cudaError_t reduce_partials(const float* partial, void* out, int num_chunks, int64_t cols, DType out_dtype,
                            cudaStream_t stream);

// Compiled CUDA architectures, e.g. "900", and whether this file's kernels load on the current device.
const char* compiled_arch_list();
cudaError_t probe_kernel_image();

// ---- linear_act
// cuBLASLt epilogues linear_act uses (csrc/linear_act.cu maps them to cublasLtEpilogue_t).
enum class LtEpilogue : int { kDefault, kBias, kReLU, kReLUBias, kGELU, kGELUBias, kGELUAux, kGELUAuxBias, kBGradB };

// One column-major GEMM D(m x n) = op(A)(m x k) * op(B)(k x n), fp16/bf16 in and out, fp32
// accumulation, with an epilogue. bias: the bias (length m) or, for kBGradB, the bias
// gradient output (length n); aux: GELU's pre-activation output (aux_ld >= m, multiple of 8).
struct LtGemm {
  int64_t m, n, k;
  bool trans_a, trans_b;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  int64_t ldd;
  DType dtype;
  LtEpilogue epilogue;
  void* bias;
  void* aux;
  int64_t aux_ld;
};

// Runs the GEMM on `stream` with a cached descriptor + algorithm. handle is a cublasLtHandle_t.
// Returns nullptr on success, else a message naming the failed cuBLASLt call and the GEMM.
const char* lt_matmul(const LtGemm& gemm, void* handle, void* workspace, size_t workspace_size, cudaStream_t stream);

// Number of cached (descriptor, algorithm) plans, for tests.
size_t lt_cached_plans();

}  // namespace ampk
