// Runs ampk::norm_backward (as emulated on the CPU) against a float64 reference.
#include "emu_layer_norm.cpp"
#include <random>
#include <string>

extern "C" {
cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int) {
  if (attr == cudaDevAttrMaxSharedMemoryPerBlockOptin) *v = emu_optin;
  else if (attr == cudaDevAttrMaxSharedMemoryPerMultiprocessor) *v = emu_optin + 1024;
  else std::abort();
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
}

using namespace ampk;
static std::mt19937_64 rng(1234);
static float rnd() { return std::normal_distribution<float>(0.f, 1.f)(rng); }

static size_t esz(DType t) { return t == DType::kFloat32 ? 4 : 2; }
static void put(void* p, DType t, size_t i, float v) {
  if (t == DType::kFloat32) static_cast<float*>(p)[i] = v;
  else if (t == DType::kFloat16) static_cast<__half*>(p)[i] = __float2half_rn(v);
  else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
}
static double get(const void* p, DType t, size_t i) {
  if (t == DType::kFloat32) return static_cast<const float*>(p)[i];
  if (t == DType::kFloat16) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
static const char* dn(DType t) { return t == DType::kFloat32 ? "f32" : t == DType::kFloat16 ? "f16" : "bf16"; }

struct Case {
  DType x; int pd;  // pd: 0 none, 1 fp32, 2 same as x
  bool rms, want_dw, want_db; int dres;  // dres: 0 none, 1 x dtype, 2 fp32
  int64_t rows, cols; int num_sms;
};

static double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) { num += (a[i] - b[i]) * (a[i] - b[i]); den += b[i] * b[i]; }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

static int failures = 0;
static bool g_misalign = false;  // x starts one element past an aligned address (a storage-offset view)
static std::string last_path;

