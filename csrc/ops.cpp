// The torch binding of ampkernels._C: the kernel ops (torch.ops.ampkernels.*_cuda: argument
// checks with clear messages, a device guard, the current stream, allocation, a launch, a
// checked CUDA status; kernels in the .cu files, see ampkernels.h) and the ops the Python API
// calls (norm, linear_act, fused_mlp, gated_linear_act, gated_mlp, rotary_embedding), their autograd in C++.
//
// Each op family has its own section with its own TORCH_LIBRARY_FRAGMENT, so the Python
// side (ampkernels/ops/*.py, which registers the Triton kernel ops and the custom ops of
// bias_act and linear_cross_entropy in the same namespace) and every section can add to the
// namespace independently.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/_unsafe_view.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/autocast_mode.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>
#include <torch/version.h>

#include <array>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "ampkernels.h"

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

// dz = dy * act'(pre) (dz may be dy) and dbias = the column sums of dz as stored, in dbias's
// dtype: fp32 partials per row chunk in one pass, then their sum in a fixed order (bitwise
// repeatable). dy, pre, dz: contiguous (rows, cols) of one 16-bit or fp32 dtype; dbias (cols).
void act_grad_and_dbias(const at::Tensor& dy, const at::Tensor& pre, const at::Tensor& dz, Activation act,
                        const at::Tensor& dbias, const char* op) {
  const int64_t rows = dy.size(0), cols = dy.size(1);
  const DType dtype = to_dtype(dy.scalar_type(), op, "dy");
  const DType dbias_dtype = to_dtype(dbias.scalar_type(), op, "dbias_dtype");
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (rows == 0) {
    dbias.zero_();
    return;
  }
  int chunks = 1;
  AMPK_CHECK_CUDA(bias_act_backward_chunks(rows, cols, dtype, act, num_sms(), &chunks));
  at::Tensor partial = at::empty({chunks, cols}, dy.options().dtype(at::kFloat));
  AMPK_CHECK_CUDA(bias_act_backward(dy.data_ptr(), pre.data_ptr(), dz.data_ptr(), partial.data_ptr<float>(), rows,
                                    cols, chunks, dtype, act, stream));
  AMPK_CHECK_CUDA(reduce_partials(partial.data_ptr<float>(), dbias.data_ptr(), chunks, cols, dbias_dtype, stream));
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
  const Activation act = to_activation(activation, op);
  const c10::cuda::CUDAGuard guard(dy.device());
  at::Tensor dz = at::empty_like(dy);
  if (!dbias_dtype) {  // the flat elementwise pass: no column sums to keep per strip
    AMPK_CHECK_CUDA(act_backward(dy.data_ptr(), pre.data_ptr(), dz.data_ptr(), dy.numel(), dtype, act, num_sms(),
                                 at::cuda::getCurrentCUDAStream()));
    return {dz, at::empty({0}, dy.options())};
  }
  at::Tensor dbias = at::empty({dy.size(1)}, dy.options().dtype(*dbias_dtype));
  act_grad_and_dbias(dy, pre, dz, act, dbias, op);
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

void check_row_tensor(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg) {
  check_same_device(t, x, op, arg, "x");
  check_contiguous(t, op, arg);
  TORCH_CHECK(t.sizes() == x.sizes(), op, ": ", arg, " must have x's shape ", x.sizes(), ", got ", t.sizes());
}

void check_param(const at::Tensor& p, const at::Tensor& x, DType x_dtype, const char* op, const char* arg) {
  check_same_device(p, x, op, arg, "x");
  check_contiguous(p, op, arg);
  TORCH_CHECK(p.dim() == 1 && p.size(0) == x.size(1), op, ": ", arg, " must have shape (", x.size(1), ",), got ",
              p.sizes());
  const DType t = to_dtype(p.scalar_type(), op, arg);
  TORCH_CHECK(t == x_dtype || t == DType::kFloat32, op, ": ", arg, " must be ", x.scalar_type(),
              " or float32, got ", p.scalar_type());
}

// (out, residual_out, mean, rstd); residual_out is empty without a residual, mean for RMSNorm,
// mean and rstd without want_stats (inference: no backward reads them, so none is written).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, double eps, bool is_rms, std::optional<at::ScalarType> out_dtype,
    bool residual_in_fp32, bool want_stats) {
  constexpr const char* op = "norm_fwd_cuda";
  check_cuda(x, op, "x");
  check_contiguous(x, op, "x");
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (rows, cols), got shape ", x.sizes());
  NormForwardArgs a{};
  a.x_dtype = to_dtype(x.scalar_type(), op, "x");
  a.param_dtype = a.x_dtype;
  if (weight) {
    check_param(*weight, x, a.x_dtype, op, "weight");
    a.param_dtype = to_dtype(weight->scalar_type(), op, "weight");
  }
  if (bias) {
    TORCH_CHECK(!is_rms, op, ": RMSNorm takes no bias");
    check_param(*bias, x, a.x_dtype, op, "bias");
    TORCH_CHECK(!weight || bias->scalar_type() == weight->scalar_type(), op, ": bias dtype ", bias->scalar_type(),
                " must match weight dtype ", weight->scalar_type());
    a.param_dtype = to_dtype(bias->scalar_type(), op, "bias");
  }
  const at::ScalarType out_t = out_dtype.value_or(x.scalar_type());
  a.out_dtype = to_dtype(out_t, op, "out_dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor out = at::empty({rows, cols}, x.options().dtype(out_t));
  at::Tensor residual_out = at::empty({0}, x.options());
  if (residual) {
    check_row_tensor(*residual, x, op, "residual");
    a.residual_dtype = to_dtype(residual->scalar_type(), op, "residual");
    residual_out = at::empty({rows, cols}, x.options().dtype(residual_in_fp32 ? at::kFloat : x.scalar_type()));
    a.residual_out_dtype = to_dtype(residual_out.scalar_type(), op, "residual_out");
  }
  at::Tensor mean = at::empty({is_rms || !want_stats ? 0 : rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({want_stats ? rows : 0}, x.options().dtype(at::kFloat));
  a.x = x.data_ptr();
  a.residual = residual ? residual->data_ptr() : nullptr;
  a.weight = weight ? weight->data_ptr() : nullptr;
  a.bias = bias ? bias->data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.residual_out = residual ? residual_out.data_ptr() : nullptr;
  a.mean = is_rms || !want_stats ? nullptr : mean.data_ptr<float>();
  a.rstd = want_stats ? rstd.data_ptr<float>() : nullptr;
  a.rows = rows;
  a.cols = cols;
  a.eps = float(eps);
  a.is_rms = is_rms;
  AMPK_CHECK_CUDA(norm_forward(a, at::cuda::getCurrentCUDAStream()));
  return {out, residual_out, mean, rstd};
}

// (dx, dresidual, dweight, dbias). x is what the forward normalised (x, or x + residual);
// dresidual is empty unless dresidual_dtype differs from dx_dtype (then dx serves for both);
// dweight/dbias (in weight's dtype) are empty unless asked for.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_bwd(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& dresidual_out, bool is_rms, bool want_dweight,
    bool want_dbias, at::ScalarType dx_dtype, std::optional<at::ScalarType> dresidual_dtype,
    std::optional<at::ScalarType> param_dtype) {
  constexpr const char* op = "norm_bwd_cuda";
  check_cuda(x, op, "x");
  check_contiguous(x, op, "x");
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (rows, cols), got shape ", x.sizes());
  check_row_tensor(dy, x, op, "dy");
  const int64_t rows = x.size(0), cols = x.size(1);
  check_same_device(rstd, x, op, "rstd", "x");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.is_contiguous() && rstd.numel() == rows, op,
              ": rstd must be contiguous float32 of ", rows, " elements");
  if (!is_rms) {
    check_same_device(mean, x, op, "mean", "x");
    TORCH_CHECK(mean.scalar_type() == at::kFloat && mean.is_contiguous() && mean.numel() == rows, op,
                ": mean must be contiguous float32 of ", rows, " elements");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  NormBackwardArgs a{};
  // x and dy each in their own dtype (e.g. fp32 dy from an fp32-out norm beside 16-bit x)
  a.x_dtype = to_dtype(x.scalar_type(), op, "x");
  a.dy_dtype = to_dtype(dy.scalar_type(), op, "dy");
  a.param_dtype = a.x_dtype;
  if (weight) {
    // Any float dtype: the forward took the weight in its x's dtype or fp32, and x here may be
    // that forward's fp32 residual sum (residual_in_fp32 with 16-bit params). The kernels read
    // the weight in its own dtype.
    const DType w_dtype = to_dtype(weight->scalar_type(), op, "weight");
    check_param(*weight, x, w_dtype, op, "weight");
    a.param_dtype = w_dtype;
  }
  const at::ScalarType grad_param_t = param_dtype.value_or(weight ? weight->scalar_type() : x.scalar_type());
  const DType grad_param_dtype = to_dtype(grad_param_t, op, "param_dtype");
  if (dresidual_out) {
    check_row_tensor(*dresidual_out, x, op, "dresidual_out");
    a.dresidual_out_dtype = to_dtype(dresidual_out->scalar_type(), op, "dresidual_out");
  }
  a.dx_dtype = to_dtype(dx_dtype, op, "dx_dtype");
  at::Tensor dx = at::empty({rows, cols}, x.options().dtype(dx_dtype));
  at::Tensor dres = at::empty({0}, x.options());
  if (dresidual_dtype && *dresidual_dtype != dx_dtype) {
    a.dresidual_dtype = to_dtype(*dresidual_dtype, op, "dresidual_dtype");
    dres = at::empty({rows, cols}, x.options().dtype(*dresidual_dtype));
  }
  a.dy = dy.data_ptr();
  a.x = x.data_ptr();
  a.weight = weight ? weight->data_ptr() : nullptr;
  a.mean = is_rms ? nullptr : mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.dresidual_out = dresidual_out ? dresidual_out->data_ptr() : nullptr;
  a.dx = dx.data_ptr();
  a.dresidual = dres.numel() ? dres.data_ptr() : nullptr;
  a.rows = rows;
  a.cols = cols;
  a.is_rms = is_rms;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AMPK_CHECK_CUDA(norm_backward_blocks(a, num_sms(), &a.num_blocks));
  at::Tensor dweight = at::empty({want_dweight ? cols : 0}, x.options().dtype(grad_param_t));
  at::Tensor dbias = at::empty({want_dbias ? cols : 0}, x.options().dtype(grad_param_t));
  // One block (few rows) with fp32 parameter grads: its partial row is the gradient, written in
  // place, with no partials buffer and no reduce kernel (host time that small calls are made of).
  // Otherwise one fp32 buffer holds both partials (dweight's rows, then dbias's).
  const bool direct = a.num_blocks == 1 && grad_param_t == at::kFloat;
  at::Tensor partials;
  if (direct) {
    a.dweight_partial = want_dweight ? dweight.data_ptr<float>() : nullptr;
    a.dbias_partial = want_dbias ? dbias.data_ptr<float>() : nullptr;
  } else {
    const int64_t per = int64_t(a.num_blocks) * cols;
    partials = at::empty({(int64_t(want_dweight) + int64_t(want_dbias)) * per}, x.options().dtype(at::kFloat));
    a.dweight_partial = want_dweight ? partials.data_ptr<float>() : nullptr;
    a.dbias_partial = want_dbias ? partials.data_ptr<float>() + (want_dweight ? per : 0) : nullptr;
  }
  AMPK_CHECK_CUDA(norm_backward(a, stream));
  if (rows == 0) {  // no rows: the grads of the params are sums over nothing
    dweight.zero_();
    dbias.zero_();
  } else if (!direct) {
    AMPK_CHECK_CUDA(norm_reduce_partials(a.dweight_partial, a.dbias_partial,
                                         want_dweight ? dweight.data_ptr() : nullptr,
                                         want_dbias ? dbias.data_ptr() : nullptr, grad_param_dtype, a.num_blocks,
                                         cols, stream));
  }
  return {dx, dres, dweight, dbias};
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("norm_fwd_cuda(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, bool is_rms, "
        "ScalarType? out_dtype, bool residual_in_fp32, bool want_stats=True) -> "
        "(Tensor out, Tensor residual_out, Tensor mean, Tensor rstd)");
  m.def("norm_bwd_cuda(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, Tensor? dresidual_out, "
        "bool is_rms, bool want_dweight, bool want_dbias, ScalarType dx_dtype, ScalarType? dresidual_dtype, "
        "ScalarType? param_dtype) -> (Tensor dx, Tensor dresidual, Tensor dweight, Tensor dbias)");
}
TORCH_LIBRARY_IMPL(ampkernels, CompositeExplicitAutograd, m) {
  m.impl("norm_fwd_cuda", &norm_fwd);
  m.impl("norm_bwd_cuda", &norm_bwd);
}

// ---------------------------------------------------------------- norm: the op the norms call

// ampkernels::norm is what layer_norm / rms_norm call on a kernel backend, eager and under
// torch.compile alike: its schema and autograd are here, so that a training step runs no Python
// per norm in either pass (a Python autograd Function cost ~50 us of host per forward and ~100 us
// per backward, more than the kernels at most shapes). Its passes reach the kernels through the
// dispatcher, as the ops norm_{fwd,bwd}_<backend>: "cuda" above, "triton" registered by
// ampkernels/ops/layer_norm.py (which also gives every one of these ops its fake). So fake
// tensors trace it, each pass may run on another backend, and a test can stand the reference in
// for the kernels on CPU.
using NormFwdFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, bool, std::optional<at::ScalarType>, bool, bool);
using NormBwdFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, bool, bool, bool, at::ScalarType, std::optional<at::ScalarType>,
    std::optional<at::ScalarType>);

