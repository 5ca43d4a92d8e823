// The row passes of linear_cross_entropy (ampkernels/ops/linear_cross_entropy.py), over one
// chunk of 16-bit logits z (n, width) with padded rows (row stride ld >= width: the caller pads
// ld to a multiple of 64 so that cuBLAS takes its aligned sm90 kernels for the chunk's GEMMs,
// which fell back to sm75 CUTLASS kernels at 3x the time with V = 50257); only the width
// columns are read and written.
//
// A block owns one row. The token pass (z holds whole rows, width = V): each thread walks the
// row in strides of kThreads vectors of kVec elements (16-byte loads when ld is a multiple of 8;
// a row's last vector, when it straddles the width, element by element), keeping an online max
// m, a sum s of exp(z - m) (rescaled when m grows) and the sum of z (label smoothing); the
// (m, s) pairs are combined across the block by warp shuffles and one shared-memory step.
// loss = lse - (1-eps) z_t - eps/V sum(z); 0 for target == ignore_index; NaN for a target out
// of [0, V); the row's lse is stored too when asked (the vocabulary pass reads it).
// Then (write_grad): z = scale * (exp(z - lse) - (1-eps) [col == t] - eps/V), 0 on ignored rows.
// The vocabulary pass (kGivenLse: z holds columns col0 .. col0 + width of every row, the lse
// comes from the token pass): the same gradient, nothing reduced.
// scale: fp32, one value, or one per row (reduction "none"'s grad_output).
//
// The ops register themselves (their own TORCH_LIBRARY_FRAGMENT and CUDA implementations):
// ops.cpp needs no section for them.
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

// The arguments of both passes; loss and lse may be null where not written (lse: given when
// kGivenLse, else stored if non-null).
struct RowArgs {
  int64_t ld;
  const int64_t* target;
  float* loss;
  float* lse;
  const float* scale;
  int64_t scale_stride;
  int64_t width, vocab, col0, ignore_index;
  float eps;
  bool write_grad;
};

template <typename T, int kVec, int kThreads, bool kGivenLse>
__global__ void __launch_bounds__(kThreads) lce_rows_kernel(T* __restrict__ z, const RowArgs a) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float sh_m[kWarps], sh_s[kWarps], sh_z[kWarps];
  __shared__ float sh_lse;
  const int64_t row = blockIdx.x;
  T* zr = z + row * a.ld;
  const int64_t t = a.target[row];
  const int64_t W = a.width;
  const int tid = threadIdx.x;
  const int64_t step = int64_t(kThreads) * kVec;

  if (t == a.ignore_index) {
    if (!kGivenLse && tid == 0) {
      a.loss[row] = 0.f;
      if (a.lse != nullptr) a.lse[row] = 0.f;
    }
    if (a.write_grad) {
      T zero[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) zero[k] = from_f32<T>(0.f);
      for (int64_t i = int64_t(tid) * kVec; i < W; i += step) store_row_vec<T, kVec>(zr, zero, i, W);
    }
    return;
  }

  float lse;
  if constexpr (kGivenLse) {
    lse = a.lse[row];
  } else {
    float m = kNegInf, s = 0.f, zs = 0.f;
    for (int64_t i = int64_t(tid) * kVec; i < W; i += step) {
      T v[kVec];
      load_row_vec<T, kVec>(v, zr, i, W, from_f32<T>(kNegInf));
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float f = to_f32(v[k]);
        online(m, s, f);
        zs += i + k < W ? f : 0.f;
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
      const float row_lse = (bm == kNegInf ? 0.f : bm) + logf(bs);  // all -inf: log(0) = -inf, as torch
      const bool in_range = t >= 0 && t < W;
      const float zt = in_range ? to_f32(zr[t]) : NAN;
      float l = row_lse - (1.f - a.eps) * zt;
      if (a.eps != 0.f) l -= a.eps / float(W) * bz;
      a.loss[row] = l;
      if (a.lse != nullptr) a.lse[row] = row_lse;
      sh_lse = row_lse;
    }
    if (!a.write_grad) return;
    __syncthreads();
    lse = sh_lse;
  }
  const float sc = a.scale[row * a.scale_stride];
  const float smooth = a.eps / float(a.vocab), hit = 1.f - a.eps;
  const int64_t tc = t - a.col0;  // the target's column in this chunk (outside [0, W): none)
  for (int64_t i = int64_t(tid) * kVec; i < W; i += step) {
    T v[kVec];
    load_row_vec<T, kVec>(v, zr, i, W, from_f32<T>(0.f));
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float g = __expf(to_f32(v[k]) - lse) - smooth;
      if (i + k == tc) g -= hit;
      v[k] = from_f32<T>(g * sc);
    }
    store_row_vec<T, kVec>(zr, v, i, W);
  }
}

template <typename T, int kVec, bool kGivenLse>
void launch_rows(T* z, int64_t n, const RowArgs& a, cudaStream_t stream) {
  // 512 threads for vocab-sized rows (~12 vectors a thread at V = 50257), 128 for short ones
  if (a.width >= 8192) {
    lce_rows_kernel<T, kVec, 512, kGivenLse><<<n, 512, 0, stream>>>(z, a);
  } else {
    lce_rows_kernel<T, kVec, 128, kGivenLse><<<n, 128, 0, stream>>>(z, a);
  }
}