static void run(const Case& c, bool verbose) {
  const int64_t M = c.rows, N = c.cols;
  NormBackwardArgs a{};
  a.x_dtype = c.x;
  a.param_dtype = c.pd == 1 ? DType::kFloat32 : c.x;
  std::vector<unsigned char> xbuf((M * N + 1) * esz(c.x)), dy(M * N * esz(c.x)), w(N * esz(a.param_dtype));
  unsigned char* const xp = xbuf.data() + (g_misalign ? esz(c.x) : 0);
  std::vector<float> mean(M), rstd(M);
  DType dres_t = c.dres == 2 ? DType::kFloat32 : c.x;
  std::vector<unsigned char> dres(c.dres ? M * N * esz(dres_t) : 0);
  const float off = 3.f;
  for (int64_t r = 0; r < M; ++r) {
    double s = 0, s2 = 0;
    for (int64_t j = 0; j < N; ++j) {
      put(xp, c.x, r * N + j, rnd() * 2 + off);
      put(dy.data(), c.x, r * N + j, rnd());
      if (c.dres) put(dres.data(), dres_t, r * N + j, rnd());
      s += get(xp, c.x, r * N + j);
    }
    const double m = c.rms ? 0 : s / N;
    for (int64_t j = 0; j < N; ++j) { const double d = get(xp, c.x, r * N + j) - m; s2 += d * d; }
    mean[r] = float(m);
    rstd[r] = float(1 / std::sqrt(s2 / N + 1e-5));
  }
  for (int64_t j = 0; j < N; ++j) put(w.data(), a.param_dtype, j, 1 + 0.5f * rnd());
  std::vector<unsigned char> dx(M * N * esz(c.x), 0xff);
  a.x = xp; a.dy = dy.data(); a.weight = c.pd ? w.data() : nullptr;
  a.mean = c.rms ? nullptr : mean.data(); a.rstd = rstd.data();
  a.dresidual_out = c.dres ? dres.data() : nullptr; a.dresidual_out_dtype = dres_t;
  a.dx = dx.data(); a.dx_dtype = c.x; a.dresidual = nullptr; a.dresidual_dtype = c.x;
  a.rows = M; a.cols = N; a.is_rms = c.rms;
  if (norm_backward_blocks(a, c.num_sms, &a.num_blocks) != cudaSuccess) std::abort();
  PipeConfig p;
  bwd_pipe_config(a, &p);
  const TileConfig tc = bwd_config(a);
  char path[128];
  if (p.iters) std::snprintf(path, sizeof path, "pipe(k=%d G=%d thr=%d smem=%zu)", p.iters, p.group, p.threads, p.smem);
  else std::snprintf(path, sizeof path, tc.iters ? "old-tile" : "old-looped");
  last_path = path;
  std::vector<float> dwp(c.want_dw ? a.num_blocks * N : 0, NAN), dbp(c.want_db ? a.num_blocks * N : 0, NAN);
  a.dweight_partial = c.want_dw ? dwp.data() : nullptr;
  a.dbias_partial = c.want_db ? dbp.data() : nullptr;
  if (norm_backward(a, nullptr) != cudaSuccess) { std::printf("launch error\n"); ++failures; return; }
  // reference
  std::vector<double> rdx(M * N), kdx(M * N), rdw(N, 0), rdb(N, 0), kdw(N, 0), kdb(N, 0);
  double g_scale2 = 0;  // sum of (rstd * dy * w)^2: dx's scale where dx itself cancels to ~0
  for (int64_t r = 0; r < M; ++r) {
    double c1 = 0, c2 = 0;
    std::vector<double> xh(N), g(N);
    for (int64_t j = 0; j < N; ++j) {
      xh[j] = (get(xp, c.x, r * N + j) - (c.rms ? 0 : mean[r])) * rstd[r];
      const double d = get(dy.data(), c.x, r * N + j);
      g[j] = d * (c.pd ? get(w.data(), a.param_dtype, j) : 1.0);
      g_scale2 += double(rstd[r]) * rstd[r] * g[j] * g[j];
      c1 += g[j] * xh[j]; c2 += g[j];
      rdw[j] += d * xh[j]; rdb[j] += d;
    }
    c1 /= N; c2 = c.rms ? 0 : c2 / N;
    for (int64_t j = 0; j < N; ++j) {
      rdx[r * N + j] = rstd[r] * (g[j] - xh[j] * c1 - c2) + (c.dres ? get(dres.data(), dres_t, r * N + j) : 0);
      kdx[r * N + j] = get(dx.data(), c.x, r * N + j);
    }
  }
  bool nan = false;
  for (double v : kdx) nan |= std::isnan(v);
  for (int b = 0; b < a.num_blocks; ++b)
    for (int64_t j = 0; j < N; ++j) {
      if (c.want_dw) { kdw[j] += dwp[b * N + j]; nan |= std::isnan(dwp[b * N + j]); }
      if (c.want_db) { kdb[j] += dbp[b * N + j]; nan |= std::isnan(dbp[b * N + j]); }
    }
  const double tol = c.x == DType::kFloat16 ? 2e-3 : c.x == DType::kBFloat16 ? 1.6e-2 : 1e-5;
  // relative to dx, or to 10% of its terms' scale where dx cancels (LayerNorm with N = 2: ~0)
  double e_num = 0, e_den = 0;
  for (size_t i = 0; i < kdx.size(); ++i) { e_num += (kdx[i] - rdx[i]) * (kdx[i] - rdx[i]); e_den += rdx[i] * rdx[i]; }
  const double e_dx = std::sqrt(e_num / std::max({e_den, 1e-2 * g_scale2, 1e-300})), e_dw = c.want_dw ? rel(kdw, rdw) : 0, e_db = c.want_db ? rel(kdb, rdb) : 0;
  const bool ok = !nan && e_dx < tol && e_dw < 1e-5 && e_db < 1e-5;
  // determinism: a second run gives the same bits
  std::vector<unsigned char> dx1 = dx; std::vector<float> dwp1 = dwp, dbp1 = dbp;
  std::fill(dx.begin(), dx.end(), 0xff);
  std::fill(dwp.begin(), dwp.end(), NAN); std::fill(dbp.begin(), dbp.end(), NAN);
  norm_backward(a, nullptr);
  const bool same = dx == dx1 && std::memcmp(dwp.data(), dwp1.data(), dwp.size() * 4) == 0 &&
                    std::memcmp(dbp.data(), dbp1.data(), dbp.size() * 4) == 0;
  if (!ok || !same || verbose)
    std::printf("%s %s x=%s p=%s rms=%d dw=%d db=%d dres=%d M=%ld N=%ld sms=%d blocks=%d %s: dx %.2e dw %.2e db %.2e nan=%d repeat=%d\n",
                ok && same ? "ok  " : "FAIL", path, dn(c.x), c.pd == 0 ? "none" : dn(a.param_dtype), c.rms, c.want_dw,
                c.want_db, c.dres, long(M), long(N), c.num_sms, a.num_blocks, emu::g_deferred ? "deferred" : "immediate",
                e_dx, e_dw, e_db, int(nan), int(same));
  if (!ok || !same) ++failures;
  std::fflush(stdout);
}