// A kernel op of this library (looked up once per call site: keep it static). The kernel ops have
// no autograd kernel: when no graph is being recorded (an autograd Function's passes, no_grad), a
// call runs below autograd and skips the boxed autograd fallback, a few us of host a call. With
// grad mode on (a backward with create_graph) the fallback stays and marks what it cannot
// differentiate, rather than returning results that silently do not require grad.
template <typename Fn>
struct KernelOp {
  c10::TypedOperatorHandle<Fn> handle;
  template <typename... Args>
  decltype(auto) call(Args&&... args) const {
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;
    if (!at::GradMode::is_enabled()) below.emplace();
    return handle.call(std::forward<Args>(args)...);
  }
};

template <typename Fn>
KernelOp<Fn> typed_op(const char* name) {
  return {c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>()};
}

// Whether an op's call builds an autograd graph: grad mode on and an input that requires grad.
bool wants_grad(std::initializer_list<const at::Tensor*> tensors,
                std::initializer_list<const std::optional<at::Tensor>*> optional) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : tensors)
    if (t->requires_grad()) return true;
  for (const std::optional<at::Tensor>* t : optional)
    if (*t && (*t)->requires_grad()) return true;
  return false;
}

// The ops with hand-written nodes have no forward derivative: dual inputs are an error, not a
// silently dropped tangent.
void refuse_forward_ad(const char* op, std::initializer_list<const at::Tensor*> tensors,
                       std::initializer_list<const std::optional<at::Tensor>*> optional) {
  using torch::autograd::isFwGradDefined;
  bool dual = false;
  for (const at::Tensor* t : tensors) dual = dual || isFwGradDefined(*t);
  for (const std::optional<at::Tensor>* t : optional) dual = dual || isFwGradDefined(*t);
  TORCH_CHECK(!dual, "ampkernels ", op, ": forward-mode AD is not supported (use backend='torch')");
}

std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A new autograd node of type T, owned the way this torch owns nodes: std::shared_ptr with
// torch's iterative deleter in older releases (2.11 among them), c10::intrusive_ptr from 2.13.
using NodePtr = decltype(torch::autograd::Edge().function);
template <typename T>
c10::intrusive_ptr<T> make_node_impl(std::true_type) {
  return c10::make_intrusive<T>();
}
template <typename T>
std::shared_ptr<T> make_node_impl(std::false_type) {
  return std::shared_ptr<T>(new T(), [](auto* node) { deleteNode(node); });  // found by ADL: Node's namespace
}
template <typename T>
auto make_node() {
  constexpr bool intrusive = !std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>;
  return make_node_impl<T>(std::integral_constant<bool, intrusive>());
}

// The (rows, last dim) view the kernels take of a contiguous t of any rank (t itself when 2-D).
// Made below autograd (an op's passes), it adds no autograd node.
at::Tensor as_rows(const at::Tensor& t) {
  if (t.dim() == 2) return t;
  c10::SymInt rows = 1;  // not view({-1, n}): that cannot size rows of n = 0 elements
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.sym_size(d);
  return t.view_symint({rows, t.sym_size(-1)});
}

// A kernel's (rows, n) output under x's leading dims, as a tensor of its own rather than a view
// (_unsafe_view): outputs of a custom autograd Function that are views may not be edited in
// place, and a norm's or a linear's output often is (x += ..., inplace activations).
at::Tensor like_rows_of(const at::Tensor& out, const at::Tensor& x) {
  if (x.dim() == 2) return out;
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = out.sym_size(-1);
  return at::_unsafe_view_symint(out, shape);
}

// The kernels of one backend. A static handle each: found once (the triton ops on their first use).
const KernelOp<NormFwdFn>& norm_fwd_op(c10::string_view backend) {
  if (backend == "cuda") {
    static const auto op = typed_op<NormFwdFn>("ampkernels::norm_fwd_cuda");
    return op;
  }
  TORCH_CHECK(backend == "triton", "norm: fwd_backend must be \"cuda\" or \"triton\", got \"", backend, "\"");
  static const auto op = typed_op<NormFwdFn>("ampkernels::norm_fwd_triton");
  return op;
}

const KernelOp<NormBwdFn>& norm_bwd_op(c10::string_view backend) {
  if (backend == "cuda") {
    static const auto op = typed_op<NormBwdFn>("ampkernels::norm_bwd_cuda");
    return op;
  }
  TORCH_CHECK(backend == "triton", "norm: bwd_backend must be \"cuda\" or \"triton\", got \"", backend, "\"");
  static const auto op = typed_op<NormBwdFn>("ampkernels::norm_bwd_triton");
  return op;
}

// One forward on a backend's kernel op. x (and residual) of any rank, contiguous, normalised over
// the last dim: the kernels see rows (views made here, below autograd, add no nodes), and the
// outputs come back under x's shape as tensors of their own. A bias in another dtype than the
// weight's is cast to it (the kernels take one param dtype; dbias goes back to bias's dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_forward_rows(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, double eps, bool is_rms, std::optional<at::ScalarType> out_dtype,
    bool residual_in_fp32, c10::string_view backend, bool want_stats) {
  std::optional<at::Tensor> bias_k = bias;
  if (bias && weight && bias->scalar_type() != weight->scalar_type()) bias_k = bias->to(weight->scalar_type());
  const std::optional<at::Tensor> residual2 = residual ? std::optional<at::Tensor>(as_rows(*residual)) : std::nullopt;
  auto [out, res_out, mean, rstd] = norm_fwd_op(backend).call(as_rows(x), weight, bias_k, residual2, eps, is_rms,
                                                              out_dtype, residual_in_fp32, want_stats);
  out = like_rows_of(out, x);
  if (residual) res_out = like_rows_of(res_out, x);
  return {out, res_out, mean, rstd};
}

// The forward alone (inference: nothing saved, so no mean/rstd written, 8 bytes a row).
std::tuple<at::Tensor, at::Tensor> norm_forward_only(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                     const std::optional<at::Tensor>& bias,
                                                     const std::optional<at::Tensor>& residual, double eps,
                                                     bool is_rms, std::optional<at::ScalarType> out_dtype,
                                                     bool residual_in_fp32, c10::string_view fwd_backend,
                                                     c10::string_view bwd_backend) {
  (void)bwd_backend;
  auto [out, res_out, mean, rstd] =
      norm_forward_rows(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, fwd_backend, false);
  return {out, res_out};
}

// The norm's autograd node, written as torch's generated nodes are (typed fields, no
// torch::autograd::Function, whose context -- a string-keyed map, a generic output wrapper --
// is host work per call that torch's own nodes do not do).
// The contract (docs/design.md, layer_norm): the backward re-reads what was normalised (x, or
// the stored residual sum), dbias comes back in bias's dtype, dresidual in the residual's (dx
// itself when that is x's), and an unused `out` gets a zero gradient. Next edges: x, weight,
// bias, residual (an absent one has an invalid edge).
struct NormBackward : public torch::autograd::Node {
  std::string name() const override { return "ampkernels::NormBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    input_.reset_data();
    weight_.reset_data();
    mean_.reset_data();
    rstd_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor x = input_is_output ? input_.unpack(getptr()) : input_.unpack();
    const at::Tensor w = weight_.unpack();
    const std::optional<at::Tensor> weight = defined_or_none(w);
    const std::optional<at::ScalarType> param_dtype =
        weight ? std::optional<at::ScalarType>(weight->scalar_type()) : bias_dtype;
    at::Tensor dout = grads[0];
    if (!dout.defined()) {  // only residual_out was used
      dout = at::zeros_symint(x.sym_sizes(), x.options().dtype(out_dtype));
    }
    const at::Tensor dres_out = grads.size() > 1 ? grads[1] : at::Tensor();
    const bool want_dx = task_should_compute_output(0);
    const bool want_dw = task_should_compute_output(1);
    const bool want_db = task_should_compute_output(2);
    const bool want_dres = task_should_compute_output(3);
    const auto rows = [](const at::Tensor& t) { return as_rows(t.contiguous()); };
    auto [dx, dres, dw, db] = bwd->call(rows(dout), as_rows(x), weight, mean_.unpack(), rstd_.unpack(),
                                        dres_out.defined() ? std::optional<at::Tensor>(rows(dres_out)) : std::nullopt,
                                        is_rms, want_dw, want_db, x_dtype, residual_dtype, param_dtype);
    if (x.dim() != 2) {
      dx = dx.view_symint(x.sym_sizes());
      if (dres.numel() != 0) dres = dres.view_symint(x.sym_sizes());
    }
    return {want_dx ? dx : at::Tensor(), want_dw ? dw : at::Tensor(), want_db ? db.to(*bias_dtype) : at::Tensor(),
            want_dres ? (*residual_dtype != x_dtype ? dres : dx) : at::Tensor()};
  }

  torch::autograd::SavedVariable input_;  // x, or the residual sum (then an output of this node)
  torch::autograd::SavedVariable weight_, mean_, rstd_;
  const KernelOp<NormBwdFn>* bwd = nullptr;
  bool input_is_output = false, is_rms = false;
  at::ScalarType x_dtype = at::kFloat, out_dtype = at::kFloat;
  std::optional<at::ScalarType> residual_dtype, bias_dtype;
};

std::tuple<at::Tensor, at::Tensor> norm_autograd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                 const std::optional<at::Tensor>& bias,
                                                 const std::optional<at::Tensor>& residual, double eps, bool is_rms,
                                                 std::optional<at::ScalarType> out_dtype, bool residual_in_fp32,
                                                 c10::string_view fwd_backend, c10::string_view bwd_backend) {
  refuse_forward_ad("norm", {&x}, {&weight, &bias, &residual});
  if (!wants_grad({&x}, {&weight, &bias, &residual})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return norm_forward_only(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, fwd_backend,
                             bwd_backend);
  }
  const KernelOp<NormBwdFn>& bwd = norm_bwd_op(bwd_backend);  // an unknown name fails before any work
  at::Tensor out, res_out, mean, rstd;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    std::tie(out, res_out, mean, rstd) =
        norm_forward_rows(x, weight, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, fwd_backend, true);
  }
  auto node = make_node<NormBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias, residual));
  torch::autograd::set_history(out, node);
  if (residual) torch::autograd::set_history(res_out, node);  // else res_out is empty and needs no grad
  // saved after set_history: the residual sum is this node's output, whose version counter catches
  // in-place edits before backward, as the input's does
  node->input_ = torch::autograd::SavedVariable(residual ? res_out : x, residual.has_value());
  node->weight_ = torch::autograd::SavedVariable(weight, false);
  node->mean_ = torch::autograd::SavedVariable(mean, false);
  node->rstd_ = torch::autograd::SavedVariable(rstd, false);
  node->bwd = &bwd;
  node->input_is_output = residual.has_value();
  node->is_rms = is_rms;
  node->x_dtype = x.scalar_type();
  node->out_dtype = out.scalar_type();
  if (residual) node->residual_dtype = residual->scalar_type();
  if (bias) node->bias_dtype = bias->scalar_type();
  return {out, res_out};
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("norm(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, bool is_rms, "
        "ScalarType? out_dtype, bool residual_in_fp32, str fwd_backend, str bwd_backend) -> "
        "(Tensor out, Tensor residual_out)");
}
TORCH_LIBRARY_IMPL(ampkernels, Autograd, m) {
  m.impl("norm", &norm_autograd);
}
// below autograd (inference mode, a tensor subclass's dispatch): the forward alone
TORCH_LIBRARY_IMPL(ampkernels, CompositeExplicitAutograd, m) {
  m.impl("norm", &norm_forward_only);
}

