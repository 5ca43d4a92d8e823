// gated_linear_act's CUDA backend: h = act(x Wg^T + bg) * (x Wu^T + bu), x (M, K), Wg and Wu (H, K).
//
// Forward: cuBLAS (at::mm_out) writes g and u side by side into one row-major (M, 2H) buffer
// gu -- ONE GEMM with N = 2H when Wu's memory begins where Wg's ends (two halves of one packed
// parameter, or the Python side's packed autocast cast), else two GEMMs into the two halves
// (ldc = 2H, no copy). Then gated_epilogue_kernel: the biases added in fp32, g and u rounded to
// the compute dtype (written back into gu when it is kept for backward), h = act(g) * u.
// Backward pass (gated_backward_kernel): from dh (M, H) and gu, dg = dh * u * act'(g) and
// du = dh * act(g) into dgu (M, 2H), which may be gu itself, plus per-row-chunk fp32 column
// sums of both (the bias gradients), added in a fixed order by reduce_partials (bias_act.cu):
// bitwise repeatable. The backward's GEMMs run in Python (torch.mm, cuBLAS).
//
// Unlike the other .cu files this one holds its torch binding too: its schemas go into the
// ampkernels namespace with their own TORCH_LIBRARY_FRAGMENT, so ops.cpp is not involved.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "activations.cuh"

namespace ampk {
namespace {

constexpr int kThreads = 256;

// One thread owns kVec consecutive columns of one row a step (16-byte accesses when H is a
// multiple of kVec and every pointer is 16-byte aligned; else one element).
template <typename T, Activation A, int kVec, bool kStore>
__global__ void gated_epilogue_kernel(T* gu, const T* __restrict__ bg, const T* __restrict__ bu, T* __restrict__ h,
                                      int64_t rows, int64_t hidden) {
  const int64_t vecs_per_row = hidden / kVec;
  const int64_t total = rows * vecs_per_row;
  for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < total; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = v / vecs_per_row, col = (v - row * vecs_per_row) * kVec;
    T* g_ptr = gu + row * 2 * hidden + col;
    T* u_ptr = g_ptr + hidden;
    T g[kVec], u[kVec], out[kVec];
    copy_vec<kVec>(g, g_ptr);
    copy_vec<kVec>(u, u_ptr);
    if (bg != nullptr) {
      T b[kVec];
      copy_vec<kVec>(b, bg + col);
#pragma unroll
      for (int k = 0; k < kVec; ++k) g[k] = from_f32<T>(to_f32(g[k]) + to_f32(b[k]));
    }
    if (bu != nullptr) {
      T b[kVec];
      copy_vec<kVec>(b, bu + col);
#pragma unroll
      for (int k = 0; k < kVec; ++k) u[k] = from_f32<T>(to_f32(u[k]) + to_f32(b[k]));
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = from_f32<T>(act_fwd<A>(to_f32(g[k])) * to_f32(u[k]));
    copy_vec<kVec>(h + row * hidden + col, out);
    if (kStore && bg != nullptr) copy_vec<kVec>(g_ptr, g);  // the biased values backward reads
    if (kStore && bu != nullptr) copy_vec<kVec>(u_ptr, u);
  }
}

// Block (32, kRowsPerStep): threadIdx.x picks a column vector, threadIdx.y a row; blockIdx.y is a
// chunk of rows, whose fp32 column sums the block writes to partial[chunk][0, 2H) (dg, then du).
// gu and dgu may be one tensor: a thread loads its g and u before it stores dg and du there.
constexpr int kColThreads = 32, kRowsPerStep = 8;

template <typename T, Activation A, int kVec, bool kWantDb>
__global__ void gated_backward_kernel(const T* __restrict__ dh, const T* gu, T* dgu, float* __restrict__ partial,
                                      int64_t rows, int64_t hidden, int64_t rows_per_chunk) {
  const int64_t col = (int64_t(blockIdx.x) * kColThreads + threadIdx.x) * kVec;
  const bool active = col < hidden;
  const int64_t row_begin = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = std::min(rows, row_begin + rows_per_chunk);
  float sum_g[kVec] = {}, sum_u[kVec] = {};
  if (active) {
    for (int64_t row = row_begin + threadIdx.y; row < row_end; row += kRowsPerStep) {
      T d[kVec], g[kVec], u[kVec];
      copy_vec<kVec>(d, dh + row * hidden + col);
      copy_vec<kVec>(g, gu + row * 2 * hidden + col);
      copy_vec<kVec>(u, gu + row * 2 * hidden + hidden + col);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float dk = to_f32(d[k]), gk = to_f32(g[k]), uk = to_f32(u[k]);
        const T dg = from_f32<T>(dk * uk * act_grad<A>(gk));
        const T du = from_f32<T>(dk * act_fwd<A>(gk));
        if (kWantDb) {  // the sums of dg and du as stored
          sum_g[k] += to_f32(dg);
          sum_u[k] += to_f32(du);
        }
        g[k] = dg;
        u[k] = du;
      }
      copy_vec<kVec>(dgu + row * 2 * hidden + col, g);
      copy_vec<kVec>(dgu + row * 2 * hidden + hidden + col, u);
    }
  }
  if constexpr (kWantDb) {
    __shared__ float smem[2][kRowsPerStep][kColThreads * kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      smem[0][threadIdx.y][threadIdx.x * kVec + k] = sum_g[k];
      smem[1][threadIdx.y][threadIdx.x * kVec + k] = sum_u[k];
    }
    __syncthreads();
    if (threadIdx.y == 0 && active) {
      float* out = partial + int64_t(blockIdx.y) * 2 * hidden;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (col + k >= hidden) break;
        float tg = 0.f, tu = 0.f;
        for (int r = 0; r < kRowsPerStep; ++r) {  // fixed order
          tg += smem[0][r][threadIdx.x * kVec + k];
          tu += smem[1][r][threadIdx.x * kVec + k];
        }
        out[col + k] = tg;
        out[hidden + col + k] = tu;
      }
    }
  }
}

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

