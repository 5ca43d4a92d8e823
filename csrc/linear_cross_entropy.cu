// The row pass of linear_cross_entropy (ampkernels/ops/linear_cross_entropy.py): over one chunk
// of 16-bit logits z (n, V), per row the fp32 log-sum-exp, the row's loss and, when asked, the
// gradient written over z in place. Rows may be padded (row stride ld >= V: the caller pads ld
// to a multiple of 64 so that cuBLAS takes its aligned sm90 kernels for the chunk's GEMMs, which
// fell back to sm75 CUTLASS kernels at 3x the time with V = 50257); only the V columns are read
// and written.
//
// A block owns one row. Pass 1: each thread walks the row in strides of kThreads vectors of kVec
// elements (16-byte loads when ld is a multiple of 8; a row's last vector, when it straddles V,
// element by element), keeping an online max m, a sum s of
// exp(z - m) (rescaled when m grows) and the sum of z (label smoothing); the (m, s) pairs are
// combined across the block by warp shuffles and one shared-memory step. loss = lse - (1-eps) z_t
// - eps/V sum(z); 0 for target == ignore_index; NaN for a target out of [0, V).
// Pass 2 (write_grad): z = scale * (exp(z - lse) - (1-eps) [col == t] - eps/V), 0 on ignored rows.
// scale: fp32, one value, or one per row (reduction "none"'s grad_output).
//
// The op registers itself (its own TORCH_LIBRARY_FRAGMENT and a CUDA implementation): ops.cpp
// needs no section for it.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "activations.cuh"

namespace ampk {
namespace {

constexpr float kNegInf = -INFINITY;

// (m, s) <- the pair for the union of two sets of values; -inf maxima contribute their s (0,
// or NaN if a NaN was seen), never 0 * inf
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == kNegInf) {
    s += s2;
  } else {
    s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  }
  m = mx;
}

__device__ __forceinline__ void online(float& m, float& s, float v) {
  if (v > m) {
    s = s * __expf(m - v) + 1.f;  // m = -inf: exp(-inf) = 0
    m = v;
  } else if (v != kNegInf) {  // NaN lands here and propagates through s
    s += __expf(v - m);
  }
}

// kVec elements of a row at i into v: one 16-byte load, or past V element by element (the
// padding is never read), filling with `fill`
template <typename T, int kVec>
__device__ __forceinline__ void load_row_vec(T* v, const T* zr, int64_t i, int64_t V, T fill) {
  if (i + kVec <= V) {
    copy_vec<kVec>(v, zr + i);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = i + k < V ? zr[i + k] : fill;
  }
}

template <typename T, int kVec>
__device__ __forceinline__ void store_row_vec(T* zr, const T* v, int64_t i, int64_t V) {
  if (i + kVec <= V) {
    copy_vec<kVec>(zr + i, v);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (i + k < V) zr[i + k] = v[k];
    }
  }
}

template <typename T, int kVec, int kThreads>
__global__ void __launch_bounds__(kThreads)
    lce_rows_kernel(T* __restrict__ z, int64_t ld, const int64_t* __restrict__ target, float* __restrict__ loss,
                    const float* __restrict__ scale, int64_t scale_stride, int64_t V, int64_t ignore_index,
                    float eps, bool write_grad) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float sh_m[kWarps], sh_s[kWarps], sh_z[kWarps];
  __shared__ float sh_lse;
  const int64_t row = blockIdx.x;
  T* zr = z + row * ld;
  const int64_t t = target[row];
  const int tid = threadIdx.x;
  const int64_t step = int64_t(kThreads) * kVec;

  if (t == ignore_index) {
    if (tid == 0) loss[row] = 0.f;
    if (write_grad) {
      T zero[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) zero[k] = from_f32<T>(0.f);
      for (int64_t i = int64_t(tid) * kVec; i < V; i += step) store_row_vec<T, kVec>(zr, zero, i, V);
    }
    return;
  }

  float m = kNegInf, s = 0.f, zs = 0.f;
  for (int64_t i = int64_t(tid) * kVec; i < V; i += step) {
    T v[kVec];
    load_row_vec<T, kVec>(v, zr, i, V, from_f32<T>(kNegInf));
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float f = to_f32(v[k]);
      online(m, s, f);
      zs += i + k < V ? f : 0.f;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    combine(m, s, m2, s2);
    zs += __shfl_xor_sync(0xffffffffu, zs, o);
  }
  const int warp = tid / 32, lane = tid % 32;
  if (lane == 0) {
    sh_m[warp] = m;
    sh_s[warp] = s;
    sh_z[warp] = zs;
  }
  __syncthreads();
  if (tid == 0) {
    float bm = sh_m[0], bs = sh_s[0], bz = sh_z[0];
    for (int w = 1; w < kWarps; ++w) {
      combine(bm, bs, sh_m[w], sh_s[w]);
      bz += sh_z[w];
    }
    const float lse = (bm == kNegInf ? 0.f : bm) + logf(bs);  // all -inf: log(0) = -inf, as torch
    const bool in_range = t >= 0 && t < V;
    const float zt = in_range ? to_f32(zr[t]) : NAN;
    float l = lse - (1.f - eps) * zt;
    if (eps != 0.f) l -= eps / float(V) * bz;
    loss[row] = l;
    sh_lse = lse;
  }
  if (!write_grad) return;
  __syncthreads();
  const float lse = sh_lse;
  const float sc = scale[row * scale_stride];
  const float smooth = eps / float(V), hit = 1.f - eps;
  for (int64_t i = int64_t(tid) * kVec; i < V; i += step) {
    T v[kVec];
    load_row_vec<T, kVec>(v, zr, i, V, from_f32<T>(0.f));
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float g = __expf(to_f32(v[k]) - lse) - smooth;
      if (i + k == t) g -= hit;
      v[k] = from_f32<T>(g * sc);
    }
    store_row_vec<T, kVec>(zr, v, i, V);
  }
}