// ---------------------------------------------------------------- linear_act
//
// y = act(x @ W^T + b), x (M, K), W (N, K), y (M, N), all row-major. cuBLASLt is
// column-major, so every GEMM is written for the transposes (ld = row length):
//   forward  y^T (N x M)  = W(N x K) . x^T(K x M):  A = W (K x N stored, transposed), B = x (K x M)
//   dx^T     (K x M)      = W^T(K x N) . dz^T(N x M):  A = W (K x N), B = dz (N x M)
//   dW^T     (K x N)      = x^T(K x M) . dz(M x N):    A = x (K x M), B = dz (N x M, transposed);
//                           for identity, BGRADB sums op(B) = dz over M: dbias, fused into this
//                           GEMM (cuBLASLt runs it as a kernel of its own after the GEMM: other
//                           activations sum dbias in their act' pass instead, at no extra read).
// Epilogues fuse bias, ReLU and GELU(tanh) (+ its pre-activation as aux). cuBLASLt's
// DGELU/DRELU_BGRAD epilogues multiply a GEMM's *output* by act'(aux); in one layer's
// backward act' multiplies the GEMM's *input* dz, so they do not apply here: dz = dy * act'(pre)
// is one vectorised elementwise pass (act_backward in linear_act.cu; bias_act_backward in
// bias_act.cu when it also sums dbias). Other activations (erf
// GELU, SiLU, squared ReLU) run the GEMM with the bias epilogue, then the bias_act kernel.
// Inputs cuBLASLt cannot take with a fused epilogue (pointers not 16-byte aligned, N or K not
// multiples of 8, K = 0) run the explicit fallback: at::mm (cuBLAS, any alignment) + the
// bias_act kernel.

bool lt_aligned(const at::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Runs one cuBLASLt GEMM. false (and a one-time warning) when cuBLASLt has no algorithm for
// this epilogue and shape: the caller then takes its unfused path. Launch failures throw.
bool try_lt(const LtGemm& gemm, const at::Tensor& like) {
  LtGemm g = gemm;
  g.deterministic = at::globalContext().deterministicAlgorithms();
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  // torch's own workspace for this cuBLASLt handle and stream (its addmm epilogues use it): held
  // once per stream, so our GEMMs add no 32 MiB allocation to a training step's peak memory (its
  // size is torch's choice, CUBLASLT_WORKSPACE_SIZE; the plans are keyed by it)
  (void)like;
  void* const workspace_ptr = at::cuda::getCUDABlasLtWorkspace();
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
#else
  // ours, from the caching allocator: stream-ordered, so freeing it after the async launch is safe
  constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;
  const at::Tensor workspace = at::empty({int64_t(kLtWorkspaceBytes)}, like.options().dtype(at::kByte));
  void* const workspace_ptr = workspace.data_ptr();
  const size_t workspace_size = kLtWorkspaceBytes;
#endif
  bool no_plan = false;
  const char* err = lt_matmul(g, at::cuda::getCurrentCUDABlasLtHandle(), workspace_ptr, workspace_size,
                              at::cuda::getCurrentCUDAStream(), &no_plan);
  if (err != nullptr && no_plan) {
    TORCH_WARN_ONCE("ampkernels.linear_act: ", err, "; using the unfused path for such GEMMs");
    return false;
  }
  TORCH_CHECK(err == nullptr, "ampkernels.linear_act: ", err);
  return true;
}

void check_linear_inputs(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_cuda(x, op, "x");
  check_same_device(weight, x, op, "weight", "x");
  check_contiguous(x, op, "x");
  check_contiguous(weight, op, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op,
              ": x must be (M, K) and weight (N, K), got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op,
              ": x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight dtype ", weight.scalar_type(),
              " differs from x dtype ", x.scalar_type());
}

// cuBLASLt with a fused epilogue can take these operands (all 16-byte aligned, N and K multiples of 8).
bool lt_fusable(const at::Tensor& a, const at::Tensor& b, int64_t n, int64_t k) {
  return k > 0 && n % 8 == 0 && k % 8 == 0 && lt_aligned(a) && lt_aligned(b);
}

// (y, pre): pre = x W^T + b in x's dtype when store_pre, else empty. fuse=false forces the
// fallback (tests compare both paths on the same inputs).
std::tuple<at::Tensor, at::Tensor> linear_act_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias, int64_t activation,
                                                  bool store_pre, bool fuse) {
  constexpr const char* op = "linear_act_fwd_cuda";
  check_linear_inputs(x, weight, op);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (bias) {
    check_same_device(*bias, x, op, "bias", "x");
    check_contiguous(*bias, op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape (", N, ",), got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), op, ": bias dtype ", bias->scalar_type(),
                " differs from x dtype ", x.scalar_type());
  }
  const Activation act = to_activation(activation, op);
  const DType dtype = to_dtype(x.scalar_type(), op, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor pre = at::empty({store_pre ? M : 0, store_pre ? N : 0}, x.options());
  if (M == 0 || N == 0) return {y, pre};

  const bool lt = fuse && lt_fusable(x, weight, N, K) && (!bias || lt_aligned(*bias));
  void* bias_ptr = bias ? bias->data_ptr() : nullptr;
  if (lt) {
    const LtGemm gemm{N, M, K, true, false, weight.data_ptr(), K, x.data_ptr(), K, y.data_ptr(), N, dtype,
                      bias ? LtEpilogue::kBias : LtEpilogue::kDefault, bias_ptr, nullptr, 0};
    // 1. the activation in the epilogue, where cuBLASLt has it
    LtGemm g = gemm;
    bool fused = true;
    if (act == Activation::kReLU && !store_pre) {  // relu's backward reads its output (y > 0 iff pre > 0)
      g.epilogue = bias ? LtEpilogue::kReLUBias : LtEpilogue::kReLU;
    } else if (act == Activation::kGELUTanh) {  // cuBLASLt's GELU is the tanh approximation
      g.epilogue = store_pre ? (bias ? LtEpilogue::kGELUAuxBias : LtEpilogue::kGELUAux)
                             : (bias ? LtEpilogue::kGELUBias : LtEpilogue::kGELU);
      g.aux = store_pre ? pre.data_ptr() : nullptr;
      g.aux_ld = store_pre ? N : 0;
    } else if (act != Activation::kIdentity) {
      fused = false;
    }
    if (fused && try_lt(g, x)) {
      if (store_pre && act == Activation::kIdentity) pre.copy_(y);
      return {y, pre};
    }
    // 2. GEMM + bias into z, then act(z) (in place when pre is not kept)
    if (act != Activation::kIdentity) {
      at::Tensor z = store_pre ? pre : y;
      g = gemm;
      g.d = z.data_ptr();
      if (try_lt(g, x)) {
        AMPK_CHECK_CUDA(
            bias_act_forward(z.data_ptr(), nullptr, y.data_ptr(), nullptr, M, N, dtype, dtype, act, stream));
        return {y, pre};
      }
    }
  }
  // fallback: cuBLAS at any alignment, then the fused bias + activation kernel
  const at::Tensor z = x.mm(weight.t());
  AMPK_CHECK_CUDA(bias_act_forward(z.data_ptr(), bias_ptr, y.data_ptr(), store_pre ? pre.data_ptr() : nullptr, M, N,
                                   dtype, dtype, act, stream));
  return {y, pre};
}

// (dx, dweight, dbias), each empty when not asked for. `saved` is what forward kept: the
// pre-activation, or for ReLU its output; unused (may be empty) for identity. dbias is
// accumulated in fp32 and returned in x's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_act_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                              const at::Tensor& weight, const at::Tensor& saved,
                                                              int64_t activation, bool need_dx, bool need_dw,
                                                              bool need_db, bool fuse) {
  constexpr const char* op = "linear_act_bwd_cuda";
  check_linear_inputs(x, weight, op);
  check_same_device(dy, x, op, "dy", "x");
  check_contiguous(dy, op, "dy");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(dy.dim() == 2 && dy.size(0) == M && dy.size(1) == N, op, ": dy must have shape (", M, ", ", N,
              "), got ", dy.sizes());
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), op, ": dy dtype ", dy.scalar_type(), " differs from x dtype ",
              x.scalar_type());
  const Activation act = to_activation(activation, op);
  const DType dtype = to_dtype(x.scalar_type(), op, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor dx = need_dx ? at::empty({M, K}, x.options()) : at::empty({0}, x.options());
  at::Tensor dw = need_dw ? at::empty({N, K}, x.options()) : at::empty({0}, x.options());
  at::Tensor db = need_db ? at::empty({N}, x.options()) : at::empty({0}, x.options());
  if (M == 0) {
    if (need_dx) dx.zero_();
    if (need_dw) dw.zero_();
    if (need_db) db.zero_();
    return {dx, dw, db};
  }
  at::Tensor dz = dy;
  bool db_done = false;
  if (act != Activation::kIdentity) {
    check_same_device(saved, x, op, "saved", "x");
    check_contiguous(saved, op, "saved");
    TORCH_CHECK(saved.sizes() == dy.sizes() && saved.scalar_type() == dy.scalar_type(), op,
                ": saved must match dy (", dy.sizes(), ", ", dy.scalar_type(), "), got ", saved.sizes(), ", ",
                saved.scalar_type());
    dz = at::empty_like(dy);
    if (need_db) {  // dbias from the act' pass, not from BGRADB: cuBLASLt runs that as a kernel of its own
      act_grad_and_dbias(dy, saved, dz, act, db, op);
      db_done = true;
    } else {
      AMPK_CHECK_CUDA(act_backward(dy.data_ptr(), saved.data_ptr(), dz.data_ptr(), M * N, dtype, act, num_sms(),
                                   stream));
    }
  }
  const bool lt = fuse && lt_fusable(x, weight, N, K) && lt_aligned(dz);
  if (need_dx) {
    const LtGemm g{K, M, N, false, false, weight.data_ptr(), K, dz.data_ptr(), N, dx.data_ptr(), K, dtype,
                   LtEpilogue::kDefault, nullptr, nullptr, 0};
    if (!(lt && try_lt(g, x))) dx.copy_(dz.mm(weight));
  }
  if (need_dw) {
    const bool bgrad = need_db && !db_done;  // identity: the bias gradient fused into this GEMM
    LtGemm g{K, N, M, false, true, x.data_ptr(), K, dz.data_ptr(), N, dw.data_ptr(), K, dtype,
             bgrad ? LtEpilogue::kBGradB : LtEpilogue::kDefault, bgrad ? db.data_ptr() : nullptr, nullptr, 0};
    bool dw_done = lt && try_lt(g, x);
    db_done = db_done || (bgrad && dw_done);
    if (!dw_done && bgrad) {  // no BGRADB algorithm: the plain GEMM, dbias summed below
      g.epilogue = LtEpilogue::kDefault;
      g.bias = nullptr;
      dw_done = lt && try_lt(g, x);
    }
    if (!dw_done) dw.copy_(dz.t().mm(x));
  }
  if (need_db && !db_done) db.copy_(dz.sum(at::IntArrayRef{0}, false, at::kFloat));  // fp32 accumulation, fixed order
  return {dx, dw, db};
}