void check_status(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, "ampkernels.", op, ": CUDA error: ", cudaGetErrorString(status));
}

DType compute_dtype(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, ": ", arg,
              " must be float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? DType::kFloat16 : DType::kBFloat16;
}

void check_operand(const at::Tensor& t, const at::Tensor& x, const char* op, const char* arg) {
  TORCH_CHECK(t.is_cuda(), op, ": ", arg, " must be a CUDA tensor, got a tensor on ", t.device());
  TORCH_CHECK(t.device() == x.device(), op, ": ", arg, " is on ", t.device(), " but x is on ", x.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous, got strides ", t.strides());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", arg, " dtype ", t.scalar_type(), " differs from x dtype ",
              x.scalar_type());
}

Activation to_activation(int64_t act, const char* op) {
  TORCH_CHECK(act >= 0 && act <= int64_t(Activation::kSquaredReLU), op, ": unknown activation id ", act);
  return Activation(act);
}

// (h, gu): gu = [x Wg^T + bg | x Wu^T + bu] (M, 2H) when store, else an empty (0, 0) tensor.
std::tuple<at::Tensor, at::Tensor> gated_linear_act_fwd(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu,
                                                        const std::optional<at::Tensor>& bg,
                                                        const std::optional<at::Tensor>& bu, int64_t activation,
                                                        bool store) {
  constexpr const char* op = "gated_linear_act_fwd_cuda";
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got a tensor on ", x.device());
  const DType dtype = compute_dtype(x, op, "x");
  check_operand(x, x, op, "x");
  check_operand(wg, x, op, "gate_weight");
  check_operand(wu, x, op, "up_weight");
  TORCH_CHECK(x.dim() == 2 && wg.dim() == 2 && wg.size(1) == x.size(1) && wu.sizes() == wg.sizes(), op,
              ": x must be (M, K) and both weights (H, K), got ", x.sizes(), ", ", wg.sizes(), " and ", wu.sizes());
  const int64_t M = x.size(0), H = wg.size(0);
  for (const auto& [b, name] : {std::pair{&bg, "gate_bias"}, std::pair{&bu, "up_bias"}}) {
    if (!*b) continue;
    check_operand(**b, x, op, name);
    TORCH_CHECK((*b)->dim() == 1 && (*b)->size(0) == H, op, ": ", name, " must have shape (", H, ",), got ",
                (*b)->sizes());
  }
  const Activation act = to_activation(activation, op);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor h = at::empty({M, H}, x.options());
  at::Tensor gu = at::empty({M, 2 * H}, x.options());
  const auto empty_gu = [&] { return store ? gu : at::empty({0, 0}, x.options()); };
  if (M == 0 || H == 0) return {h, empty_gu()};
  const bool packed =
      wu.storage().is_alias_of(wg.storage()) && wu.storage_offset() == wg.storage_offset() + wg.numel();
  if (packed) {
    at::mm_out(gu, x, wg.as_strided({2 * H, wg.size(1)}, {wg.size(1), 1}).t());
  } else {  // each GEMM writes its half in place (row stride 2H)
    at::Tensor g = gu.narrow(1, 0, H), u = gu.narrow(1, H, H);
    at::mm_out(g, x, wg.t());
    at::mm_out(u, x, wu.t());
  }
  const void* bg_ptr = bg ? bg->data_ptr() : nullptr;
  const void* bu_ptr = bu ? bu->data_ptr() : nullptr;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t status = dispatch_dtype(dtype, [&]<typename T>() {
    return dispatch_activation(act, [&]<Activation A>() {
      constexpr int kWide = 16 / sizeof(T);
      const bool vec = H % kWide == 0 && aligned16(gu.data_ptr()) && aligned16(h.data_ptr()) && aligned16(bg_ptr) &&
                       aligned16(bu_ptr);
      const int64_t items = M * H / (vec ? kWide : 1);
      const unsigned blocks =
          unsigned(std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t(num_sms()) * 16));
      auto* gu_t = static_cast<T*>(gu.data_ptr());
      auto* bg_t = static_cast<const T*>(bg_ptr);
      auto* bu_t = static_cast<const T*>(bu_ptr);
      auto* h_t = static_cast<T*>(h.data_ptr());
      const auto run = [&]<int kV, bool kS>() {
        gated_epilogue_kernel<T, A, kV, kS><<<blocks, kThreads, 0, stream>>>(gu_t, bg_t, bu_t, h_t, M, H);
      };
      if (vec && store) run.template operator()<kWide, true>();
      if (vec && !store) run.template operator()<kWide, false>();
      if (!vec && store) run.template operator()<1, true>();
      if (!vec && !store) run.template operator()<1, false>();
      return cudaGetLastError();
    });
  });
  check_status(status, op);
  return {h, empty_gu()};
}

