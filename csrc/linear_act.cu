// linear_act's GEMMs through cuBLASLt, with fused epilogues.
//
// Contract: one call = one column-major GEMM  D(m x n) = op(A)(m x k) * op(B)(k x n)  in
// fp16 or bf16 with fp32 accumulation (CUBLAS_COMPUTE_32F), plus an epilogue:
//   bias (length m, D's dtype), ReLU/GELU(tanh) on the fp32 result, GELU's pre-activation
//   written to `aux` (D's dtype, leading dim aux_ld), or BGRADB: the fp32-accumulated
//   column sums of op(B) over k written to `bias` (the bias gradient, D's dtype).
// Row-major torch tensors are read as their transposes (see ops.cpp for the mapping).
//
// The matmul descriptor, the three layouts and the algorithm are created once per (device, m,
// n, k, transposes, leading dims, dtype, epilogue, bias, aux_ld) and cached: a call costs the
// host a map lookup, not a heuristic query. The callers only take this path with 16-byte
// aligned pointers and leading dims that are multiples of 8, so alignment is part of the key
// by construction. The algorithm is the fastest of the heuristic's candidates, timed once (one
// host sync) for the first kTimedShapes shapes of a GEMM family: the key without m, n, k. The
// callers' operands are contiguous, so their leading dims are the layer's K or N, never its
// token count M: a family is one GEMM of a layer whatever M is. A later M, as a masked LM's
// labelled rows or variable-length batches bring every step, takes the algorithm timed for
// the nearest shape when cuBLASLt accepts it for the new one, else the heuristic's first pick:
// no timing and no host sync after those first calls. Pointers (bias, aux) are set on the
// cached descriptor under the cache's lock just before cublasLtMatmul, which reads them at
// call time (the launch itself is asynchronous and graph-capturable).
// Every cuBLASLt status is checked; the message names the call and the GEMM.
#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "activations.cuh"