// dy *= act'(saved), in place: for a caller that owns dy (fused_mlp's backward, on its dh
// temporary), so the act' pass needs no second hidden-sized buffer. linear_act_bwd above
// writes a new dz instead: its dy is autograd's gradient, which others may still read.
// need_db: also returns the fp32 column sums of the result (the bias gradient), from the same
// pass; else an empty tensor.
at::Tensor act_backward_inplace(const at::Tensor& dy, const at::Tensor& saved, int64_t activation, bool need_db) {
  constexpr const char* op = "act_backward_cuda_";
  check_cuda(dy, op, "dy");
  check_same_device(saved, dy, op, "saved", "dy");
  check_contiguous(dy, op, "dy");
  check_contiguous(saved, op, "saved");
  TORCH_CHECK(dy.scalar_type() == at::kHalf || dy.scalar_type() == at::kBFloat16, op,
              ": dy must be float16 or bfloat16, got ", dy.scalar_type());
  TORCH_CHECK(saved.sizes() == dy.sizes() && saved.scalar_type() == dy.scalar_type(), op,
              ": saved must match dy (", dy.sizes(), ", ", dy.scalar_type(), "), got ", saved.sizes(), ", ",
              saved.scalar_type());
  TORCH_CHECK(!need_db || dy.dim() == 2, op, ": need_db wants a 2-D dy (rows, features), got ", dy.sizes());
  const Activation act = to_activation(activation, op);
  const DType dtype = to_dtype(dy.scalar_type(), op, "dy");
  const c10::cuda::CUDAGuard guard(dy.device());
  if (need_db) {
    at::Tensor db = at::empty({dy.size(1)}, dy.options().dtype(at::kFloat));
    act_grad_and_dbias(dy, saved, dy, act, db, op);
    return db;
  }
  AMPK_CHECK_CUDA(act_backward(dy.data_ptr(), saved.data_ptr(), dy.data_ptr(), dy.numel(), dtype, act, num_sms(),
                               at::cuda::getCurrentCUDAStream()));
  return at::empty({0}, dy.options().dtype(at::kFloat));
}

std::tuple<int64_t, int64_t> linear_act_lt_plans() {
  const auto [plans, timed] = lt_cached_plans();
  return {int64_t(plans), int64_t(timed)};
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("linear_act_fwd_cuda(Tensor x, Tensor weight, Tensor? bias, int activation, bool store_pre, bool fuse)"
        " -> (Tensor y, Tensor pre)");
  m.def("linear_act_bwd_cuda(Tensor dy, Tensor x, Tensor weight, Tensor saved, int activation, bool need_dx,"
        " bool need_dw, bool need_db, bool fuse) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  m.def("linear_act_lt_plans_cuda() -> (int plans, int timed)", &linear_act_lt_plans);
  m.def("act_backward_cuda_(Tensor(a!) dy, Tensor saved, int activation, bool need_db) -> Tensor dbias");
}
TORCH_LIBRARY_IMPL(ampkernels, CompositeExplicitAutograd, m) {
  m.impl("linear_act_fwd_cuda", &linear_act_fwd);
  m.impl("linear_act_bwd_cuda", &linear_act_bwd);
  m.impl("act_backward_cuda_", &act_backward_inplace);
}

// ---------------------------------------------------------------- the GEMM ops: one op each, autograd in C++

// ampkernels::linear_act, ::fused_mlp, ::gated_linear_act and ::gated_mlp, eager and compiled,
// each with its autograd here (as ampkernels::norm: neither pass runs Python per call); without
// grad (or below autograd: inference mode, a tensor subclass) the forward alone, saving nothing.
// Their passes reach one backend's kernels through the dispatcher: the *_cuda ops above and in
// gated_linear_act.cu, the *_triton ops registered by ampkernels/ops/linear_act.py and
// gated_linear_act.py (which also give every one of these ops its fake). The "torch" backend is
// no op: torch ops under torch's autograd.
// x of any rank, contiguous: the kernels see its (M, K) rows (views below autograd add no
// nodes) and the output is a tensor of its own under x's leading dims. What is saved is an
// input or the returned output itself where it can be, whose version counter catches in-place
// edits before backward. cast_to: the compute dtype when the parameters are fp32 master weights
// under autocast; they are cast here, and each gradient comes back in its parameter's dtype.
using LinearFwdFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                       const std::optional<at::Tensor>&, int64_t, bool);
using LinearFwdCudaFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                           const std::optional<at::Tensor>&, int64_t, bool, bool);
using LinearBwdCudaFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&, const at::Tensor&, int64_t,
                                                                       bool, bool, bool, bool);
using DzFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, bool);
using BiasActFwdFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                                        bool);
using ActFwdFn = at::Tensor(const at::Tensor&, int64_t);
using ActBwdInplaceFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool);
using GatedFwdFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const std::optional<at::Tensor>&,
                                                      const std::optional<at::Tensor>&, int64_t, bool);
using GatedActBwdFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool);

constexpr int64_t kIdentityId = int64_t(Activation::kIdentity);

bool cuda_backend(c10::string_view backend, const char* op) {
  if (backend == "cuda") return true;
  TORCH_CHECK(backend == "triton", op, ": backend must be \"cuda\" or \"triton\", got \"", backend, "\"");
  return false;
}

// A tensor of a trace (fake or functional: torch.compile, export, opcheck): nothing is reused in
// place or freed early there.
bool traced(const at::Tensor& t) {
  return t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// ops/shared.py dies_with_this_backward: a saved tensor no later backward reads (the graph is not
// kept) and that owns its whole storage may be overwritten or freed once used
bool dies_with_this_backward(const at::Tensor& saved) {
  return !traced(saved) && !torch::autograd::get_current_graph_task_keep_graph() && !saved.is_view() &&
         saved.storage().nbytes() == size_t(saved.numel()) * saved.element_size();
}

at::Tensor cast_param(const at::Tensor& t, std::optional<at::ScalarType> to) { return to ? t.to(*to) : t; }
std::optional<at::Tensor> cast_param(const std::optional<at::Tensor>& t, std::optional<at::ScalarType> to) {
  return t && to ? std::optional<at::Tensor>(t->to(*to)) : t;
}

// dz^T inp: in `dtype` straight from the GEMM where it can write it (fp32 for 16-bit dz on CUDA,
// where this torch has mm.dtype: 2.8 and newer), so fp32 master weights get no 16-bit copy and
// no cast kernel (~0.2 ms for a 4096 x 16384 weight on the H200); else in dz's dtype, for the
// caller to cast (fused_mlp: once dz is freed).
at::Tensor weight_grad_uncast(const at::Tensor& dz, const at::Tensor& inp, at::ScalarType dtype) {
  if (dtype == at::kFloat && dz.scalar_type() != dtype && dz.is_cuda()) {
    static const auto mm_dtype = c10::Dispatcher::singleton().findSchema({"aten::mm", "dtype"});
    if (mm_dtype)
      return mm_dtype->typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ScalarType)>().call(dz.t(), inp,
                                                                                                    dtype);
  }
  return dz.t().mm(inp);
}

at::Tensor weight_grad(const at::Tensor& dz, const at::Tensor& inp, at::ScalarType dtype) {
  return weight_grad_uncast(dz, inp, dtype).to(dtype);
}

// ---- one backend's kernels (a static handle each: found once, the triton ops on first use)

// (y, pre) = (act(x W^T + b), x W^T + b); pre empty unless store_pre
std::tuple<at::Tensor, at::Tensor> linear_fwd(c10::string_view backend, const at::Tensor& x, const at::Tensor& w,
                                              const std::optional<at::Tensor>& b, int64_t act, bool store_pre) {
  if (cuda_backend(backend, "linear_act")) {
    static const auto op = typed_op<LinearFwdCudaFn>("ampkernels::linear_act_fwd_cuda");
    return op.call(x, w, b, act, store_pre, true);
  }
  static const auto op = typed_op<LinearFwdFn>("ampkernels::linear_act_fwd_triton");
  return op.call(x, w, b, act, store_pre);
}

// (dx, dweight, dbias) of one linear_act, each empty when not asked for; saved: the
// pre-activation or ReLU's output (unused for identity); dweight and dbias in grad_dtype, else
// x's, dbias summed in fp32. cuda: linear_act_bwd_cuda (identity: dbias fused into the
// weight-gradient GEMM), but identity with master weights takes torch's GEMM for an fp32 dweight,
// which saves more than cuBLASLt's fused bias gradient (a 20 us sum). Triton: its dz pass (act'
// and the dbias sums in one kernel; for identity the sums alone), then the two GEMMs on cuBLAS.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_bwd(c10::string_view backend, const at::Tensor& dy,
                                                          const at::Tensor& x, const at::Tensor& w,
                                                          const at::Tensor& saved, int64_t act, bool need_dx,
                                                          bool need_dw, bool need_db,
                                                          std::optional<at::ScalarType> grad_dtype) {
  const bool identity = act == kIdentityId;
  const at::ScalarType gd = grad_dtype.value_or(x.scalar_type());
  if (cuda_backend(backend, "linear_act") && !(grad_dtype && identity)) {
    static const auto op = typed_op<LinearBwdCudaFn>("ampkernels::linear_act_bwd_cuda");
    auto [dx, dw, db] = op.call(dy, x, w, saved, act, need_dx, need_dw, need_db, true);
    if (grad_dtype) {
      if (need_dw) dw = dw.to(gd);
      if (need_db) db = db.to(gd);
    }
    return {dx, dw, db};
  }
  at::Tensor dz = dy, db32;
  if (backend == "triton") {  // identity: dz is dy, and the op sums its columns alone
    static const auto op = typed_op<DzFn>("ampkernels::linear_act_dz_triton");
    std::tie(dz, db32) = op.call(dy, saved, act, need_db);
    if (identity) dz = dy;
  } else if (need_db) {
    db32 = dy.sum(at::IntArrayRef{0}, false, at::kFloat);
  }
  const at::Tensor empty = at::empty({0}, dy.options());
  return {need_dx ? dz.mm(w) : empty, need_dw ? weight_grad(dz, x, gd) : empty, need_db ? db32.to(gd) : empty};
}

// h = act(pre) by the forward epilogue's formulas: fused_mlp's backward gets the forward's h bit for bit
at::Tensor act_fwd(c10::string_view backend, const at::Tensor& pre, int64_t act) {
  if (cuda_backend(backend, "fused_mlp")) {
    static const auto op = typed_op<BiasActFwdFn>("ampkernels::bias_act_fwd_cuda");
    return std::get<0>(op.call(pre, std::nullopt, act, false));
  }
  static const auto op = typed_op<ActFwdFn>("ampkernels::act_fwd_triton");
  return op.call(pre, act);
}

// dy *= act'(saved) IN PLACE (for a caller that owns dy: no second hidden-sized buffer); the fp32
// column sums of the result when need_db, else empty
at::Tensor act_bwd_(c10::string_view backend, const at::Tensor& dy, const at::Tensor& saved, int64_t act,
                    bool need_db) {
  if (cuda_backend(backend, "fused_mlp")) {
    static const auto op = typed_op<ActBwdInplaceFn>("ampkernels::act_backward_cuda_");
    return op.call(dy, saved, act, need_db);
  }
  static const auto op = typed_op<ActBwdInplaceFn>("ampkernels::act_backward_triton_");
  return op.call(dy, saved, act, need_db);
}

// (h, gu): h = act(g) * u, gu = [g | u] (M, 2H) when store, else empty
std::tuple<at::Tensor, at::Tensor> gated_fwd(c10::string_view backend, const at::Tensor& x, const at::Tensor& wg,
                                             const at::Tensor& wu, const std::optional<at::Tensor>& bg,
                                             const std::optional<at::Tensor>& bu, int64_t act, bool store) {
  if (cuda_backend(backend, "gated_linear_act")) {
    static const auto op = typed_op<GatedFwdFn>("ampkernels::gated_linear_act_fwd_cuda");
    return op.call(x, wg, wu, bg, bu, act, store);
  }
  static const auto op = typed_op<GatedFwdFn>("ampkernels::gated_linear_act_fwd_triton");
  return op.call(x, wg, wu, bg, bu, act, store);
}

// h = act(g) * u from gu by the forward epilogue's formulas (the forward's h bit for bit)
at::Tensor gated_act_fwd(c10::string_view backend, const at::Tensor& gu, int64_t act) {
  if (cuda_backend(backend, "gated_mlp")) {
    static const auto op = typed_op<ActFwdFn>("ampkernels::gated_act_fwd_cuda");
    return op.call(gu, act);
  }
  static const auto op = typed_op<ActFwdFn>("ampkernels::gated_act_fwd_triton");
  return op.call(gu, act);
}

