// The torch binding of ampkernels._C: schemas (torch.ops.ampkernels.*_cuda), argument
// checks with clear messages, a device guard, the current stream, allocation, a launch,
// and a checked CUDA status. Kernels live in the .cu files (see ampkernels.h).
//
// Each op family has its own section with its own TORCH_LIBRARY_FRAGMENT, so the Python
// side (ampkernels/ops/*.py, which registers the public custom ops in the same namespace)
// and every section can add to the namespace independently.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>

#include "ampkernels.h"

// `import ampkernels._C` loads this library, which registers the ops below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "ampkernels compiled ops", -1, nullptr};
  return PyModule_Create(&module_def);
}

namespace ampk {
namespace {

// ---------------------------------------------------------------- common checks

#define AMPK_CHECK_CUDA(expr)                                                                          \
  do {                                                                                                 \
    const cudaError_t err_ = (expr);                                                                   \
    TORCH_CHECK(err_ == cudaSuccess, "ampkernels: CUDA error in ", #expr, ": ", cudaGetErrorString(err_)); \
  } while (0)

DType to_dtype(at::ScalarType t, const char* op, const char* arg) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, op, ": ", arg, " must be float32, float16 or bfloat16, got ", t);
  }
}

void check_cuda(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.is_cuda(), op, ": ", arg, " must be a CUDA tensor, got a tensor on ", t.device(),
              " (use backend='torch' or move it to the GPU)");
}

void check_contiguous(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous, got strides ", t.strides());
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* arg,
                       const char* ref_arg) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", arg, " is on ", t.device(), " but ", ref_arg, " is on ",
              ref.device());
}

Activation to_activation(int64_t act, const char* op) {
  TORCH_CHECK(act >= 0 && act <= int64_t(Activation::kSquaredReLU), op, ": unknown activation id ", act);
  return Activation(act);
}

int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// ---------------------------------------------------------------- build info

std::string build_info() {
  return std::string("archs=") + compiled_arch_list() + ";cuda_runtime=" + std::to_string(CUDART_VERSION);
}

// "" when this library's kernels load on the current device, else the CUDA error.
std::string probe_device() {
  const cudaError_t err = probe_kernel_image();
  cudaGetLastError();  // clear the sticky-free error state for the caller
  return err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("build_info_cuda() -> str", &build_info);
  m.def("probe_device_cuda() -> str", &probe_device);
}

// ---------------------------------------------------------------- bias_act

std::tuple<at::Tensor, at::Tensor> bias_act_fwd(const at::Tensor& z, const std::optional<at::Tensor>& bias,
                                                int64_t activation, bool store_pre) {
  constexpr const char* op = "bias_act_fwd_cuda";
  check_cuda(z, op, "z");
  check_contiguous(z, op, "z");
  TORCH_CHECK(z.dim() == 2, op, ": z must be 2-D (rows, cols), got shape ", z.sizes());
  const DType dtype = to_dtype(z.scalar_type(), op, "z");
  DType bias_dtype = dtype;
  if (bias) {
    check_same_device(*bias, z, op, "bias", "z");
    check_contiguous(*bias, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == z.size(1), op, ": bias must have shape (", z.size(1),
                ",), got ", bias->sizes());
    bias_dtype = to_dtype(bias->scalar_type(), op, "bias");
    TORCH_CHECK(bias_dtype == dtype || bias_dtype == DType::kFloat32, op, ": bias must be ", z.scalar_type(),
                " or float32, got ", bias->scalar_type());
  }
  const c10::cuda::CUDAGuard guard(z.device());
  at::Tensor y = at::empty_like(z);
  at::Tensor pre = store_pre ? at::empty_like(z) : at::empty({0}, z.options());
  AMPK_CHECK_CUDA(bias_act_forward(z.data_ptr(), bias ? bias->data_ptr() : nullptr, y.data_ptr(),
                                   store_pre ? pre.data_ptr() : nullptr, z.size(0), z.size(1), dtype, bias_dtype,
                                   to_activation(activation, op), at::cuda::getCurrentCUDAStream()));
  return {y, pre};
}

std::tuple<at::Tensor, at::Tensor> bias_act_bwd(const at::Tensor& dy, const at::Tensor& pre, int64_t activation,
                                                std::optional<at::ScalarType> dbias_dtype) {
  constexpr const char* op = "bias_act_bwd_cuda";
  check_cuda(dy, op, "dy");
  check_same_device(pre, dy, op, "pre", "dy");
  check_contiguous(dy, op, "dy");
  check_contiguous(pre, op, "pre");
  TORCH_CHECK(dy.dim() == 2 && pre.sizes() == dy.sizes(), op, ": dy and pre must be 2-D of one shape, got ",
              dy.sizes(), " and ", pre.sizes());
  TORCH_CHECK(dy.scalar_type() == pre.scalar_type(), op, ": dy and pre must share a dtype, got ",
              dy.scalar_type(), " and ", pre.scalar_type());
  const DType dtype = to_dtype(dy.scalar_type(), op, "dy");
  const c10::cuda::CUDAGuard guard(dy.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t rows = dy.size(0), cols = dy.size(1);
  at::Tensor dz = at::empty_like(dy);
  if (!dbias_dtype) {
    AMPK_CHECK_CUDA(bias_act_backward(dy.data_ptr(), pre.data_ptr(), dz.data_ptr(), nullptr, rows, cols, 1, dtype,
                                      to_activation(activation, op), stream));
    return {dz, at::empty({0}, dy.options())};
  }
  const DType out_dtype = to_dtype(*dbias_dtype, op, "dbias_dtype");
  const int chunks = bias_act_backward_chunks(rows, cols, num_sms());
  at::Tensor partial = at::empty({chunks, cols}, dy.options().dtype(at::kFloat));
  at::Tensor dbias = at::empty({cols}, dy.options().dtype(*dbias_dtype));
  AMPK_CHECK_CUDA(bias_act_backward(dy.data_ptr(), pre.data_ptr(), dz.data_ptr(), partial.data_ptr<float>(), rows,
                                    cols, chunks, dtype, to_activation(activation, op), stream));
  if (rows == 0) {
    dbias.zero_();
  } else {
    AMPK_CHECK_CUDA(reduce_partials(partial.data_ptr<float>(), dbias.data_ptr(), chunks, cols, out_dtype, stream));
  }
  return {dz, dbias};
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("bias_act_fwd_cuda(Tensor z, Tensor? bias, int activation, bool store_pre) -> (Tensor y, Tensor pre)");
  m.def("bias_act_bwd_cuda(Tensor dy, Tensor pre, int activation, ScalarType? dbias_dtype) -> (Tensor dz, Tensor dbias)");
}
TORCH_LIBRARY_IMPL(ampkernels, CompositeExplicitAutograd, m) {
  m.impl("bias_act_fwd_cuda", &bias_act_fwd);
  m.impl("bias_act_bwd_cuda", &bias_act_bwd);
}

// ---------------------------------------------------------------- layer_norm / rms_norm

// ---------------------------------------------------------------- linear_act

}  // namespace
}  // namespace ampk