namespace ampk {
namespace {

// dz = dy * act'(saved), elementwise over a flat array. One thread owns kUnroll vectors of kVec
// consecutive elements a step (16-byte loads and stores when every pointer is 16-byte aligned
// and numel is a multiple of the vector, which the fused path guarantees; else one element),
// loading all of them before it computes or stores any: more bytes in flight a thread (one
// vector a step ran well below torch's dy * saved). dz may be dy (in place,
// act_backward_cuda_): a thread loads its elements before it stores them, and dy/dz carry no
// __restrict__ so the compiler is not told otherwise.
template <typename T, Activation A, int kVec, int kUnroll>
__global__ void act_backward_kernel(const T* dy, const T* __restrict__ saved, T* dz, int64_t numel) {
  const int64_t step = int64_t(blockDim.x) * kVec;  // between a thread's vectors: each is coalesced
  const int64_t stride = int64_t(gridDim.x) * step * kUnroll;
  for (int64_t base = int64_t(blockIdx.x) * step * kUnroll + int64_t(threadIdx.x) * kVec; base < numel;
       base += stride) {
    T g[kUnroll][kVec], s[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i >= numel) break;
      copy_vec<kVec>(g[u], dy + i);
      copy_vec<kVec>(s[u], saved + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * step;
      if (i >= numel) break;
#pragma unroll
      for (int k = 0; k < kVec; ++k) g[u][k] = from_f32<T>(to_f32(g[u][k]) * act_grad<A>(to_f32(s[u][k])));
      copy_vec<kVec>(dz + i, g[u]);
    }
  }
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::string unsupported;  // non-empty: cuBLASLt has no algorithm for this key (cached too)
  bool timed = false;       // the algorithm was picked by timing the candidates
};

// (device, transposes, leading dims, dtype, epilogue, bias, aux_ld, workspace, deterministic):
// one GEMM of a layer, whatever its token count
using Family = std::tuple<int, bool, bool, int64_t, int64_t, int64_t, int, int, bool, int64_t, size_t, bool>;
using Key = std::tuple<Family, int64_t, int64_t, int64_t>;  // + m, n, k

constexpr size_t kTimedShapes = 2;  // shapes timed per family (e.g. a training and an eval batch)

std::mutex g_mutex;
// never freed: a plan per shape, alive for the process (a few hundred bytes each; variable-length
// training adds one per distinct token count). Ordered by family first: a family's plans are adjacent.
std::map<Key, Plan> g_plans;
using Timed = std::vector<std::pair<double, cublasLtMatmulAlgo_t>>;  // a family's timed plans: (m*n*k, algorithm)
thread_local std::string g_error;

cublasLtEpilogue_t to_lt(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::kDefault: return CUBLASLT_EPILOGUE_DEFAULT;
    case LtEpilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::kReLU: return CUBLASLT_EPILOGUE_RELU;
    case LtEpilogue::kReLUBias: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case LtEpilogue::kGELU: return CUBLASLT_EPILOGUE_GELU;
    case LtEpilogue::kGELUBias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case LtEpilogue::kGELUAux: return CUBLASLT_EPILOGUE_GELU_AUX;
    case LtEpilogue::kGELUAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case LtEpilogue::kBGradB: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

bool uses_aux(LtEpilogue e) { return e == LtEpilogue::kGELUAux || e == LtEpilogue::kGELUAuxBias; }
bool uses_bias(LtEpilogue e) {
  return e == LtEpilogue::kBias || e == LtEpilogue::kReLUBias || e == LtEpilogue::kGELUBias ||
         e == LtEpilogue::kGELUAuxBias || e == LtEpilogue::kBGradB;
}

const char* fail(const char* call, cublasStatus_t s, const LtGemm& g) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "cuBLASLt %s failed: %s (GEMM m=%lld n=%lld k=%lld trans_a=%d trans_b=%d lda=%lld ldb=%lld "
                "ldd=%lld dtype=%d epilogue=%d)",
                call, cublasLtGetStatusString(s), (long long)g.m, (long long)g.n, (long long)g.k, int(g.trans_a),
                int(g.trans_b), (long long)g.lda, (long long)g.ldb, (long long)g.ldd, int(g.dtype), int(g.epilogue));
  g_error = buf;
  return g_error.c_str();
}

#define AMPK_LT(call)                                     \
  do {                                                    \
    const cublasStatus_t s_ = (call);                     \
    if (s_ != CUBLAS_STATUS_SUCCESS) return fail(#call, s_, g); \
  } while (0)

constexpr int kCandidates = 8;  // algorithms the heuristic proposes; the fastest is kept
constexpr int kTimedRuns = 5;
constexpr int kRounds = 2;  // every candidate timed twice, in turn, keeping its best: the clock can
                            // still be rising when the first candidates run

// Index of the fastest of the heuristic's candidates, timed on the real operands (their
// outputs are overwritten by the caller's run right after). Once per plan: one host sync.
// -1 when no candidate launched: then the GEMM has no plan and the caller's unfused path runs.
int fastest_algo(const LtGemm& g, cublasLtHandle_t handle, const Plan& p,
                 const cublasLtMatmulHeuristicResult_t* results, int found, void* workspace, size_t workspace_size,
                 cudaStream_t stream) {
  const float alpha = 1.f, beta = 0.f;
  const auto run = [&](int i) {
    return cublasLtMatmul(handle, p.desc, &alpha, g.a, p.a, g.b, p.b, &beta, g.d, p.d, g.d, p.d, &results[i].algo,
                          workspace, workspace_size, stream) == CUBLAS_STATUS_SUCCESS;
  };
  bool launched[kCandidates] = {};
  int best = -1;
  for (int i = 0; i < found; ++i) {  // warm-up; a candidate that fails to launch is skipped
    launched[i] = results[i].state == CUBLAS_STATUS_SUCCESS && run(i);
    if (launched[i] && best < 0) best = i;  // usable even if timing fails below
  }
  if (best < 0) return -1;
  cudaEvent_t start[kCandidates] = {}, stop[kCandidates] = {};
  float best_ms[kCandidates];
  std::fill(best_ms, best_ms + kCandidates, 3.4e38f);
  bool ok = true;
  for (int i = 0; i < found && ok; ++i)
    if (launched[i]) ok = cudaEventCreate(&start[i]) == cudaSuccess && cudaEventCreate(&stop[i]) == cudaSuccess;
  for (int round = 0; round < kRounds && ok; ++round) {
    for (int i = 0; i < found && ok; ++i) {
      if (!launched[i]) continue;
      ok = cudaEventRecord(start[i], stream) == cudaSuccess;
      for (int r = 0; r < kTimedRuns && ok; ++r) ok = run(i);
      ok = ok && cudaEventRecord(stop[i], stream) == cudaSuccess;
    }
    ok = ok && cudaStreamSynchronize(stream) == cudaSuccess;
    for (int i = 0; i < found && ok; ++i) {
      float ms = 0.f;
      if (launched[i] && cudaEventElapsedTime(&ms, start[i], stop[i]) == cudaSuccess)
        best_ms[i] = std::min(best_ms[i], ms);
    }
  }
  for (int i = 0; i < found; ++i) {
    if (start[i]) cudaEventDestroy(start[i]);
    if (stop[i]) cudaEventDestroy(stop[i]);
  }
  if (!ok) return best;
  for (int i = 0; i < found; ++i)
    if (launched[i] && best_ms[i] < best_ms[best]) best = i;
  return best;
}

// The algorithm timed for the family's shape nearest to this one (the shapes of a family differ
// in M alone: by m*n*k), if cuBLASLt accepts it for this plan's shape with the workspace at hand.
bool nearest_timed_algo(const Timed& timed, double volume, cublasLtHandle_t handle, const Plan& p,
                        size_t workspace_size, cublasLtMatmulAlgo_t* algo) {
  const auto nearest = std::min_element(timed.begin(), timed.end(), [&](const auto& x, const auto& y) {
    return std::abs(x.first - volume) < std::abs(y.first - volume);
  });
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(handle, p.desc, p.a, p.b, p.d, p.d, &nearest->second, &check) != CUBLAS_STATUS_SUCCESS ||
      check.workspaceSize > workspace_size)
    return false;
  *algo = nearest->second;
  return true;
}

// timed: the family's plans whose algorithm was timed
const char* make_plan(const LtGemm& g, cublasLtHandle_t handle, void* workspace, size_t workspace_size,
                      cudaStream_t stream, const Timed& timed, Plan& p) {
  const cudaDataType_t t = g.dtype == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  AMPK_LT(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cublasLtEpilogue_t epi = to_lt(g.epilogue);
  AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (uses_bias(g.epilogue)) {
    const int32_t bt = t;  // bias (or its gradient) in D's dtype
    AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  }
  if (uses_aux(g.epilogue)) {
    AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &g.aux_ld, sizeof(g.aux_ld)));
    AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)));
  }
  // op(A) is m x k: stored k x m when transposed
  AMPK_LT(cublasLtMatrixLayoutCreate(&p.a, t, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda));
  AMPK_LT(cublasLtMatrixLayoutCreate(&p.b, t, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb));
  AMPK_LT(cublasLtMatrixLayoutCreate(&p.d, t, g.m, g.n, g.ldd));
  // The heuristic's first pick can be far from the best (H200, fp16 4096x768x3072 with the
  // GELU+bias epilogue: 0.093 ms with the first pick, 0.036 ms with the timed best): time the
  // candidates once, for the family's first shapes, unless the stream is being captured
  // into a CUDA graph (no host sync allowed) or deterministic algorithms are requested (the
  // pick must not depend on timing): then the first pick is kept.
  const double volume = double(g.m) * double(g.n) * double(g.k);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const bool can_time = !g.deterministic && cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
                        capture == cudaStreamCaptureStatusNone;
  if (can_time && timed.size() >= kTimedShapes && nearest_timed_algo(timed, volume, handle, p, workspace_size, &p.algo))
    return nullptr;

  cublasLtMatmulPreference_t pref = nullptr;
  AMPK_LT(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &workspace_size, sizeof(workspace_size));
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.d, p.d, pref, kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS) return fail("cublasLtMatmulAlgoGetHeuristic", s, g);
  if (found == 0) return fail("cublasLtMatmulAlgoGetHeuristic (no algorithm)", CUBLAS_STATUS_NOT_SUPPORTED, g);
  const bool time_it = found > 1 && can_time && timed.size() < kTimedShapes;
  const int best = time_it ? fastest_algo(g, handle, p, results, found, workspace, workspace_size, stream) : 0;
  if (best < 0) return fail("cublasLtMatmul (no candidate algorithm launched)", CUBLAS_STATUS_NOT_SUPPORTED, g);
  p.algo = results[best].algo;
  p.timed = time_it;
  return nullptr;
}

