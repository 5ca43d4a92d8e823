// ampkernels: the C interface between the torch binding (ops.cpp) and the kernels (*.cu).
//
// The .cu files include no torch headers: they compile in seconds, and all torch
// glue (argument checks, allocation, streams, dtype dispatch) lives in ops.cpp.
// Every launcher returns the cudaError_t of its launch; ops.cpp checks it.
#pragma once
#include <cstdint>
#include <utility>
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

// dz = dy * act'(pre) (dz may be dy: in place) and the fp32 column sums of dz, one row of
// `cols` per row chunk: dbias_partial[num_chunks][cols]. Deterministic (no atomics).
cudaError_t bias_act_backward(const void* dy, const void* pre, void* dz, float* dbias_partial, int64_t rows,
                              int64_t cols, int num_chunks, DType dtype, Activation act, cudaStream_t stream);

// Row chunks for bias_act_backward at a given shape: as many blocks as the GPU holds at once.
cudaError_t bias_act_backward_chunks(int64_t rows, int64_t cols, DType dtype, Activation act, int num_sms,
                                     int* chunks);

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
  // torch.use_deterministic_algorithms(True): the heuristic's first algorithm, never the fastest
  // by timing (timings differ between processes, and with them the algorithm and the bits)
  bool deterministic = false;
};

// Runs the GEMM on `stream` with a cached descriptor + algorithm. handle is a cublasLtHandle_t.
// Returns nullptr on success, else a message naming the failed cuBLASLt call and the GEMM;
// *no_plan is set when nothing ran because cuBLASLt has no algorithm/descriptor for it (the
// caller may take an unfused path), and left false for failures of the launch itself.
const char* lt_matmul(const LtGemm& gemm, void* handle, void* workspace, size_t workspace_size, cudaStream_t stream,
                      bool* no_plan);

// (cached (descriptor, algorithm) plans, those of them whose algorithm was picked by timing), for tests.
std::pair<size_t, size_t> lt_cached_plans();

// dz = dy * act'(saved) over numel elements, for when no bias gradient is wanted
// (bias_act_backward forms one). 16-byte vectors when pointers and numel allow.
cudaError_t act_backward(const void* dy, const void* saved, void* dz, int64_t numel, DType dtype, Activation act,
                         int num_sms, cudaStream_t stream);

// ---- layer_norm / rms_norm
// LayerNorm / RMSNorm over the last dim of contiguous (rows, cols) tensors; fp32 math. Each
// tensor has its own dtype; nullptr means absent. mean is nullptr for RMSNorm.

struct NormForwardArgs {
  const void* x;         // (rows, cols), x_dtype
  const void* residual;  // (rows, cols) or nullptr; normalised input is x + residual (unrounded)
  const void* weight;    // (cols) or nullptr
  const void* bias;      // (cols) or nullptr; same dtype as weight
  void* out;             // (rows, cols), out_dtype
  void* residual_out;    // (rows, cols) or nullptr: x + residual in residual_out_dtype
  float* mean;           // (rows) or nullptr (RMSNorm, or statistics not wanted)
  float* rstd;           // (rows) or nullptr (statistics not wanted: inference)
  int64_t rows, cols;
  float eps;
  bool is_rms;
  DType x_dtype, residual_dtype, param_dtype, out_dtype, residual_out_dtype;
};
cudaError_t norm_forward(const NormForwardArgs& args, cudaStream_t stream);

struct NormBackwardArgs {
  const void* dy;             // (rows, cols), dy_dtype
  const void* x;              // (rows, cols), x_dtype: the normalised input (x, or x + residual)
  const void* weight;         // (cols) or nullptr
  const float* mean;          // (rows) or nullptr (RMSNorm)
  const float* rstd;          // (rows)
  const void* dresidual_out;  // (rows, cols) or nullptr: the gradient of residual_out, added to dx
  void* dx;                   // (rows, cols), dx_dtype
  void* dresidual;            // (rows, cols) or nullptr: dx again, in dresidual_dtype
  float* dweight_partial;     // (num_blocks, cols) or nullptr
  float* dbias_partial;       // (num_blocks, cols) or nullptr
  int64_t rows, cols;
  int num_blocks;             // from norm_backward_blocks
  bool is_rms;
  DType x_dtype, dy_dtype, param_dtype, dresidual_out_dtype, dx_dtype, dresidual_dtype;
};
// The backward's grid (rows of the partial buffers) for these args on a GPU with num_sms SMs.
cudaError_t norm_backward_blocks(const NormBackwardArgs& args, int num_sms, int* num_blocks);
cudaError_t norm_backward(const NormBackwardArgs& args, cudaStream_t stream);
// dweight[c] / dbias[c] = fixed-order sums over the blocks' partial rows, in param_dtype.
cudaError_t norm_reduce_partials(const float* dweight_partial, const float* dbias_partial, void* dweight,
                                 void* dbias, DType param_dtype, int num_blocks, int64_t cols, cudaStream_t stream);

// ---- rotary position embedding
// One 4-D tensor (size0, size1, size2, head_dim) rotated in its rotate-half pairs (i, i + head_dim/2),
// fp32 math; backward applies the transposed rotation to a gradient. Strides in elements, last
// dim contiguous; cos and sin are broadcast to x's shape (stride 0 on broadcast dims) and share
// cs_dtype. rows = size0 * size1 * size2.
struct RotaryArgs {
  const void* x;  // x, or the output's gradient (backward)
  const void* cos;
  const void* sin;
  void* out;      // the rotated x, or x's gradient (backward)
  int64_t rows, size1, size2, head_dim;
  int64_t x_stride[3], cos_stride[3], sin_stride[3], out_stride[3];
  DType x_dtype, cs_dtype, out_dtype;
  bool backward;
};
cudaError_t rotary(const RotaryArgs& args, int num_sms, cudaStream_t stream);

}  // namespace ampk
