// Activation functions and their derivatives, in fp32, matching torch's definitions
// (F.relu, F.gelu(approximate="none"|"tanh"), F.silu, relu(x)**2). NaN propagates as in torch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ampkernels.h"

namespace ampk {

constexpr float kSqrt1_2 = 0.70710678118654752f;   // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f; // 1/sqrt(2*pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluTanhCoef = 0.044715f;

template <Activation A>
__device__ __forceinline__ float act_fwd(float z) {
  if constexpr (A == Activation::kIdentity) {
    return z;
  } else if constexpr (A == Activation::kReLU) {
    return z > 0.f || z != z ? z : 0.f;
  } else if constexpr (A == Activation::kGELU) {
    return 0.5f * z * (1.f + erff(z * kSqrt1_2));
  } else if constexpr (A == Activation::kGELUTanh) {
    return 0.5f * z * (1.f + tanhf(kSqrt2OverPi * (z + kGeluTanhCoef * z * z * z)));
  } else if constexpr (A == Activation::kSiLU) {
    return z / (1.f + expf(-z));
  } else {  // kSquaredReLU
    const float r = z > 0.f || z != z ? z : 0.f;
    return r * r;
  }
}

// The SFU's approximate 2^x and 1/x (~2 ulp of fp32; denormal results flushed to 0).
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Q(a) = P(N(0,1) > a) for a >= 0: t 2^(p(t) - a^2 log2(e) / 2), t = 1 / (1 + 0.4 a), p the
// degree-8 fit of ampkernels/triton/epilogue.py _gaussian_tail (relative error < 2.5e-6 in
// fp32 for a < 6); no cancellation where 1 + erf(x) loses its digits.
__device__ __forceinline__ float gaussian_tail(float a) {
  const float t = rcp_approx(1.f + 0.4f * a);
  float p = 0.27394530177116394f;
  p = p * t - 1.4028655290603638f;
  p = p * t + 2.8012568950653076f;
  p = p * t - 2.5152602195739746f;
  p = p * t + 0.7742717862129211f;
  p = p * t - 0.2584783434867859f;
  p = p * t + 0.5360429883003235f;
  p = p * t + 1.4386100769042969f;
  p = p * t - 2.6475226879119873f;
  return t * ex2_approx(p - 0.7213475204444817f * a * a);
}

// d act / dz at z. The backward passes stream two tensors in and one out; with erff / tanhf /
// expf and a division the act' pass falls behind its loads (docs/performance.md). Same formulas as
// ampkernels/triton/epilogue.py _act_grad: within 2e-5 relative + 1e-6 absolute of float64;
// NaN for NaN and, as torch's formulas give, for +-inf (inf * 0).
template <Activation A>
__device__ __forceinline__ float act_grad(float z) {
  if constexpr (A == Activation::kIdentity) {
    return 1.f;
  } else if constexpr (A == Activation::kReLU) {
    return z > 0.f ? 1.f : 0.f;
  } else if constexpr (A == Activation::kGELU) {
    // Phi(z) + z phi(z): Phi = 1 - Q(z) for z >= 0, Q(-z) below; phi = 2^(-z^2 log2(e) / 2) / sqrt(2 pi)
    const float q = gaussian_tail(fabsf(z));
    return (z >= 0.f ? 1.f - q : q) + z * kInvSqrt2Pi * ex2_approx(-0.7213475204444817f * z * z);
  } else if constexpr (A == Activation::kGELUTanh) {
    // s = sigmoid(2u) = 0.5 (1 + tanh u), u = sqrt(2/pi) (z + 0.044715 z^3); 1 - tanh^2 u = 4 s (1 - s).
    // The exponent is -2 log2(e) u.
    const float s = rcp_approx(1.f + ex2_approx(z * (-2.302208198f - 0.1029432396f * z * z)));
    return s + 2.f * z * s * (1.f - s) * kSqrt2OverPi * (1.f + 3.f * kGeluTanhCoef * z * z);
  } else if constexpr (A == Activation::kSiLU) {
    const float s = rcp_approx(1.f + ex2_approx(-1.4426950408889634f * z));  // sigmoid(z)
    return s * (1.f + z * (1.f - s));
  } else {  // kSquaredReLU: 2 relu(z), NaN propagating
    return z > 0.f || z != z ? 2.f * z : 0.f;
  }
}

// fp32 <-> storage type conversions.
template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Copies kVec consecutive elements: one 16-byte access when kVec > 1 (both pointers 16-byte
// aligned, kVec * sizeof(T) == 16), else one element. The elementwise kernels' loads (into a
// register array) and stores (to global memory).
template <int kVec, typename T>
__device__ __forceinline__ void copy_vec(T* dst, const T* src) {
  if constexpr (kVec > 1) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    dst[0] = src[0];
  }
}

// Runs f.template operator()<A>() with the activation known at compile time.
template <typename F>
cudaError_t dispatch_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::kIdentity: return f.template operator()<Activation::kIdentity>();
    case Activation::kReLU: return f.template operator()<Activation::kReLU>();
    case Activation::kGELU: return f.template operator()<Activation::kGELU>();
    case Activation::kGELUTanh: return f.template operator()<Activation::kGELUTanh>();
    case Activation::kSiLU: return f.template operator()<Activation::kSiLU>();
    case Activation::kSquaredReLU: return f.template operator()<Activation::kSquaredReLU>();
  }
  return cudaErrorInvalidValue;
}

// Runs f.template operator()<T>() with the storage type of `dtype`.
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f.template operator()<float>();
    case DType::kFloat16: return f.template operator()<__half>();
    case DType::kBFloat16: return f.template operator()<__nv_bfloat16>();
  }
  return cudaErrorInvalidValue;
}

}  // namespace ampk