template <typename T, bool kGivenLse>
void dispatch_vec(at::Tensor& z, const RowArgs& a, cudaStream_t stream) {
  T* zp = reinterpret_cast<T*>(z.data_ptr());
  if (a.ld % 8 == 0 && reinterpret_cast<uintptr_t>(zp) % 16 == 0) {
    launch_rows<T, 8, kGivenLse>(zp, z.size(0), a, stream);
  } else {
    launch_rows<T, 1, kGivenLse>(zp, z.size(0), a, stream);
  }
}

void check_vector(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t n,
                  const at::Tensor& z) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == n && t.is_contiguous(), op, ": ", name,
              " must be a contiguous ", dtype, " tensor of shape (", n, "), got ", t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.device() == z.device(), op, ": ", name, " must be on z's device ", z.device(), ", got ", t.device());
}

// The checks both ops share; returns the arguments with z's geometry and the scale filled in.
RowArgs common_args(const char* op, const at::Tensor& z, const at::Tensor& target, const at::Tensor& scale,
                    int64_t ignore_index, double label_smoothing, bool write_grad) {
  TORCH_CHECK(z.is_cuda(), op, ": z must be a CUDA tensor, got a tensor on ", z.device());
  TORCH_CHECK(z.dim() == 2 && (z.stride(1) == 1 || z.size(1) <= 1) && z.stride(0) >= z.size(1), op,
              ": z must be a 2-D tensor with contiguous rows (row stride >= its width), got shape ", z.sizes(),
              " strides ", z.strides());
  TORCH_CHECK(z.scalar_type() == at::kHalf || z.scalar_type() == at::kBFloat16, op,
              ": z must be float16 or bfloat16, got ", z.scalar_type());
  const int64_t n = z.size(0);
  TORCH_CHECK(n <= int64_t(INT32_MAX), op, ": at most 2^31 - 1 rows a call, got ", n);
  check_vector(op, "target", target, at::kLong, n, z);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && (scale.numel() == 1 || scale.numel() == n),
              op, ": scale must be a contiguous float32 tensor of 1 or ", n, " elements, got ", scale.scalar_type(),
              " ", scale.sizes());
  TORCH_CHECK(scale.device() == z.device(), op, ": scale must be on z's device ", z.device(), ", got ",
              scale.device());
  RowArgs a{};
  a.ld = z.stride(0);
  a.target = target.data_ptr<int64_t>();
  a.scale = scale.data_ptr<float>();
  a.scale_stride = scale.numel() > 1 ? 1 : 0;
  a.width = a.vocab = z.size(1);
  a.ignore_index = ignore_index;
  a.eps = static_cast<float>(label_smoothing);
  a.write_grad = write_grad;
  return a;
}

template <bool kGivenLse>
void run(const char* op, at::Tensor& z, const RowArgs& a) {
  if (z.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(z.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (z.scalar_type() == at::kHalf) {
    dispatch_vec<__half, kGivenLse>(z, a, stream);
  } else {
    dispatch_vec<__nv_bfloat16, kGivenLse>(z, a, stream);
  }
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

// The token pass: loss (and lse, when given a tensor) per row, the gradient in place if asked.
void lce_rows(at::Tensor z, const at::Tensor& target, at::Tensor loss, const at::Tensor& scale, int64_t ignore_index,
              double label_smoothing, bool write_grad, const c10::optional<at::Tensor>& lse) {
  constexpr const char* op = "linear_cross_entropy_rows_cuda_";
  RowArgs a = common_args(op, z, target, scale, ignore_index, label_smoothing, write_grad);
  check_vector(op, "loss", loss, at::kFloat, z.size(0), z);
  a.loss = loss.data_ptr<float>();
  if (lse.has_value()) {
    check_vector(op, "lse", *lse, at::kFloat, z.size(0), z);
    a.lse = lse->data_ptr<float>();
  }
  run<false>(op, z, a);
}

// The vocabulary pass: z holds the logits of columns [col0, col0 + width) of every row of a
// vocabulary of `vocab`; overwritten by their gradient, from the rows' lse.
void lce_grad(at::Tensor z, const at::Tensor& target, const at::Tensor& lse, const at::Tensor& scale, int64_t col0,
              int64_t vocab, int64_t ignore_index, double label_smoothing) {
  constexpr const char* op = "linear_cross_entropy_grad_cuda_";
  RowArgs a = common_args(op, z, target, scale, ignore_index, label_smoothing, true);
  check_vector(op, "lse", lse, at::kFloat, z.size(0), z);
  TORCH_CHECK(col0 >= 0 && col0 + z.size(1) <= vocab, op, ": columns [", col0, ", ", col0 + z.size(1),
              ") must lie in the vocabulary [0, ", vocab, ")");
  a.lse = const_cast<float*>(lse.data_ptr<float>());  // read only (kGivenLse)
  a.col0 = col0;
  a.vocab = vocab;
  run<true>(op, z, a);
}

}  // namespace
}  // namespace ampk

TORCH_LIBRARY_FRAGMENT(ampkernels, m) {
  m.def("linear_cross_entropy_rows_cuda_(Tensor(a!) z, Tensor target, Tensor(b!) loss, Tensor scale, "
        "int ignore_index, float label_smoothing, bool write_grad, Tensor(c!)? lse=None) -> ()");
  m.def("linear_cross_entropy_grad_cuda_(Tensor(a!) z, Tensor target, Tensor lse, Tensor scale, int col0, "
        "int vocab, int ignore_index, float label_smoothing) -> ()");
}

TORCH_LIBRARY_IMPL(ampkernels, CUDA, m) {
  m.impl("linear_cross_entropy_rows_cuda_", &ampk::lce_rows);
  m.impl("linear_cross_entropy_grad_cuda_", &ampk::lce_grad);
}