// dgu = [dh * u * act'(g) | dh * act(g)] (dgu may be gu: in place); its fp32 column sums when need_db
at::Tensor gated_act_bwd(c10::string_view backend, const at::Tensor& dh, const at::Tensor& gu, const at::Tensor& dgu,
                         int64_t act, bool need_db) {
  if (cuda_backend(backend, "gated_linear_act")) {
    static const auto op = typed_op<GatedActBwdFn>("ampkernels::gated_act_bwd_cuda");
    return op.call(dh, gu, dgu, act, need_db);
  }
  static const auto op = typed_op<GatedActBwdFn>("ampkernels::gated_act_bwd_triton");
  return op.call(dh, gu, dgu, act, need_db);
}

// ---- linear_act: y = act(x W^T + b)

// Saved: x, the weight (compute dtype) and one hidden-sized tensor: the pre-activation, or for
// ReLU the output (y > 0 exactly where pre > 0), or nothing for identity. recompute: no
// hidden-sized tensor; backward recomputes the pre-activation (one GEMM), so the bias is saved.
// A hand-written node, as the norm's (NormBackward). Next edges: x, weight, bias.
struct LinearActBackward : public torch::autograd::Node {
  std::string name() const override { return "ampkernels::LinearActBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    weight_.reset_data();
    bias_.reset_data();
    saved_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor x = x_.unpack(), w = weight_.unpack();
    const at::Tensor saved = saved_is_output ? saved_.unpack(getptr()) : saved_.unpack();
    const bool need_dx = task_should_compute_output(0), need_dw = task_should_compute_output(1);
    const bool need_db = task_should_compute_output(2);
    const at::Tensor x2 = as_rows(x);
    at::Tensor s = saved.defined() ? as_rows(saved) : at::empty({0}, x.options());
    if (recompute && activation != kIdentityId)
      s = std::get<0>(linear_fwd(backend, x2, w, defined_or_none(bias_.unpack()), kIdentityId, false));
    auto [dx, dw, db] = linear_bwd(backend, as_rows(grads[0].contiguous()), x2, w, s, activation, need_dx, need_dw,
                                   need_db, grad_dtype);
    if (need_dx && x.dim() != 2) dx = dx.view_symint(x.sym_sizes());
    return {need_dx ? dx : at::Tensor(), need_dw ? dw : at::Tensor(), need_db ? db : at::Tensor()};
  }

  torch::autograd::SavedVariable x_, weight_, bias_;
  torch::autograd::SavedVariable saved_;  // the pre-activation, or ReLU's output (then this node's output)
  std::string backend;
  int64_t activation = 0;
  std::optional<at::ScalarType> grad_dtype;  // the weight's own dtype when it was cast for the GEMMs
  bool recompute = false, saved_is_output = false;
};

at::Tensor linear_act_forward_only(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, int64_t activation,
                                   std::optional<at::ScalarType> cast_to, bool recompute, c10::string_view backend) {
  (void)recompute;
  auto [y, pre] =
      linear_fwd(backend, as_rows(x), cast_param(weight, cast_to), cast_param(bias, cast_to), activation, false);
  return like_rows_of(y, x);
}

at::Tensor linear_act_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               int64_t activation, std::optional<at::ScalarType> cast_to, bool recompute,
                               c10::string_view backend) {
  refuse_forward_ad("linear_act", {&x, &weight}, {&bias});
  if (!wants_grad({&x, &weight}, {&bias})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return linear_act_forward_only(x, weight, bias, activation, cast_to, recompute, backend);
  }
  const auto act = to_activation(activation, "linear_act");
  const bool saves_hidden = act != Activation::kIdentity && !recompute;
  const bool store_pre = saves_hidden && act != Activation::kReLU;  // ReLU's derivative reads its output
  at::Tensor y, pre, w;
  std::optional<at::Tensor> b;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    w = cast_param(weight, cast_to);
    b = cast_param(bias, cast_to);
    std::tie(y, pre) = linear_fwd(backend, as_rows(x), w, b, activation, store_pre);
    y = like_rows_of(y, x);
  }
  auto node = make_node<LinearActBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias));
  torch::autograd::set_history(y, node);
  node->x_ = torch::autograd::SavedVariable(x, false);
  node->weight_ = torch::autograd::SavedVariable(w, false);
  if (recompute && b) node->bias_ = torch::autograd::SavedVariable(*b, false);
  if (store_pre) node->saved_ = torch::autograd::SavedVariable(pre, false);
  else if (saves_hidden) node->saved_ = torch::autograd::SavedVariable(y, true);
  node->saved_is_output = saves_hidden && !store_pre;
  node->backend = std::string(backend);
  node->activation = activation;
  node->grad_dtype = cast_to ? std::optional<at::ScalarType>(weight.scalar_type()) : std::nullopt;
  node->recompute = recompute;
  return y;
}

// ---- fused_mlp: act(x W1^T + b1) W2^T + b2