// dgu = [dh * u * act'(g) | dh * act(g)] (dgu may be gu: in place). Returns the fp32 column sums
// of dgu (2H,) when need_db, else an empty tensor.
at::Tensor gated_act_bwd(const at::Tensor& dh, const at::Tensor& gu, const at::Tensor& dgu, int64_t activation,
                         bool need_db) {
  constexpr const char* op = "gated_act_bwd_cuda";
  TORCH_CHECK(dh.is_cuda(), op, ": dh must be a CUDA tensor, got a tensor on ", dh.device());
  const DType dtype = compute_dtype(dh, op, "dh");
  check_operand(dh, dh, op, "dh");
  check_operand(gu, dh, op, "gu");
  check_operand(dgu, dh, op, "dgu");
  TORCH_CHECK(dh.dim() == 2 && gu.dim() == 2 && gu.size(0) == dh.size(0) && gu.size(1) == 2 * dh.size(1) &&
                  dgu.sizes() == gu.sizes(),
              op, ": dh must be (M, H) and gu, dgu (M, 2H), got ", dh.sizes(), ", ", gu.sizes(), " and ", dgu.sizes());
  const Activation act = to_activation(activation, op);
  const c10::cuda::CUDAGuard guard(dh.device());
  const int64_t M = dh.size(0), H = dh.size(1);
  at::Tensor db = at::empty({need_db ? 2 * H : 0}, dh.options().dtype(at::kFloat));
  if (H == 0) return db;
  if (M == 0) return db.zero_();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = num_sms();
  at::Tensor partial;
  const cudaError_t status = dispatch_dtype(dtype, [&]<typename T>() {
    return dispatch_activation(act, [&]<Activation A>() {
      constexpr int kWide = 16 / sizeof(T);
      const bool vec = H % kWide == 0 && aligned16(dh.data_ptr()) && aligned16(gu.data_ptr()) &&
                       aligned16(dgu.data_ptr());
      const int kv = vec ? kWide : 1;
      const int64_t col_blocks = (H + int64_t(kColThreads) * kv - 1) / (int64_t(kColThreads) * kv);
      // enough blocks for a few waves; chunks of at least kRowsPerStep rows, at most 1024 of them
      const int64_t want = std::max<int64_t>(1, int64_t(sms) * 8 / col_blocks);
      const int64_t chunks = std::clamp<int64_t>(std::min(want, (M + kRowsPerStep - 1) / kRowsPerStep), 1, 1024);
      const int64_t rows_per_chunk = (M + chunks - 1) / chunks;
      const int64_t used_chunks = (M + rows_per_chunk - 1) / rows_per_chunk;
      const dim3 grid{unsigned(col_blocks), unsigned(used_chunks)};
      const dim3 block{unsigned(kColThreads), unsigned(kRowsPerStep)};
      const auto* dh_t = static_cast<const T*>(dh.data_ptr());
      const auto* gu_t = static_cast<const T*>(gu.data_ptr());
      auto* dgu_t = static_cast<T*>(dgu.data_ptr());
      float* part = nullptr;
      if (need_db) {
        partial = at::empty({used_chunks, 2 * H}, dh.options().dtype(at::kFloat));
        part = partial.data_ptr<float>();
      }
      const auto run = [&]<int kV, bool kDb>() {
        gated_backward_kernel<T, A, kV, kDb><<<grid, block, 0, stream>>>(dh_t, gu_t, dgu_t, part, M, H, rows_per_chunk);
      };
      if (vec && need_db) run.template operator()<kWide, true>();
      if (vec && !need_db) run.template operator()<kWide, false>();
      if (!vec && need_db) run.template operator()<1, true>();
      if (!vec && !need_db) run.template operator()<1, false>();
      cudaError_t err = cudaGetLastError();
      if (err == cudaSuccess && need_db)
        err = reduce_partials(part, db.data_ptr(), int(used_chunks), 2 * H, DType::kFloat32, stream);
      return err;
    });
  });
  check_status(status, op);
  return db;
}