static double worst_rstd[2] = {0, 0};  // the forward's largest rstd error, rows around 0 and 1000

// The forward (norm_fwd_kernel, norm_fwd_looped_kernel) against float64: out, mean, rstd, on rows
// around `off` (1000: a large mean, where sums of squares about zero would lose the variance).
static void run_fwd(DType xt, int pd, bool rms, bool residual, int64_t M, int64_t N, float off, float scale = 1.f,
                    float eps = 1e-5f) {
  NormForwardArgs a{};
  a.x_dtype = a.out_dtype = a.residual_dtype = a.residual_out_dtype = xt;
  a.param_dtype = pd == 1 ? DType::kFloat32 : xt;
  std::vector<unsigned char> xbuf((M * N + 1) * esz(xt)), r(residual ? M * N * esz(xt) : 0), w(N * 4), b(N * 4);
  unsigned char* const xp = xbuf.data() + (g_misalign ? esz(xt) : 0);
  std::vector<unsigned char> out(M * N * esz(xt), 0xff), rout(residual ? M * N * esz(xt) : 0, 0xff);
  std::vector<float> mean(M, NAN), rstd(M, NAN);
  for (int64_t i = 0; i < M * N; ++i) {
    put(xp, xt, i, scale * rnd() + off);
    if (residual) put(r.data(), xt, i, rnd());
  }
  for (int64_t j = 0; j < N; ++j) { put(w.data(), a.param_dtype, j, 1 + 0.5f * rnd()); put(b.data(), a.param_dtype, j, rnd()); }
  a.x = xp; a.residual = residual ? r.data() : nullptr; a.weight = pd ? w.data() : nullptr;
  a.bias = pd && !rms ? b.data() : nullptr; a.out = out.data(); a.residual_out = residual ? rout.data() : nullptr;
  a.mean = rms ? nullptr : mean.data(); a.rstd = rstd.data(); a.rows = M; a.cols = N; a.eps = eps; a.is_rms = rms;
  if (norm_forward(a, nullptr) != cudaSuccess) { std::printf("launch error\n"); ++failures; return; }
  double e_out = 0, e_mean = 0, e_rstd = 0;
  std::vector<double> ko(M * N), ro(M * N);
  for (int64_t i = 0; i < M; ++i) {
    std::vector<double> v(N);
    double s = 0, q = 0;
    for (int64_t j = 0; j < N; ++j) { v[j] = get(xp, xt, i * N + j) + (residual ? get(r.data(), xt, i * N + j) : 0); s += v[j]; }
    const double m = rms ? 0 : s / N;
    for (int64_t j = 0; j < N; ++j) q += (v[j] - m) * (v[j] - m);
    const double rs = 1 / std::sqrt(q / N + eps);
    if (!rms) e_mean = std::max(e_mean, std::abs(mean[i] - m) / std::max(1.0, std::abs(m)));
    e_rstd = std::max(e_rstd, std::abs(rstd[i] - rs) / rs);
    for (int64_t j = 0; j < N; ++j) {
      ro[i * N + j] = (v[j] - m) * rs * (pd ? get(w.data(), a.param_dtype, j) : 1) + (pd && !rms ? get(b.data(), a.param_dtype, j) : 0);
      ko[i * N + j] = get(out.data(), xt, i * N + j);
    }
  }
  e_out = rel(ko, ro);
  const std::vector<unsigned char> out1 = out;
  const std::vector<float> rstd1 = rstd;
  norm_forward(a, nullptr);
  bool same = out == out1 && std::memcmp(rstd.data(), rstd1.data(), M * 4) == 0;
  // inference (no statistics written): the same output bits
  NormForwardArgs inference = a;
  inference.mean = nullptr;
  inference.rstd = nullptr;
  std::fill(out.begin(), out.end(), 0xff);
  norm_forward(inference, nullptr);
  same = same && out == out1;
  // fp32 x: the fp32 mean's rounding (half an ulp of the offset) enters every centred value
  const double tol = xt == DType::kFloat32 ? 1e-5 + 2e-7 * off : xt == DType::kFloat16 ? 2e-3 : 1.6e-2;
  // mean: to fp32 rounding of the row's size. rstd: the variance is about 1 around any mean; at
  // mean 1000 a mean rounded to fp32 (ulp 6e-5) enters the centred values: 1e-4
  worst_rstd[off != 0.f] = std::max(worst_rstd[off != 0.f], e_rstd);
  const bool ok = e_out < tol && e_mean < 1e-6 && e_rstd < (off != 0.f ? 1e-4 : 2e-5) && same;
  if (!ok) {
    std::printf("FAIL fwd x=%s p=%s rms=%d res=%d M=%ld N=%ld off=%g: out %.2e mean %.2e rstd %.2e repeat=%d\n", dn(xt),
                pd == 0 ? "none" : dn(a.param_dtype), int(rms), int(residual), long(M), long(N), off, e_out, e_mean,
                e_rstd, int(same));
    ++failures;
  }
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "quick";
  if (mode == "fuzz") {  // tests/test_fuzz.py's norm cases: N 1..300, rows 1..40, mean 0/100, scale 1/30; backward too
    std::uniform_int_distribution<int> pick(0, 1 << 20);
    const int cases = std::atoi(argc > 2 ? argv[2] : "200");
    for (int i = 0; i < cases; ++i) {
      const DType xt = DType(pick(rng) % 3 == 0 ? int(DType::kFloat32) : pick(rng) % 2 ? int(DType::kFloat16) : int(DType::kBFloat16));
      const int64_t n = 1 + pick(rng) % 300, rows = 1 + pick(rng) % 40;
      const float eps[3] = {1e-5f, 1e-6f, 1e-2f};
      g_misalign = pick(rng) % 3 == 0;  // test_fuzz's "offset" layout
      run_fwd(xt, pick(rng) % 3, pick(rng) % 2, false, rows, n, pick(rng) % 2 ? 100.f : 0.f, pick(rng) % 2 ? 30.f : 1.f,
              eps[pick(rng) % 3]);
    }
    for (int i = 0; i < cases / 4; ++i) {  // backward: any N, any dtype
      const DType xt = DType(pick(rng) % 3);
      Case c{xt, int(pick(rng) % 3), bool(pick(rng) % 2), bool(pick(rng) % 2), bool(pick(rng) % 2), 0,
             1 + pick(rng) % 40, 1 + pick(rng) % 300, 2 + int(pick(rng) % 2)};
      emu::g_deferred = pick(rng) % 2;
      g_misalign = pick(rng) % 3 == 0;
      run(c, false);
    }
    g_misalign = false;
    std::printf("fuzz: %d failures\n", failures);
    return failures != 0;
  }
  if (mode == "fwd") {
    for (int64_t n : {1L, 7L, 8L, 64L, 100L, 768L, 1000L, 1024L, 2048L, 4096L, 8192L, 12288L, 16384L, 20000L}) {
      for (int64_t rows : {1L, 5L}) {
        for (DType xt : {DType::kFloat16, DType::kBFloat16, DType::kFloat32})
          for (int v = 0; v < 4; ++v)
            for (float off : {0.f, 1000.f}) run_fwd(xt, v % 3, v == 3, v == 1, rows, n, off);
      }
      std::printf("fwd N=%ld done, failures so far %d\n", long(n), failures);
      std::fflush(stdout);
    }
    std::printf("largest rstd error: %.2e (mean 0), %.2e (mean 1000); failures: %d\n", worst_rstd[0], worst_rstd[1],
                failures);
    return failures != 0;
  }
  std::vector<int64_t> ns = {8, 12, 16, 24, 40, 64, 96, 256, 768, 1000, 1004, 1024, 1536, 2560, 4000, 4096, 8192, 12288, 16384, 20000};
  if (mode == "long") ns = {8, 24, 64, 256, 768, 1000, 1024, 1536, 2048};
  if (mode == "configs") {
    for (int64_t n : {8L, 64L, 256L, 768L, 1000L, 1024L, 1536L, 2048L, 2560L, 3072L, 4000L, 4096L, 5120L, 6144L, 8192L, 10240L, 12288L, 14336L, 16384L}) {
      for (int dres = 0; dres < 2; ++dres) {
        NormBackwardArgs a{};
        static unsigned char buf[64] __attribute__((aligned(256)));
        a.x_dtype = a.dx_dtype = a.dresidual_out_dtype = DType::kBFloat16; a.param_dtype = DType::kFloat32;
        a.x = a.dy = a.weight = buf; a.dx = buf; a.dresidual_out = dres ? buf : nullptr;
        a.rows = 1 << 20; a.cols = n;
        PipeConfig p; bwd_pipe_config(a, &p);
        int blocks = 0; norm_backward_blocks(a, 132, &blocks);
        const int per_sm_thr = p.iters ? blocks / 132 * p.threads : 0;
        std::printf("N=%5ld dres=%d: %s k=%d G=%d threads=%d rows/block=%d smem=%zuKB blocks=%d (%d threads/SM, %zu KB x/dy in flight per stage per SM)\n",
                    long(n), dres, p.iters ? "pipe" : "old ", p.iters, p.group, p.threads, p.iters ? p.threads / p.group : 0,
                    p.smem / 1024, blocks, per_sm_thr, p.iters ? size_t(per_sm_thr) * p.iters * 32 / 1024 : 0);
      }
    }
    return 0;
  }
  if (mode == "one") {  // one case from the command line: x pd rms dw db dres rows cols sms deferred
    Case c{DType(std::atoi(argv[2])), std::atoi(argv[3]), bool(std::atoi(argv[4])), bool(std::atoi(argv[5])),
           bool(std::atoi(argv[6])), std::atoi(argv[7]), std::atol(argv[8]), std::atol(argv[9]), std::atoi(argv[10])};
    emu::g_deferred = std::atoi(argv[11]);
    run(c, true);
    return failures != 0;
  }
  for (int64_t n : ns) {
    std::vector<int64_t> rows_list = {1, 7, 37};
    if (mode == "long") rows_list = {301, 1000};
    for (int64_t rows : rows_list) {
      if (n >= 8192 && rows == 37) continue;
      for (DType xt : {DType::kFloat16, DType::kBFloat16}) {
        // rotate through options to keep the count manageable
        for (int v = 0; v < 4; ++v) {
          Case c{xt, v % 3 == 0 ? 1 : v % 3 == 1 ? 2 : 0, v % 2 == 1, v != 2, v == 0 || v == 2, v == 3 ? 1 : (v == 1 && n == 1024 ? 2 : 0),
                 rows, n, mode == "long" ? 1 : 2 + int(rows % 2)};
          emu::g_deferred = (v + rows) % 2 == 0;
          run(c, mode == "verbose" || (mode == "long" && v == 0));
        }
      }
    }
    std::printf("N=%ld done (%s), failures so far %d\n", long(n), last_path.c_str(), failures);
    std::fflush(stdout);
  }
  std::printf("failures: %d\n", failures);
  return failures != 0;
}