// The memory contract of docs/design.md: saved are x, w1 as given (under autocast the fp32
// parameter, cast again in backward instead of keeping a cast alive through the step's peak),
// w2's cast and the pre-activation; h is recomputed from pre in backward and freed before dh
// exists, and pre and w2's cast are freed once read when the graph is not kept, so at most two
// hidden-sized tensors are alive.
struct FusedMLPTrain : public torch::autograd::Function<FusedMLPTrain> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                            const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                            const std::optional<at::Tensor>& b2, int64_t activation,
                            std::optional<at::ScalarType> cast_to, c10::string_view backend) {
    const at::Tensor w2c = cast_param(w2, cast_to);
    const std::optional<at::Tensor> b1c = cast_param(b1, cast_to), b2c = cast_param(b2, cast_to);
    at::Tensor out, pre;
    {  // h lives only for the second GEMM
      auto [h, p] = linear_fwd(backend, as_rows(x), cast_param(w1, cast_to), b1c, activation, true);
      out = like_rows_of(at::linear(h, w2c, b2c), x);
      pre = p;
    }
    ctx->save_for_backward({x, w1, w2c, pre});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["backend"] = std::string(backend);
    ctx->saved_data["w2_is_own_cast"] = !w2c.is_same(w2);
    ctx->saved_data["has_b1"] = b1.has_value();
    ctx->saved_data["has_b2"] = b2.has_value();
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x_in = saved[0], &w1 = saved[1], &w2 = saved[2], &pre = saved[3];
    const at::Tensor x = as_rows(x_in);
    const std::string& backend = ctx->saved_data["backend"].toStringRef();
    const int64_t activation = ctx->saved_data["activation"].toInt();
    const bool need_db1 = ctx->saved_data["has_b1"].toBool(), need_db2 = ctx->saved_data["has_b2"].toBool();
    const at::Tensor dout = as_rows(grads[0].contiguous());
    at::Tensor dw2, db2;
    {  // 1. layer 2's gradients from the recomputed h, freed before dh exists
      const at::Tensor h = act_fwd(backend, pre, activation);
      auto [unused, dw, db] = linear_bwd(backend, dout, h, w2, at::empty({0}, dout.options()), kIdentityId, false,
                                         true, need_db2, std::nullopt);
      dw2 = dw;
      db2 = db;
    }
    // 2. dh = dout W2, act'(pre) applied to it in place (dh is this backward's own temporary)
    const bool release = dies_with_this_backward(pre);
    const bool release_w2 = release && ctx->saved_data["w2_is_own_cast"].toBool() && dies_with_this_backward(w2);
    at::Tensor dh = dout.mm(w2);
    const at::Tensor db1_32 = act_bwd_(backend, dh, pre, activation, need_db1);
    if (release) pre.storage().unsafeGetStorageImpl()->reset();  // stream-ordered frees
    if (release_w2) w2.storage().unsafeGetStorageImpl()->reset();
    // 3. layer 1: dx first, so that w1's cast is gone before dw1 exists
    at::Tensor dx = dh.mm(w1.to(x.scalar_type()));
    at::Tensor dw1 = weight_grad_uncast(dh, x, w1.scalar_type());
    dh.reset();
    dw1 = dw1.to(w1.scalar_type());
    if (x_in.dim() != 2) dx = dx.view_symint(x_in.sym_sizes());
    return {dx, dw1, need_db1 ? db1_32.to(x.scalar_type()) : at::Tensor(), dw2, need_db2 ? db2 : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor fused_mlp_forward_only(const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
                                  const at::Tensor& w2, const std::optional<at::Tensor>& b2, int64_t activation,
                                  std::optional<at::ScalarType> cast_to, c10::string_view backend) {
  auto [h, pre] = linear_fwd(backend, as_rows(x), cast_param(w1, cast_to), cast_param(b1, cast_to), activation, false);
  return like_rows_of(at::linear(h, cast_param(w2, cast_to), cast_param(b2, cast_to)), x);
}

at::Tensor fused_mlp_autograd(const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
                              const at::Tensor& w2, const std::optional<at::Tensor>& b2, int64_t activation,
                              std::optional<at::ScalarType> cast_to, c10::string_view backend) {
  if (!wants_grad({&x, &w1, &w2}, {&b1, &b2})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return fused_mlp_forward_only(x, w1, b1, w2, b2, activation, cast_to, backend);
  }
  return FusedMLPTrain::apply(x, w1, b1, w2, b2, activation, cast_to, backend);
}

// ---- gated_linear_act: h = act(x Wg^T + bg) * (x Wu^T + bu), and gated_mlp: down(h)

// The gate and up weights as the kernels take them: cast to cast_to into the two halves of one
// (2H, K) buffer, `packed` (what two casts cost, and the GEMMs then run packed: one GEMM each
// way), or as given (packed is then undefined; packed_weights may still find them adjacent).
struct GateUp {
  at::Tensor wg, wu, packed;

  GateUp(const at::Tensor& g, const at::Tensor& u, std::optional<at::ScalarType> cast_to) : wg(g), wu(u) {
    if (cast_to) {
      packed = at::empty_symint({2 * g.sym_size(0), g.sym_size(1)}, g.options().dtype(*cast_to));
      split();
      wg.copy_(g);
      wu.copy_(u);
    }
  }
  explicit GateUp(const at::Tensor& p) : packed(p) { split(); }

  void split() {
    const c10::SymInt hidden = packed.sym_size(0) / 2;
    wg = packed.narrow_symint(0, 0, hidden);
    wu = packed.narrow_symint(0, hidden, hidden);
  }
  // saved for backward: the packed buffer alone, or both weights
  at::Tensor first() const { return packed.defined() ? packed : wg; }
  at::Tensor second() const { return packed.defined() ? at::Tensor() : wu; }
  static GateUp saved(const at::Tensor& first, const at::Tensor& second) {
    return second.defined() ? GateUp(first, second, std::nullopt) : GateUp(first);
  }
};

// [wg; wu] as one (2H, K) view when wu's memory follows wg's (ops/gated_linear_act.py packed_weights)
std::optional<at::Tensor> packed_weights(const at::Tensor& wg, const at::Tensor& wu) {
  if (traced(wg)) return std::nullopt;  // no storage to compare
  if (wg.sizes() != wu.sizes() || wg.scalar_type() != wu.scalar_type() || wg.device() != wu.device() ||
      wg.numel() == 0 || !wg.is_contiguous() || !wu.is_contiguous())
    return std::nullopt;
  if (wu.storage().data_ptr().get() != wg.storage().data_ptr().get() ||
      wu.storage_offset() != wg.storage_offset() + wg.numel())
    return std::nullopt;
  return wg.as_strided({2 * wg.size(0), wg.size(1)}, {wg.size(1), 1});
}

int64_t dtype_id(const std::optional<at::Tensor>& t) { return t ? int64_t(t->scalar_type()) : int64_t(-1); }

// The gated GEMMs' gradients from dh and gu = [g | u]: one fused elementwise pass (dg, du and the
// fp32 bias sums; over gu itself when `inplace`), then dx = dg Wg + du Wu (one GEMM when packed),
// dWg = dg^T x, dWu = du^T x. Each is undefined when its dtype is absent (dx: unless need_dx).
std::array<at::Tensor, 5> gated_grads(c10::string_view backend, const at::Tensor& dh, const at::Tensor& x,
                                      const GateUp& w, const at::Tensor& gu,
                                      int64_t activation, bool need_dx, std::optional<at::ScalarType> wg_dt,
                                      std::optional<at::ScalarType> wu_dt, std::optional<at::ScalarType> bg_dt,
                                      std::optional<at::ScalarType> bu_dt, bool inplace) {
  const c10::SymInt hidden = dh.sym_size(1);
  const at::Tensor dgu = inplace ? gu : at::empty_like(gu);
  const at::Tensor db32 = gated_act_bwd(backend, dh, gu, dgu, activation, bg_dt || bu_dt);
  const at::Tensor dg = dgu.narrow_symint(1, 0, hidden), du = dgu.narrow_symint(1, hidden, hidden);
  at::Tensor dx;
  if (need_dx) {
    if (w.packed.defined()) {
      dx = dgu.mm(w.packed);
    } else if (const auto p = packed_weights(w.wg, w.wu)) {
      dx = dgu.mm(*p);
    } else {
      dx = dg.mm(w.wg);
      dx.addmm_(du, w.wu);
    }
  }
  return {dx, wg_dt ? weight_grad(dg, x, *wg_dt) : at::Tensor(), wu_dt ? weight_grad(du, x, *wu_dt) : at::Tensor(),
          bg_dt ? db32.narrow_symint(0, 0, hidden).to(*bg_dt, false, true) : at::Tensor(),
          bu_dt ? db32.narrow_symint(0, hidden, hidden).to(*bu_dt, false, true) : at::Tensor()};
}

// Saved: x, the weights (compute dtype) and ONE buffer gu = [g | u] (M, 2H), never h;
// recompute: no gu (recomputed in backward: the GEMMs), so the biases are saved.
struct GatedLinearActTrain : public torch::autograd::Function<GatedLinearActTrain> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& wg,
                            const at::Tensor& wu, const std::optional<at::Tensor>& bg,
                            const std::optional<at::Tensor>& bu, int64_t activation,
                            std::optional<at::ScalarType> cast_to, bool recompute, c10::string_view backend) {
    ctx->saved_data["dtypes"] = std::vector<int64_t>{dtype_id(wg), dtype_id(wu), dtype_id(bg), dtype_id(bu)};
    const GateUp w(wg, wu, cast_to);
    const std::optional<at::Tensor> bgc = cast_param(bg, cast_to), buc = cast_param(bu, cast_to);
    auto [h, gu] = gated_fwd(backend, as_rows(x), w.wg, w.wu, bgc, buc, activation, !recompute);
    const auto if_recompute = [&](const std::optional<at::Tensor>& b) {
      return recompute && b ? *b : at::Tensor();
    };
    ctx->save_for_backward(
        {x, w.first(), w.second(), if_recompute(bgc), if_recompute(buc), recompute ? at::Tensor() : gu});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["recompute"] = recompute;
    ctx->saved_data["backend"] = std::string(backend);
    // needs_input_grad counts the tensor inputs only (an absent bias has no edge)
    int64_t edge = 3;
    ctx->saved_data["bg_edge"] = bg ? edge++ : int64_t(-1);
    ctx->saved_data["bu_edge"] = bu ? edge++ : int64_t(-1);
    return like_rows_of(h, x);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x_in = saved[0];
    const GateUp w = GateUp::saved(saved[1], saved[2]);
    const at::Tensor x = as_rows(x_in);
    const std::string& backend = ctx->saved_data["backend"].toStringRef();
    const int64_t activation = ctx->saved_data["activation"].toInt();
    const bool recompute = ctx->saved_data["recompute"].toBool();
    at::Tensor gu = saved[5];
    if (recompute)
      gu = std::get<1>(gated_fwd(backend, x, w.wg, w.wu, defined_or_none(saved[3]), defined_or_none(saved[4]),
                                 activation, true));
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const auto want = [&](size_t i, int64_t edge) -> std::optional<at::ScalarType> {
      if (edge < 0 || !ctx->needs_input_grad(size_t(edge))) return std::nullopt;
      return at::ScalarType(dtypes[i]);
    };
    // dg, du over gu itself when nothing reads gu after this backward
    auto g = gated_grads(backend, as_rows(grads[0].contiguous()), x, w, gu, activation,
                         ctx->needs_input_grad(0), want(0, 1), want(1, 2), want(2, ctx->saved_data["bg_edge"].toInt()),
                         want(3, ctx->saved_data["bu_edge"].toInt()),
                         recompute ? !traced(gu) : dies_with_this_backward(gu));
    if (g[0].defined() && x_in.dim() != 2) g[0] = g[0].view_symint(x_in.sym_sizes());
    return {g[0], g[1], g[2], g[3], g[4], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor gated_linear_act_forward_only(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                                         const std::optional<at::Tensor>& bg, const std::optional<at::Tensor>& bu,
                                         int64_t activation, std::optional<at::ScalarType> cast_to, bool recompute,
                                         c10::string_view backend) {
  (void)recompute;
  const GateUp w(wg, wu, cast_to);
  auto [h, gu] = gated_fwd(backend, as_rows(x), w.wg, w.wu, cast_param(bg, cast_to), cast_param(bu, cast_to),
                           activation, false);
  return like_rows_of(h, x);
}

at::Tensor gated_linear_act_autograd(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                                     const std::optional<at::Tensor>& bg, const std::optional<at::Tensor>& bu,
                                     int64_t activation, std::optional<at::ScalarType> cast_to, bool recompute,
                                     c10::string_view backend) {
  if (!wants_grad({&x, &wg, &wu}, {&bg, &bu})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return gated_linear_act_forward_only(x, wg, wu, bg, bu, activation, cast_to, recompute, backend);
  }
  return GatedLinearActTrain::apply(x, wg, wu, bg, bu, activation, cast_to, recompute, backend);
}

// gated_mlp keeps x, the weights and gu only: h, the down projection's input, is recomputed from
// gu in backward (one elementwise pass) and freed before dh exists.
struct GatedMLPTrain : public torch::autograd::Function<GatedMLPTrain> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& wg,
                            const at::Tensor& wu, const std::optional<at::Tensor>& bg,
                            const std::optional<at::Tensor>& bu, const at::Tensor& wd,
                            const std::optional<at::Tensor>& bd, int64_t activation,
                            std::optional<at::ScalarType> cast_to, c10::string_view backend) {
    ctx->saved_data["dtypes"] = std::vector<int64_t>{dtype_id(wg), dtype_id(wu), dtype_id(bg), dtype_id(bu),
                                                     dtype_id(wd), dtype_id(bd)};
    const GateUp w(wg, wu, cast_to);
    const at::Tensor wdc = cast_param(wd, cast_to);
    auto [h, gu] = gated_fwd(backend, as_rows(x), w.wg, w.wu, cast_param(bg, cast_to), cast_param(bu, cast_to),
                             activation, true);
    const at::Tensor out = like_rows_of(at::linear(h, wdc, cast_param(bd, cast_to)), x);
    ctx->save_for_backward({x, w.first(), w.second(), wdc, gu});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["backend"] = std::string(backend);
    int64_t edge = 3;
    ctx->saved_data["bg_edge"] = bg ? edge++ : int64_t(-1);
    ctx->saved_data["bu_edge"] = bu ? edge++ : int64_t(-1);
    ctx->saved_data["wd_edge"] = edge++;
    ctx->saved_data["bd_edge"] = bd ? edge++ : int64_t(-1);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x_in = saved[0], &wd = saved[3], &gu = saved[4];
    const std::string& backend = ctx->saved_data["backend"].toStringRef();
    const int64_t activation = ctx->saved_data["activation"].toInt();
    const auto dtypes = ctx->saved_data["dtypes"].toIntVector();
    const auto want = [&](size_t i, const char* key) -> std::optional<at::ScalarType> {
      const int64_t edge = i < 2 ? int64_t(i + 1) : ctx->saved_data[key].toInt();
      if (edge < 0 || !ctx->needs_input_grad(size_t(edge))) return std::nullopt;
      return at::ScalarType(dtypes[i]);
    };
    const auto wd_dt = want(4, "wd_edge"), bd_dt = want(5, "bd_edge");
    const at::Tensor dout = as_rows(grads[0].contiguous());
    at::Tensor dwd, dbd;
    {  // down projection: dWd from the recomputed h, freed before dh exists
      const at::Tensor h = gated_act_fwd(backend, gu, activation);
      if (wd_dt) dwd = weight_grad(dout, h, *wd_dt);
    }
    if (bd_dt) dbd = dout.sum(at::IntArrayRef{0}, false, at::kFloat).to(*bd_dt);
    auto g = gated_grads(backend, dout.mm(wd), as_rows(x_in), GateUp::saved(saved[1], saved[2]), gu, activation,
                         ctx->needs_input_grad(0),
                         want(0, nullptr), want(1, nullptr), want(2, "bg_edge"), want(3, "bu_edge"),
                         dies_with_this_backward(gu));
    if (g[0].defined() && x_in.dim() != 2) g[0] = g[0].view_symint(x_in.sym_sizes());
    return {g[0], g[1], g[2], g[3], g[4], dwd, dbd, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor gated_mlp_forward_only(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                                  const std::optional<at::Tensor>& bg, const std::optional<at::Tensor>& bu,
                                  const at::Tensor& wd, const std::optional<at::Tensor>& bd, int64_t activation,
                                  std::optional<at::ScalarType> cast_to, c10::string_view backend) {
  const at::Tensor h = gated_linear_act_forward_only(as_rows(x), wg, wu, bg, bu, activation, cast_to, false, backend);
  return like_rows_of(at::linear(h, cast_param(wd, cast_to), cast_param(bd, cast_to)), x);
}

at::Tensor gated_mlp_autograd(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                              const std::optional<at::Tensor>& bg, const std::optional<at::Tensor>& bu,
                              const at::Tensor& wd, const std::optional<at::Tensor>& bd, int64_t activation,
                              std::optional<at::ScalarType> cast_to, c10::string_view backend) {
  if (!wants_grad({&x, &wg, &wu, &wd}, {&bg, &bu, &bd})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return gated_mlp_forward_only(x, wg, wu, bg, bu, wd, bd, activation, cast_to, backend);
  }
  return GatedMLPTrain::apply(x, wg, wu, bg, bu, wd, bd, activation, cast_to, backend);
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("linear_act(Tensor x, Tensor weight, Tensor? bias, int activation, ScalarType? cast_to, bool recompute, "
        "str backend) -> Tensor");
  m.def("fused_mlp(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, int activation, ScalarType? cast_to, "
        "str backend) -> Tensor");
  m.def("gated_linear_act(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor? gate_bias, Tensor? up_bias, "
        "int activation, ScalarType? cast_to, bool recompute, str backend) -> Tensor");
  m.def("gated_mlp(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor? gate_bias, Tensor? up_bias, "
        "Tensor down_weight, Tensor? down_bias, int activation, ScalarType? cast_to, str backend) -> Tensor");
}
TORCH_LIBRARY_IMPL(ampkernels, Autograd, m) {
  m.impl("linear_act", &linear_act_autograd);
  m.impl("fused_mlp", &fused_mlp_autograd);
  m.impl("gated_linear_act", &gated_linear_act_autograd);
  m.impl("gated_mlp", &gated_mlp_autograd);
}
// below autograd (inference mode, a tensor subclass's dispatch): the forward alone
TORCH_LIBRARY_IMPL(ampkernels, CompositeExplicitAutograd, m) {
  m.impl("linear_act", &linear_act_forward_only);
  m.impl("fused_mlp", &fused_mlp_forward_only);
  m.impl("gated_linear_act", &gated_linear_act_forward_only);
  m.impl("gated_mlp", &gated_mlp_forward_only);
}

// ---------------------------------------------------------------- rotary_embedding

// One tensor's rotation on the cuda kernels: x 4-D with an even last dim (the head dim), cos and
// sin 3-D of one shape and dtype, their dim unsqueeze_dim added and broadcast to x's shape (as
// Hugging Face's apply_rotary_pos_emb does). The output, in out_dtype, has x's layout where x is
// dense, else x's shape contiguous. backward: x is the output's gradient and the transposed
// rotation gives the input's.
at::Tensor rotary_cuda(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                       int64_t unsqueeze_dim, at::ScalarType out_dtype, bool backward) {
  constexpr const char* op = "rotary_cuda";
  check_cuda(x_in, op, "x");
  check_same_device(cos_in, x_in, op, "cos", "x");
  check_same_device(sin_in, x_in, op, "sin", "x");
  TORCH_CHECK(x_in.dim() == 4, op, ": x must be 4-D, got shape ", x_in.sizes());
  TORCH_CHECK(cos_in.dim() == 3 && sin_in.sizes() == cos_in.sizes(), op,
              ": cos and sin must be 3-D and of one shape, got ", cos_in.sizes(), " and ", sin_in.sizes());
  TORCH_CHECK(cos_in.scalar_type() == sin_in.scalar_type(), op, ": cos and sin must share a dtype, got ",
              cos_in.scalar_type(), " and ", sin_in.scalar_type());
  const int64_t d = x_in.size(3);
  TORCH_CHECK(d % 2 == 0 && cos_in.size(2) == d, op, ": the head dim (x's last) must be even and cos's last, got x ",
              x_in.sizes(), " and cos ", cos_in.sizes());
  RotaryArgs a{};
  a.x_dtype = to_dtype(x_in.scalar_type(), op, "x");
  a.cs_dtype = to_dtype(cos_in.scalar_type(), op, "cos");
  a.out_dtype = to_dtype(out_dtype, op, "out_dtype");
  const at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const auto broadcast = [&](const at::Tensor& t) {  // raises, as torch does, where t does not broadcast
    return (t.stride(2) == 1 ? t : t.contiguous()).unsqueeze(unsqueeze_dim).expand(x.sizes());
  };
  const at::Tensor cos = broadcast(cos_in), sin = broadcast(sin_in);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x, x.options().dtype(out_dtype));
  if (out.stride(3) != 1) out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  a.x = x.data_ptr();
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.out = out.data_ptr();
  a.rows = x.size(0) * x.size(1) * x.size(2);
  a.size1 = x.size(1);
  a.size2 = x.size(2);
  a.head_dim = d;
  for (int i = 0; i < 3; ++i) {
    a.x_stride[i] = x.stride(i);
    a.cos_stride[i] = cos.stride(i);
    a.sin_stride[i] = sin.stride(i);
    a.out_stride[i] = out.stride(i);
  }
  a.backward = backward;
  AMPK_CHECK_CUDA(rotary(a, num_sms(), at::cuda::getCurrentCUDAStream()));
  return out;
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("rotary_cuda(Tensor x, Tensor cos, Tensor sin, int unsqueeze_dim, ScalarType out_dtype, bool backward) "
        "-> Tensor");
}
TORCH_LIBRARY_IMPL(ampkernels, CompositeExplicitAutograd, m) {
  m.impl("rotary_cuda", &rotary_cuda);
}

// ampkernels::rotary_embedding rotates q and k (Hugging Face's apply_rotary_pos_emb) on one
// backend's kernel op, rotary_<backend> ("triton" registered by ampkernels/ops/rotary.py, with
// the fakes), its autograd a node of its own as the norm's: it saves cos and sin only (the
// rotation is linear in q and k). cos and sin get no gradient (the Python op sends a call whose
// cos or sin requires one to the torch backend).
using RotaryFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType, bool);

const KernelOp<RotaryFn>& rotary_op(c10::string_view backend) {
  if (backend == "cuda") {
    static const auto op = typed_op<RotaryFn>("ampkernels::rotary_cuda");
    return op;
  }
  TORCH_CHECK(backend == "triton", "rotary_embedding: backend must be \"cuda\" or \"triton\", got \"", backend, "\"");
  static const auto op = typed_op<RotaryFn>("ampkernels::rotary_triton");
  return op;
}

std::tuple<at::Tensor, at::Tensor> rotary_forward_only(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                       const at::Tensor& sin, int64_t unsqueeze_dim,
                                                       at::ScalarType q_dtype, at::ScalarType k_dtype,
                                                       c10::string_view backend) {
  const KernelOp<RotaryFn>& op = rotary_op(backend);
  return {op.call(q, cos, sin, unsqueeze_dim, q_dtype, false), op.call(k, cos, sin, unsqueeze_dim, k_dtype, false)};
}

struct RotaryBackward : public torch::autograd::Node {
  std::string name() const override { return "ampkernels::RotaryBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    cos_.reset_data();
    sin_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor cos = cos_.unpack(), sin = sin_.unpack();
    const auto grad = [&](int i, at::ScalarType dtype) {  // an unused output's undefined grad: zero
      return task_should_compute_output(i) && grads[i].defined()
                 ? op->call(grads[i], cos, sin, unsqueeze_dim, dtype, true)
                 : at::Tensor();
    };
    return {grad(0, q_dtype), grad(1, k_dtype)};
  }

  torch::autograd::SavedVariable cos_, sin_;
  const KernelOp<RotaryFn>* op = nullptr;
  int64_t unsqueeze_dim = 1;
  at::ScalarType q_dtype = at::kFloat, k_dtype = at::kFloat;  // the inputs', which their grads take
};

std::tuple<at::Tensor, at::Tensor> rotary_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                   const at::Tensor& sin, int64_t unsqueeze_dim,
                                                   at::ScalarType q_dtype, at::ScalarType k_dtype,
                                                   c10::string_view backend) {
  refuse_forward_ad("rotary_embedding", {&q, &k, &cos, &sin}, {});
  if (!wants_grad({&q, &k, &cos, &sin}, {})) {
    at::AutoDispatchBelowADInplaceOrView below;
    return rotary_forward_only(q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype, backend);
  }
  TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(),
              "ampkernels rotary_embedding: the kernels give no gradient for cos and sin, which require grad "
              "(use backend='torch')");
  const KernelOp<RotaryFn>& op = rotary_op(backend);
  at::Tensor q_out, k_out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    q_out = op.call(q, cos, sin, unsqueeze_dim, q_dtype, false);
    k_out = op.call(k, cos, sin, unsqueeze_dim, k_dtype, false);
  }
  auto node = make_node<RotaryBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(q, k));
  torch::autograd::set_history(q_out, node);
  torch::autograd::set_history(k_out, node);
  node->cos_ = torch::autograd::SavedVariable(cos, false);
  node->sin_ = torch::autograd::SavedVariable(sin, false);
  node->op = &op;
  node->unsqueeze_dim = unsqueeze_dim;
  node->q_dtype = q.scalar_type();
  node->k_dtype = k.scalar_type();
  return {q_out, k_out};
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim, ScalarType q_dtype, "
        "ScalarType k_dtype, str backend) -> (Tensor q_out, Tensor k_out)");
}
TORCH_LIBRARY_IMPL(ampkernels, Autograd, m) {
  m.impl("rotary_embedding", &rotary_autograd);
}
TORCH_LIBRARY_IMPL(ampkernels, CompositeExplicitAutograd, m) {
  m.impl("rotary_embedding", &rotary_forward_only);
}

}  // namespace
}  // namespace ampk