void destroy(Plan& p) {
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.d) cublasLtMatrixLayoutDestroy(p.d);
  if (p.desc) cublasLtMatmulDescDestroy(p.desc);
  p = Plan{};
}

}  // namespace

const char* lt_matmul(const LtGemm& g, void* handle_, void* workspace, size_t workspace_size, cudaStream_t stream,
                      bool* no_plan) {
  *no_plan = false;
  if (g.dtype == DType::kFloat32) {
    g_error = "lt_matmul: fp32 is not a linear_act compute dtype";
    return g_error.c_str();
  }
  auto handle = static_cast<cublasLtHandle_t>(handle_);
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    g_error = "lt_matmul: cudaGetDevice failed";
    return g_error.c_str();
  }
  const Key key{Family{device, g.trans_a, g.trans_b, g.lda, g.ldb, g.ldd, int(g.dtype), int(g.epilogue),
                       g.bias != nullptr, g.aux_ld, workspace_size, g.deterministic},
                g.m, g.n, g.k};
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    const Family& family = std::get<0>(key);
    Timed timed;
    for (auto f = g_plans.lower_bound(Key{family, 0, 0, 0}); f != g_plans.end() && std::get<0>(f->first) == family; ++f)
      if (f->second.timed)
        timed.emplace_back(double(std::get<1>(f->first)) * std::get<2>(f->first) * std::get<3>(f->first), f->second.algo);
    Plan p;
    if (const char* err = make_plan(g, handle, workspace, workspace_size, stream, timed, p)) {
      // no descriptor or no algorithm for this epilogue/shape: remembered, so the caller's
      // unfused path costs no heuristic query on later calls
      destroy(p);
      p.unsupported = err;
    }
    it = g_plans.emplace(key, p).first;
  }
  Plan& p = it->second;
  if (!p.unsupported.empty()) {
    *no_plan = true;
    g_error = p.unsupported;
    return g_error.c_str();
  }
  if (uses_bias(g.epilogue))
    AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  if (uses_aux(g.epilogue))
    AMPK_LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux)));
  const float alpha = 1.f, beta = 0.f;
  AMPK_LT(cublasLtMatmul(handle, p.desc, &alpha, g.a, p.a, g.b, p.b, &beta, g.d, p.d, g.d, p.d, &p.algo, workspace,
                         workspace_size, stream));
  return nullptr;
}