// h = act(g) * u from gu = [g | u] (the forward's epilogue without biases: the forward's bits),
// for a backward that recomputes the down projection's input instead of keeping it.
at::Tensor gated_act_fwd(const at::Tensor& gu, int64_t activation) {
  constexpr const char* op = "gated_act_fwd_cuda";
  TORCH_CHECK(gu.is_cuda(), op, ": gu must be a CUDA tensor, got a tensor on ", gu.device());
  const DType dtype = compute_dtype(gu, op, "gu");
  check_operand(gu, gu, op, "gu");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, op, ": gu must be (M, 2H), got ", gu.sizes());
  const Activation act = to_activation(activation, op);
  const c10::cuda::CUDAGuard guard(gu.device());
  const int64_t M = gu.size(0), H = gu.size(1) / 2;
  at::Tensor h = at::empty({M, H}, gu.options());
  if (M == 0 || H == 0) return h;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const cudaError_t status = dispatch_dtype(dtype, [&]<typename T>() {
    return dispatch_activation(act, [&]<Activation A>() {
      constexpr int kWide = 16 / sizeof(T);
      const bool vec = H % kWide == 0 && aligned16(gu.data_ptr()) && aligned16(h.data_ptr());
      const int64_t items = M * H / (vec ? kWide : 1);
      const unsigned blocks =
          unsigned(std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t(num_sms()) * 16));
      // no biases and store=false: gu is only read
      auto* gu_t = static_cast<T*>(gu.data_ptr());
      auto* h_t = static_cast<T*>(h.data_ptr());
      if (vec)
        gated_epilogue_kernel<T, A, kWide, false><<<blocks, kThreads, 0, stream>>>(gu_t, nullptr, nullptr, h_t, M, H);
      else
        gated_epilogue_kernel<T, A, 1, false><<<blocks, kThreads, 0, stream>>>(gu_t, nullptr, nullptr, h_t, M, H);
      return cudaGetLastError();
    });
  });
  check_status(status, op);
  return h;
}

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("gated_linear_act_fwd_cuda(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor? gate_bias, "
        "Tensor? up_bias, int activation, bool store) -> (Tensor h, Tensor gu)");
  m.def("gated_act_fwd_cuda(Tensor gu, int activation) -> Tensor h");
  m.def("gated_act_bwd_cuda(Tensor dh, Tensor gu, Tensor(a!) dgu, int activation, bool need_db) -> Tensor dbias");
}
TORCH_LIBRARY_IMPL(ampkernels, CUDA, m) {
  m.impl("gated_linear_act_fwd_cuda", &gated_linear_act_fwd);
  m.impl("gated_act_fwd_cuda", &gated_act_fwd);
  m.impl("gated_act_bwd_cuda", &gated_act_bwd);
}

}  // namespace
}  // namespace ampk