// ---------------------------------------------------------------- the modules' eager entry

namespace ampk {
namespace {

using NormOpFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                                    double, bool, std::optional<at::ScalarType>, bool,
                                                    c10::string_view, c10::string_view);

// A torch.Tensor or nn.Parameter, not a subclass (whose __torch_function__ the Python path honours)
bool plain_tensor(PyObject* obj) { return THPVariable_CheckExact(obj); }

// The GIL released for its scope (restored before an exception reaches HANDLE_TH_ERRORS): the
// entries run the op without it, as torch's own bindings do.
struct GilReleased {
  PyThreadState* state = PyEval_SaveThread();
  GilReleased() = default;
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;
  ~GilReleased() { PyEval_RestoreThread(state); }
};

// backend None/"auto"/"cuda" (None: AMPKERNELS_BACKEND unset, empty, auto or cuda): 1 "auto", 2 "cuda", 0 other
int auto_or_cuda(PyObject* backend_obj) {
  const auto classify = [](const char* name) {
    if (name == nullptr || !*name || !std::strcmp(name, "auto")) return 1;
    return std::strcmp(name, "cuda") ? 0 : 2;
  };
  if (backend_obj == Py_None) return classify(std::getenv("AMPKERNELS_BACKEND"));
  if (!PyUnicode_Check(backend_obj)) return 0;
  const char* name = PyUnicode_AsUTF8(backend_obj);
  if (name == nullptr) {
    PyErr_Clear();  // not UTF-8: the Python path says what is wrong with it
    return 0;
  }
  return classify(name);
}

// ampkernels.nn.LayerNorm / RMSNorm's forward on the host's critical path, without the Python
// of layer_norm() (~12 us a call on the H200's host, several times that inside a model):
//   norm_module(x, weight, bias, eps, is_rms, out_dtype, backend, cuda_below) -> out or NotImplemented
//   norm_module(..., cuda_below, residual, residual_in_fp32) -> (out, x + residual) or NotImplemented
// (the modules' forward_residual: residual CUDA, contiguous, x's shape, fp16/bf16/fp32).
// It takes only the call whose answer is plain: tensors (no subclass, no torch-function mode),
// x CUDA, contiguous, fp16/bf16/fp32, a 1-D weight over its last dim in x's dtype or fp32 (and a
// bias so, for LayerNorm), eps a float (None: RMSNorm's default), out_dtype None, a dtype or
// "autocast", backend None/"auto"/"cuda" with AMPKERNELS_BACKEND unset/auto/cuda, and "auto"
// choosing the cuda kernels (ops/layer_norm.py _preferences: x.numel() < cuda_below, or 16-bit x
// with fp32 params). It then calls the op ampkernels::norm through the dispatcher, as
// layer_norm() does (autograd, dispatch modes and the profiler see the same op). Anything else is
// NotImplemented: the module then runs layer_norm(), which validates and decides in full.
PyObject* norm_module(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 8 && nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "norm_module takes 8 or 10 arguments");
    return nullptr;
  }
  PyObject *x_obj = args[0], *w_obj = args[1], *b_obj = args[2], *eps_obj = args[3], *rms_obj = args[4];
  PyObject *dtype_obj = args[5], *backend_obj = args[6], *below_obj = args[7];
  const bool is_rms = rms_obj == Py_True;
  if (!plain_tensor(x_obj) || !plain_tensor(w_obj) || (b_obj != Py_None && (is_rms || !plain_tensor(b_obj))) ||
      at::impl::torch_function_mode_enabled())
    Py_RETURN_NOTIMPLEMENTED;
  const at::Tensor& x = THPVariable_Unpack(x_obj);
  const at::Tensor& w = THPVariable_Unpack(w_obj);
  const at::ScalarType xt = x.scalar_type(), wt = w.scalar_type();
  if (!x.is_cuda() || (xt != at::kHalf && xt != at::kBFloat16 && xt != at::kFloat) || x.dim() < 1 ||
      x.numel() == 0 || !x.is_contiguous())
    Py_RETURN_NOTIMPLEMENTED;
  if (w.dim() != 1 || w.size(0) != x.size(-1) || w.device() != x.device() || !w.is_contiguous() ||
      (wt != xt && wt != at::kFloat))
    Py_RETURN_NOTIMPLEMENTED;
  std::optional<at::Tensor> bias;
  if (b_obj != Py_None) {
    const at::Tensor& b = THPVariable_Unpack(b_obj);
    if (b.dim() != 1 || b.size(0) != x.size(-1) || b.device() != x.device() || !b.is_contiguous() ||
        (b.scalar_type() != xt && b.scalar_type() != at::kFloat))
      Py_RETURN_NOTIMPLEMENTED;
    bias = b;
  }
  std::optional<at::Tensor> residual;
  if (nargs == 10) {
    if (!plain_tensor(args[8])) Py_RETURN_NOTIMPLEMENTED;
    const at::Tensor& r = THPVariable_Unpack(args[8]);
    const at::ScalarType rt = r.scalar_type();
    if (!r.sizes().equals(x.sizes()) || r.device() != x.device() || !r.is_contiguous() ||
        (rt != at::kHalf && rt != at::kBFloat16 && rt != at::kFloat))
      Py_RETURN_NOTIMPLEMENTED;
    residual = r;
  }
  const bool residual_in_fp32 = nargs == 10 && args[9] == Py_True;
  double eps;
  if (PyFloat_CheckExact(eps_obj)) {
    eps = PyFloat_AS_DOUBLE(eps_obj);
  } else if (eps_obj == Py_None && is_rms) {
    eps = FLT_EPSILON;  // torch's RMSNorm default: the epsilon of its fp32 compute type
  } else {
    Py_RETURN_NOTIMPLEMENTED;
  }
  std::optional<at::ScalarType> out_dtype;
  if (THPDtype_Check(dtype_obj)) {
    out_dtype = reinterpret_cast<THPDtype*>(dtype_obj)->scalar_type;
    if (*out_dtype != at::kHalf && *out_dtype != at::kBFloat16 && *out_dtype != at::kFloat) Py_RETURN_NOTIMPLEMENTED;
  } else if (PyUnicode_Check(dtype_obj)) {
    if (PyUnicode_CompareWithASCIIString(dtype_obj, "autocast") != 0) Py_RETURN_NOTIMPLEMENTED;
    if (at::autocast::is_autocast_enabled(at::kCUDA)) out_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  } else if (dtype_obj != Py_None) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  if (auto_or_cuda(backend_obj) == 0) Py_RETURN_NOTIMPLEMENTED;
  const long long below = PyLong_AsLongLong(below_obj);
  if (below == -1 && PyErr_Occurred()) return nullptr;
  if (!(x.numel() < below || (wt == at::kFloat && xt != at::kFloat))) Py_RETURN_NOTIMPLEMENTED;

  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("ampkernels::norm", "").typed<NormOpFn>();
  std::tuple<at::Tensor, at::Tensor> outs;
  {
    GilReleased released;
    outs = op.call(x, w, bias, residual, eps, is_rms, out_dtype, residual_in_fp32, "cuda", "cuda");
  }
  if (!residual) return THPVariable_Wrap(std::move(std::get<0>(outs)));
  PyObject* out = THPVariable_Wrap(std::move(std::get<0>(outs)));
  if (out == nullptr) return nullptr;
  PyObject* sum = THPVariable_Wrap(std::move(std::get<1>(outs)));
  if (sum == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  PyObject* pair = PyTuple_Pack(2, out, sum);
  Py_DECREF(out);
  Py_DECREF(sum);
  return pair;
  END_HANDLE_TH_ERRORS
}