cudaError_t act_backward(const void* dy, const void* saved, void* dz, int64_t numel, DType dtype, Activation act,
                         int num_sms, cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&]<typename T>() {
    return dispatch_activation(act, [&]<Activation A>() {
      constexpr int kWide = 16 / sizeof(T);
      constexpr int kThreads = 256;
      const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
      const bool vec = numel % kWide == 0 && aligned(dy) && aligned(saved) && aligned(dz);
      const int64_t items = vec ? numel / kWide : numel;
      constexpr int kUnroll = 4;
      // a few waves of resident blocks; the grid-stride loop covers the rest
      const int64_t blocks = std::min<int64_t>((items + kThreads * kUnroll - 1) / (kThreads * kUnroll),
                                               int64_t(num_sms) * 8);
      if (vec) {
        act_backward_kernel<T, A, kWide, kUnroll><<<unsigned(blocks), kThreads, 0, stream>>>(
            static_cast<const T*>(dy), static_cast<const T*>(saved), static_cast<T*>(dz), numel);
      } else {
        act_backward_kernel<T, A, 1, kUnroll><<<unsigned(blocks), kThreads, 0, stream>>>(
            static_cast<const T*>(dy), static_cast<const T*>(saved), static_cast<T*>(dz), numel);
      }
      return cudaGetLastError();
    });
  });
}

std::pair<size_t, size_t> lt_cached_plans() {
  std::lock_guard<std::mutex> lock(g_mutex);
  size_t timed = 0;
  for (const auto& [key, plan] : g_plans) timed += plan.timed;
  return {g_plans.size(), timed};
}

}  // namespace ampk