template <typename T, int kVec>
void launch_rows(T* z, int64_t ld, const int64_t* target, float* loss, const float* scale, int64_t scale_stride, int64_t n,
                 int64_t V, int64_t ignore_index, float eps, bool write_grad, cudaStream_t stream) {
  // 512 threads for vocab-sized rows (~12 vectors a thread at V = 50257), 128 for short ones
  if (V >= 8192) {
    lce_rows_kernel<T, kVec, 512><<<n, 512, 0, stream>>>(z, ld, target, loss, scale, scale_stride, V, ignore_index, eps,
                                                         write_grad);
  } else {
    lce_rows_kernel<T, kVec, 128><<<n, 128, 0, stream>>>(z, ld, target, loss, scale, scale_stride, V, ignore_index, eps,
                                                         write_grad);
  }
}

template <typename T>
void dispatch_vec(at::Tensor& z, const at::Tensor& target, at::Tensor& loss, const at::Tensor& scale,
                  int64_t ignore_index, float eps, bool write_grad, cudaStream_t stream) {
  const int64_t n = z.size(0), V = z.size(1), ld = z.stride(0);
  T* zp = reinterpret_cast<T*>(z.data_ptr());
  const int64_t stride = scale.numel() > 1 ? 1 : 0;
  const bool vec = ld % 8 == 0 && reinterpret_cast<uintptr_t>(zp) % 16 == 0;
  if (vec) {
    launch_rows<T, 8>(zp, ld, target.data_ptr<int64_t>(), loss.data_ptr<float>(), scale.data_ptr<float>(), stride, n, V,
                      ignore_index, eps, write_grad, stream);
  } else {
    launch_rows<T, 1>(zp, ld, target.data_ptr<int64_t>(), loss.data_ptr<float>(), scale.data_ptr<float>(), stride, n, V,
                      ignore_index, eps, write_grad, stream);
  }
}

void lce_rows(at::Tensor z, const at::Tensor& target, at::Tensor loss, const at::Tensor& scale, int64_t ignore_index,
              double label_smoothing, bool write_grad) {
  constexpr const char* op = "linear_cross_entropy_rows_cuda_";
  TORCH_CHECK(z.is_cuda(), op, ": z must be a CUDA tensor, got a tensor on ", z.device());
  TORCH_CHECK(z.dim() == 2 && (z.stride(1) == 1 || z.size(1) <= 1) && z.stride(0) >= z.size(1), op,
              ": z must be a 2-D tensor with contiguous rows (row stride >= its width), got shape ", z.sizes(),
              " strides ", z.strides());
  TORCH_CHECK(z.scalar_type() == at::kHalf || z.scalar_type() == at::kBFloat16, op,
              ": z must be float16 or bfloat16, got ", z.scalar_type());
  const int64_t n = z.size(0);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == n && target.is_contiguous(),
              op, ": target must be a contiguous int64 tensor of shape (", n, "), got ", target.scalar_type(), " ",
              target.sizes());
  TORCH_CHECK(loss.scalar_type() == at::kFloat && loss.dim() == 1 && loss.size(0) == n && loss.is_contiguous(), op,
              ": loss must be a contiguous float32 tensor of shape (", n, "), got ", loss.scalar_type(), " ",
              loss.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && (scale.numel() == 1 || scale.numel() == n),
              op, ": scale must be a contiguous float32 tensor of 1 or ", n, " elements, got ", scale.scalar_type(),
              " ", scale.sizes());
  const at::Tensor* others[] = {&target, &loss, &scale};
  for (const at::Tensor* t : others) {
    TORCH_CHECK(t->device() == z.device(), op, ": all tensors must be on z's device ", z.device(), ", got ",
                t->device());
  }
  TORCH_CHECK(n <= int64_t(INT32_MAX), op, ": at most 2^31 - 1 rows a call, got ", n);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float eps = static_cast<float>(label_smoothing);
  if (z.scalar_type() == at::kHalf) {
    dispatch_vec<__half>(z, target, loss, scale, ignore_index, eps, write_grad, stream);
  } else {
    dispatch_vec<__nv_bfloat16>(z, target, loss, scale, ignore_index, eps, write_grad, stream);
  }
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace ampk

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("linear_cross_entropy_rows_cuda_(Tensor(a!) z, Tensor target, Tensor(b!) loss, Tensor scale, "
        "int ignore_index, float label_smoothing, bool write_grad) -> ()");
}

TORCH_LIBRARY_IMPL(ampkernels, CUDA, m) { m.impl("linear_cross_entropy_rows_cuda_", &ampk::lce_rows); }