// The GEMM ops' eager entry, as norm_module for the norms: linear_act(), fused_mlp(),
// gated_linear_act() and gated_mlp() (ops/*.py; the modules call them) hand it their plain call
// first, and it runs the op on the cuda kernels without their Python (~10 us a call on the H200's
// host):
//   gemm_entry(op, x, params, activation, backend, not_cuda_first, buckets) -> out or NotImplemented
// op: 0 linear_act (params: weight, bias), 1 fused_mlp (w1, b1, w2, b2), 2 gated_linear_act (gate
// and up weights, their biases), 3 gated_mlp (those, then the down weight and bias). It takes the
// call whose answer is plain: tensors (no subclass, no torch-function mode), CUDA x of >= 2 dims,
// contiguous, not empty, every tensor contiguous on x's device with the shapes the op needs;
// under CUDA autocast x cast to its 16-bit dtype and the parameters fp16/bf16/fp32 (cast_to when
// one differs), without autocast all of one 16-bit dtype; backend None/"auto"/"cuda" with
// AMPKERNELS_BACKEND unset/auto/cuda, deterministic algorithms off, and "auto" choosing the cuda
// kernels: the key below not in not_cuda_first (a dict the op's Python builds from its table,
// ops/shared.py gemm_entry_key: key -> whether torch comes first), buckets = (tiny_below,
// small_below, medium_below) of M*N*K. For linear_act a torch-first cell runs here too, as the
// Python path runs it (F.linear, then the activation, with torch's autograd nodes); the other
// ops decline it. Anything else is NotImplemented: the caller then validates and decides in full.
using GemmLinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                std::optional<at::ScalarType>, bool, c10::string_view);
using GemmMLPFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                             std::optional<at::ScalarType>, c10::string_view);
using GemmGatedFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
                               std::optional<at::ScalarType>, bool, c10::string_view);
using GemmGatedMLPFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                  const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                  std::optional<at::ScalarType>, c10::string_view);

// act(z) as torch computes it (ampkernels.reference.act_fwd), with torch's autograd nodes
at::Tensor torch_activation(const at::Tensor& z, Activation act) {
  switch (act) {
    case Activation::kIdentity: return z;
    case Activation::kReLU: return at::relu(z);
    case Activation::kGELU: return at::gelu(z);
    case Activation::kGELUTanh: return at::gelu(z, "tanh");
    case Activation::kSiLU: return at::silu(z);
    case Activation::kSquaredReLU: {
      const at::Tensor r = at::relu(z);
      return r * r;
    }
  }
  TORCH_CHECK(false, "torch_activation: unknown activation ", int(act));
}

constexpr int kBuckets = 4;  // ops/shared.py BUCKETS: tiny, small, medium, large

PyObject* gemm_entry(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 7 || !PyLong_CheckExact(args[0]) || !PyTuple_CheckExact(args[2]) || !PyLong_CheckExact(args[3]) ||
      !PyDict_CheckExact(args[5]) || !PyTuple_CheckExact(args[6]) || PyTuple_GET_SIZE(args[6]) != kBuckets - 1) {
    PyErr_SetString(PyExc_TypeError, "gemm_entry(op, x, params, activation, backend, not_cuda_first, buckets)");
    return nullptr;
  }
  const long op_id = PyLong_AsLong(args[0]), act = PyLong_AsLong(args[3]);
  constexpr Py_ssize_t kParams[] = {2, 4, 4, 6};
  PyObject* params_obj = args[2];
  if (op_id < 0 || op_id > 3 || PyTuple_GET_SIZE(params_obj) != kParams[op_id]) {
    PyErr_SetString(PyExc_ValueError, "gemm_entry: unknown op or wrong number of params");
    return nullptr;
  }
  const bool gated = op_id >= 2;
  if (gated ? !(act == int64_t(Activation::kSiLU) || act == int64_t(Activation::kGELU) ||
                act == int64_t(Activation::kGELUTanh))
            : !(act >= 0 && act <= int64_t(Activation::kSquaredReLU)))
    Py_RETURN_NOTIMPLEMENTED;
  const int backend = auto_or_cuda(args[4]);
  if (backend == 0 || !plain_tensor(args[1]) || at::impl::torch_function_mode_enabled() ||
      at::globalContext().deterministicAlgorithms())
    Py_RETURN_NOTIMPLEMENTED;
  // params: the weights (slots the op needs) and biases (None or a tensor)
  std::array<std::optional<at::Tensor>, 6> p;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(params_obj); ++i) {
    PyObject* t = PyTuple_GET_ITEM(params_obj, i);
    if (t == Py_None) continue;
    if (!plain_tensor(t)) Py_RETURN_NOTIMPLEMENTED;
    p[i] = THPVariable_Unpack(t);
  }
  at::Tensor x = THPVariable_Unpack(args[1]);
  if (!x.is_cuda() || x.dim() < 2 || x.numel() == 0 || !x.is_contiguous()) Py_RETURN_NOTIMPLEMENTED;
  const int64_t k = x.size(-1), m = x.numel() / k;
  // (weight slot, rows, cols) and (bias slot, size) the op needs; weights are required
  const auto weight_ok = [&](int i, int64_t rows, int64_t cols) {
    return p[i] && p[i]->dim() == 2 && p[i]->size(0) == rows && p[i]->size(1) == cols;
  };
  const auto bias_ok = [&](int i, int64_t n) { return !p[i] || (p[i]->dim() == 1 && p[i]->size(0) == n); };
  int64_t n = 0, bucket_n = 0;  // output features; N of the bucket's M*N*K
  bool shapes_ok = false;
  if (op_id == 0) {
    n = p[0] ? p[0]->size(0) : 0;
    shapes_ok = weight_ok(0, n, k) && bias_ok(1, n);
    bucket_n = n;
  } else if (op_id == 1) {
    const int64_t h = p[0] ? p[0]->size(0) : 0;
    n = p[2] ? p[2]->size(0) : 0;
    shapes_ok = weight_ok(0, h, k) && bias_ok(1, h) && weight_ok(2, n, h) && bias_ok(3, n);
    bucket_n = h;
  } else {
    const int64_t h = p[0] ? p[0]->size(0) : 0;
    shapes_ok = weight_ok(0, h, k) && weight_ok(1, h, k) && bias_ok(2, h) && bias_ok(3, h);
    if (op_id == 3) {
      n = p[4] ? p[4]->size(0) : 0;
      shapes_ok = shapes_ok && weight_ok(4, n, h) && bias_ok(5, n);
    }
    bucket_n = 2 * h;
  }
  if (!shapes_ok) Py_RETURN_NOTIMPLEMENTED;
  // dtypes: F.linear's autocast rule (ops/shared.py autocast_dtypes)
  at::ScalarType dt = x.scalar_type();
  const bool autocast = at::autocast::is_autocast_enabled(at::kCUDA);
  if (autocast) dt = at::autocast::get_autocast_dtype(at::kCUDA);
  if (dt != at::kHalf && dt != at::kBFloat16) Py_RETURN_NOTIMPLEMENTED;
  if (autocast && x.scalar_type() != at::kFloat && x.scalar_type() != at::kHalf && x.scalar_type() != at::kBFloat16)
    Py_RETURN_NOTIMPLEMENTED;
  std::optional<at::ScalarType> cast_to;
  bool grad = at::GradMode::is_enabled() && x.requires_grad();
  for (const auto& t : p) {
    if (!t) continue;
    const at::ScalarType pt = t->scalar_type();
    if (!t->is_cuda() || t->device() != x.device() || !t->is_contiguous()) Py_RETURN_NOTIMPLEMENTED;
    if (pt != dt) {
      if (!autocast || (pt != at::kFloat && pt != at::kHalf && pt != at::kBFloat16)) Py_RETURN_NOTIMPLEMENTED;
      cast_to = dt;
    }
    grad = grad || (at::GradMode::is_enabled() && t->requires_grad());
  }
  bool run_torch = false;
  if (backend == 1) {  // "auto": the op's table, as ops/shared.py gemm_entry_key encodes it
    const double work = double(m) * double(bucket_n) * double(k);
    int bucket = 0;  // the number of bounds at or below the call's work
    for (; bucket < kBuckets - 1; ++bucket) {
      const long long below = PyLong_AsLongLong(PyTuple_GET_ITEM(args[6], bucket));
      if (below == -1 && PyErr_Occurred()) return nullptr;
      if (work < double(below)) break;
    }
    const int cc = at::cuda::getDeviceProperties(x.get_device())->major;
    const long long key = (((act * 32LL + cc) * 2 + (dt == at::kBFloat16)) * kBuckets + bucket) * 2 + grad;
    PyObject* key_obj = PyLong_FromLongLong(key);
    if (key_obj == nullptr) return nullptr;
    PyObject* torch_first = PyDict_GetItemWithError(args[5], key_obj);  // borrowed
    Py_DECREF(key_obj);
    if (torch_first == nullptr && PyErr_Occurred()) return nullptr;
    if (torch_first != nullptr) {
      if (op_id != 0 || torch_first != Py_True) Py_RETURN_NOTIMPLEMENTED;
      run_torch = true;
    }
  }
  at::Tensor out;
  {
    GilReleased released;
    if (x.scalar_type() != dt) x = x.to(dt);
    if (run_torch) {  // autocast casts the parameters in at::linear, as in F.linear
      out = torch_activation(at::linear(x, *p[0], p[1]), Activation(act));
    } else if (op_id == 0) {
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("ampkernels::linear_act", "")
                                 .typed<GemmLinearFn>();
      out = op.call(x, *p[0], p[1], act, cast_to, false, "cuda");
    } else if (op_id == 1) {
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("ampkernels::fused_mlp", "")
                                 .typed<GemmMLPFn>();
      out = op.call(x, *p[0], p[1], *p[2], p[3], act, cast_to, "cuda");
    } else if (op_id == 2) {
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("ampkernels::gated_linear_act", "")
                                 .typed<GemmGatedFn>();
      out = op.call(x, *p[0], *p[1], p[2], p[3], act, cast_to, false, "cuda");
    } else {
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("ampkernels::gated_mlp", "")
                                 .typed<GemmGatedMLPFn>();
      out = op.call(x, *p[0], *p[1], p[2], p[3], *p[4], p[5], act, cast_to, "cuda");
    }
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"gemm_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&gemm_entry)), METH_FASTCALL,
     "The GEMM ops' eager entry (ampkernels/ops/shared.py): the output, or NotImplemented"},
    {"norm_module", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&norm_module)), METH_FASTCALL,
     "The norm modules' eager entry (ampkernels/nn/modules.py): the output, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace ampk

// `import ampkernels._C` loads this library, which registers the ops above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "ampkernels compiled ops", -1, ampk::methods};
  return PyModule_Create(&module_def);
}
