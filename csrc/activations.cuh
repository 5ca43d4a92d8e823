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

// d act / dz at z.
template <Activation A>
__device__ __forceinline__ float act_grad(float z) {
  if constexpr (A == Activation::kIdentity) {
    return 1.f;
  } else if constexpr (A == Activation::kReLU) {
    return z > 0.f ? 1.f : 0.f;
  } else if constexpr (A == Activation::kGELU) {
    return 0.5f * (1.f + erff(z * kSqrt1_2)) + z * kInvSqrt2Pi * expf(-0.5f * z * z);
  } else if constexpr (A == Activation::kGELUTanh) {
    const float t = tanhf(kSqrt2OverPi * (z + kGeluTanhCoef * z * z * z));
    return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluTanhCoef * z * z);
  } else if constexpr (A == Activation::kSiLU) {
    const float s = 1.f / (1.f + expf(-z));
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
