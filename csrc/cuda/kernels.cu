// CUDA kernels of libkite_runtime_cuda.so: cosine k-means (assign + update), batched Jacobi
// eigendecomposition of small symmetric matrices in one launch, group quantization, and the split
// PCA load (dequantize coefficients; mean + sinks + RoPE into the cache layout). Device pointers;
// one stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdio.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "../kite_runtime.h"

#define CK(x)                                   \
  do {                                          \
    cudaError_t e_ = (x);                       \
    if (e_ != cudaSuccess) return -2;           \
  } while (0)

static __device__ __forceinline__ float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

static __device__ __forceinline__ uint32_t code_at(const uint8_t* p, int64_t bitoff, int bits) {
  const int64_t byte = bitoff >> 3;
  const int sh = (int)(bitoff & 7);
  uint32_t v = p[byte];
  if (sh + bits > 8) v |= (uint32_t)p[byte + 1] << 8;
  return (v >> sh) & ((1u << bits) - 1u);
}

extern "C" const char* kite_cuda_version(void) {
  static char buf[400];
  int rt = 0, drv = 0, dev = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  cudaDeviceProp prop;
  const bool ok = cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess;
  snprintf(buf, sizeof buf, "kite-runtime %d.0 (cuda runtime %d, driver %d, %s)", KITE_RUNTIME_ABI, rt,
           drv, ok ? prop.name : "no device");
  return buf;
}

// ---------------------------------------------------------------------------------------------
// k-means

__global__ void km_assign(const float* __restrict__ x, int64_t n, int64_t D, const float* __restrict__ C,
                          int64_t k, int64_t* __restrict__ nxt, float* __restrict__ own,
                          int* __restrict__ counts) {
  const int lane = threadIdx.x & 31;
  const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (i >= n) return;
  const float* xi = x + i * D;
  float bs = -INFINITY;
  int64_t best = 0;
  for (int64_t c = 0; c < k; ++c) {
    const float* cc = C + c * D;
    float s = 0.f;
    for (int64_t j = lane; j < D; j += 32) s += xi[j] * cc[j];
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (s > bs) { bs = s; best = c; }
  }
  if (lane == 0) {
    nxt[i] = best;
    own[i] = bs;
    atomicAdd(counts + best, 1);
  }
}

__global__ void km_sum(const float* __restrict__ x, int64_t n, int64_t D, const int64_t* __restrict__ a,
                       float* __restrict__ sums) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= n * D) return;
  const int64_t i = idx / D, j = idx % D;
  atomicAdd(sums + a[i] * D + j, x[idx]);
}

__global__ void km_normalise(const float* __restrict__ sums, int64_t D, float* __restrict__ C) {
  __shared__ float red[32];
  const float* s = sums + (int64_t)blockIdx.x * D;
  float acc = 0.f;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) acc += s[j] * s[j];
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = 1.f / fmaxf(sqrtf(red[0]), 1e-12f);
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) C[(int64_t)blockIdx.x * D + j] = s[j] * inv;
}

extern "C" int kite_cuda_kmeans_cosine(const float* x, int64_t n, int64_t D, float* C, int64_t k,
                                       int iters, int64_t* assign, void* stream_) {
  if (n < 1 || D < 1 || k < 1 || iters < 0) return -1;
  cudaStream_t st = (cudaStream_t)stream_;
  int64_t* nxt = nullptr;
  float *own = nullptr, *sums = nullptr;
  int* counts = nullptr;
  CK(cudaMallocAsync(&nxt, n * sizeof(int64_t), st));
  CK(cudaMallocAsync(&own, n * sizeof(float), st));
  CK(cudaMallocAsync(&sums, k * D * sizeof(float), st));
  CK(cudaMallocAsync(&counts, k * sizeof(int), st));
  CK(cudaMemsetAsync(assign, 0, n * sizeof(int64_t), st));
  std::vector<int> hc((size_t)k);
  std::vector<int64_t> hcur((size_t)n, 0), hnxt((size_t)n);
  std::vector<float> hown((size_t)n);
  int it = 0;
  for (; it < iters; ++it) {
    CK(cudaMemsetAsync(counts, 0, k * sizeof(int), st));
    km_assign<<<(unsigned)((n * 32 + 255) / 256), 256, 0, st>>>(x, n, D, C, k, nxt, own, counts);
    CK(cudaGetLastError());
    // the assignment is small (spans of one document): compare and fix empties on the host
    CK(cudaMemcpyAsync(hc.data(), counts, k * sizeof(int), cudaMemcpyDeviceToHost, st));
    CK(cudaMemcpyAsync(hnxt.data(), nxt, n * sizeof(int64_t), cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));
    std::vector<int64_t> empties;
    for (int64_t c = 0; c < k; ++c) if (hc[c] == 0) empties.push_back(c);
    if (!empties.empty()) {
      CK(cudaMemcpyAsync(hown.data(), own, n * sizeof(float), cudaMemcpyDeviceToHost, st));
      CK(cudaStreamSynchronize(st));
      std::vector<int64_t> order((size_t)n);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return hown[a] < hown[b]; });
      for (size_t e = 0; e < empties.size() && e < (size_t)n; ++e) hnxt[order[e]] = empties[e];
      CK(cudaMemcpyAsync(nxt, hnxt.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice, st));
    }
    CK(cudaMemsetAsync(sums, 0, k * D * sizeof(float), st));
    km_sum<<<(unsigned)((n * D + 255) / 256), 256, 0, st>>>(x, n, D, nxt, sums);
    km_normalise<<<(unsigned)k, 256, 0, st>>>(sums, D, C);
    CK(cudaGetLastError());
    const bool same = hcur == hnxt;
    CK(cudaMemcpyAsync(assign, nxt, n * sizeof(int64_t), cudaMemcpyDeviceToDevice, st));
    CK(cudaStreamSynchronize(st));  // hnxt must stay valid until its copy is done
    if (same) { ++it; break; }
    hcur.swap(hnxt);
  }
  cudaFreeAsync(nxt, st);
  cudaFreeAsync(own, st);
  cudaFreeAsync(sums, st);
  cudaFreeAsync(counts, st);
  CK(cudaGetLastError());
  return it;
}

// ---------------------------------------------------------------------------------------------
// batched Jacobi eigendecomposition: one block per matrix, A and V in shared memory (fp32),
// parallel cyclic Jacobi with round-robin pairs (d/2 disjoint rotations per step).

__global__ void __launch_bounds__(512) jacobi_eigh(const float* __restrict__ A, int d,
                                                   float* __restrict__ evals,
                                                   float* __restrict__ evecs, int max_sweeps) {
  extern __shared__ float sm[];
  const int ld = d + 1, m = d / 2, tid = threadIdx.x, nt = blockDim.x;
  float* a = sm;
  float* v = a + d * ld;
  float* cs = v + d * ld;
  float* sn = cs + m;
  int* P = (int*)(sn + m);
  int* Q = P + m;
  int* rank = Q + m;
  __shared__ float red[2][32];
  __shared__ int stop;
  const float* Ab = A + (size_t)blockIdx.x * d * d;
  for (int idx = tid; idx < d * d; idx += nt) {
    const int r = idx / d, c = idx % d;
    a[r * ld + c] = Ab[idx];
    v[r * ld + c] = r == c ? 1.f : 0.f;
  }
  __syncthreads();
  for (int sweep = 0; sweep < max_sweeps; ++sweep) {
    float off = 0.f, tot = 0.f;
    for (int idx = tid; idx < d * d; idx += nt) {
      const int r = idx / d, c = idx % d;
      const float x = a[r * ld + c];
      tot += x * x;
      if (r != c) off += x * x;
    }
    for (int o = 16; o; o >>= 1) {
      off += __shfl_xor_sync(0xffffffffu, off, o);
      tot += __shfl_xor_sync(0xffffffffu, tot, o);
    }
    if ((tid & 31) == 0) { red[0][tid >> 5] = off; red[1][tid >> 5] = tot; }
    __syncthreads();
    if (tid == 0) {
      float so = 0.f, sa = 0.f;
      for (int w = 0; w < (nt + 31) / 32; ++w) { so += red[0][w]; sa += red[1][w]; }
      stop = !(so > 1e-13f * sa);
    }
    __syncthreads();
    if (stop) break;
    for (int rnd = 0; rnd < d - 1; ++rnd) {
      if (tid < m) {
        int p, q;
        if (tid == 0) { p = d - 1; q = rnd; }
        else { p = (rnd + tid) % (d - 1); q = (rnd - tid + (d - 1)) % (d - 1); }
        if (p > q) { const int t = p; p = q; q = t; }
        const float apq = a[p * ld + q];
        float c = 1.f, s = 0.f;
        if (fabsf(apq) > 1e-30f) {
          const float tau = (a[q * ld + q] - a[p * ld + p]) / (2.f * apq);
          const float t = copysignf(1.f, tau) / (fabsf(tau) + sqrtf(1.f + tau * tau));
          c = rsqrtf(1.f + t * t);
          s = t * c;
        }
        P[tid] = p; Q[tid] = q; cs[tid] = c; sn[tid] = s;
      }
      __syncthreads();
      for (int w = tid; w < m * d; w += nt) {  // rows p, q <- J^T A
        const int i = w / d, col = w % d, p = P[i], q = Q[i];
        const float c = cs[i], s = sn[i], ap = a[p * ld + col], aq = a[q * ld + col];
        a[p * ld + col] = c * ap - s * aq;
        a[q * ld + col] = s * ap + c * aq;
      }
      __syncthreads();
      for (int w = tid; w < m * d; w += nt) {  // columns p, q <- A J, V J
        const int i = w / d, row = w % d, p = P[i], q = Q[i];
        const float c = cs[i], s = sn[i];
        const float ap = a[row * ld + p], aq = a[row * ld + q];
        a[row * ld + p] = c * ap - s * aq;
        a[row * ld + q] = s * ap + c * aq;
        const float vp = v[row * ld + p], vq = v[row * ld + q];
        v[row * ld + p] = c * vp - s * vq;
        v[row * ld + q] = s * vp + c * vq;
      }
      __syncthreads();
    }
  }
  for (int j = tid; j < d; j += nt) {
    const float lj = a[j * ld + j];
    int r = 0;
    for (int k2 = 0; k2 < d; ++k2) {
      const float lk = a[k2 * ld + k2];
      r += (lk > lj) || (lk == lj && k2 < j);
    }
    rank[j] = r;
    evals[(size_t)blockIdx.x * d + r] = lj;
  }
  __syncthreads();
  float* U = evecs + (size_t)blockIdx.x * d * d;
  for (int idx = tid; idx < d * d; idx += nt) {
    const int row = idx / d, j = idx % d;
    U[row * d + rank[j]] = v[row * ld + j];
  }
}

extern "C" int kite_cuda_eigh_batched(const float* A, int64_t B, int64_t d, float* evals, float* evecs,
                                      int max_sweeps, void* stream_) {
  if (B < 0 || d < 2 || d > 128 || d % 2) return -1;
  if (B == 0) return 0;
  const size_t smem = (size_t)2 * d * (d + 1) * sizeof(float) + (size_t)(d / 2) * 2 * sizeof(float) +
                      (size_t)(d / 2) * 2 * sizeof(int) + (size_t)d * sizeof(int);
  CK(cudaFuncSetAttribute(jacobi_eigh, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const int threads = d >= 128 ? 512 : 256;
  jacobi_eigh<<<(unsigned)B, threads, smem, (cudaStream_t)stream_>>>(A, (int)d, evals, evecs,
                                                                      max_sweeps > 0 ? max_sweeps : 15);
  CK(cudaGetLastError());
  return 0;
}

// ---------------------------------------------------------------------------------------------
// RoPE and the cache-dtype store, for the split PCA load's finish pass (below).

// One rotated pair (i, i + half) of a head's row: RoPE at the table row cs (when cosv is given),
// then the store in the cache dtype (OUT 0: fp32, 1: bf16, 2: fp16) at out[o] and out[o + half].
template <int OUT>
static __device__ __forceinline__ void store_roped(void* out, int64_t o, int64_t half, const float* cosv,
                                                   const float* sinv, int64_t cs, float yl, float yh) {
  float ol = yl, oh = yh;
  if (cosv) {
    ol = yl * cosv[cs] - yh * sinv[cs];
    oh = yh * cosv[cs + half] + yl * sinv[cs + half];
  }
  if (OUT == 0) { ((float*)out)[o] = ol; ((float*)out)[o + half] = oh; }
  else if (OUT == 1) {
    ((__nv_bfloat16*)out)[o] = __float2bfloat16_rn(ol);
    ((__nv_bfloat16*)out)[o + half] = __float2bfloat16_rn(oh);
  } else {
    ((__half*)out)[o] = __float2half_rn(ol);
    ((__half*)out)[o + half] = __float2half_rn(oh);
  }
}

// ---------------------------------------------------------------------------------------------
// group quantization (one warp per group), the arithmetic of kite/upcycle/quant.py: explicit
// _rn intrinsics so no multiply-add is fused. Needs gs * bits % 8 == 0 (each group owns whole
// bytes); the caller falls back to torch otherwise.

__constant__ float kGaussStepC[9] = {0.f, 1.596f, 0.9957f, 0.5860f, 0.3352f, 0.1881f, 0.1041f, 0.0569f, 0.0308f};
__constant__ float kMseGridC[8] = {0.6f, 0.75f, 0.9f, 1.0f, 1.15f, 1.35f, 1.6f, 2.0f};

static __device__ __forceinline__ float fp16r(float x) { return __half2float(__float2half_rn(x)); }
static __device__ __forceinline__ float qcode(float x, float mn, float st, float levels) {
  const float safe = st > 0.f ? st : 1.f;
  return fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(x, mn), safe)), 0.f), levels);
}

// The grid of one group of gs values at x (one warp, every lane returns it): fp16 minimum and
// step, min/max ("minmax", or at 8 bits) or the least-squared-error grid ("mse").
static __device__ void group_grid(const float* __restrict__ x, int gs, int bits, int mode, int lane,
                                  float& bmn, float& bst) {
  const float levels = (float)((1 << bits) - 1);
  float mn = INFINITY, mx = -INFINITY;
  double sum = 0.0;
  for (int i = lane; i < gs; i += 32) { const float v = x[i]; mn = fminf(mn, v); mx = fmaxf(mx, v); sum += v; }
  for (int o = 16; o; o >>= 1) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  if (mode == 1 && bits < 8) {
    const float mu = (float)(sum / gs);
    double ss = 0.0;
    for (int i = lane; i < gs; i += 32) { const double e = (double)x[i] - mu; ss += e * e; }
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float sd = (float)sqrt(ss / gs);
    const float half_levels = (float)(((1 << bits) - 1) / 2.0);
    float best = INFINITY;
    bmn = 0.f; bst = 0.f;
    for (int c = 0; c < 9; ++c) {
      float st, m;
      if (c < 8) { st = __fmul_rn(__fmul_rn(sd, kGaussStepC[bits]), kMseGridC[c]); m = __fsub_rn(mu, __fmul_rn(st, half_levels)); }
      else { st = __fdiv_rn(__fsub_rn(mx, mn), levels); m = mn; }
      m = fp16r(m); st = fp16r(st);
      // the search multiplies by the reciprocal (a code can differ from the division's only where
      // (x - m) / st is within an ulp of a half-integer); the stored codes below divide exactly
      const float inv = __frcp_rn(st > 0.f ? st : 1.f);
      float err = 0.f;
      for (int i = lane; i < gs; i += 32) {
        const float q = fminf(fmaxf(rintf(__fmul_rn(__fsub_rn(x[i], m), inv)), 0.f), levels);
        const float e = __fsub_rn(__fadd_rn(m, __fmul_rn(q, st)), x[i]);
        err = __fadd_rn(err, __fmul_rn(e, e));
      }
      for (int o = 16; o; o >>= 1) err += __shfl_xor_sync(0xffffffffu, err, o);
      if (c == 0 || err < best) { best = err; bmn = m; bst = st; }
    }
  } else {
    bmn = fp16r(mn);
    float s = fp16r(__fdiv_rn(__fsub_rn(mx, bmn), levels));
    if (__fadd_rn(bmn, __fmul_rn(s, levels)) < mx) s = fp16r(__fmul_rn(s, 1.0f + 0x1.0p-10f));
    bst = s;
  }
}

// The codes of 8 values (n <= 8 of them) packed LSB first into the low n * bits bits.
static __device__ __forceinline__ uint64_t pack8(const float* __restrict__ x, int n, int bits, int mode,
                                                float bmn, float bst, float* __restrict__ deq) {
  const float levels = (float)((1 << bits) - 1);
  uint64_t acc = 0;
  for (int i = 0; i < n; ++i) {
    const float q = (mode == 0 || bits == 8) ? (bst > 0.f ? qcode(x[i], bmn, bst, levels) : 0.f)
                                             : qcode(x[i], bmn, bst, levels);
    if (deq) deq[i] = __fadd_rn(bmn, __fmul_rn(bst, q));   // what dequantize gives (no fused multiply-add)
    acc |= (uint64_t)q << (i * bits);
  }
  return acc;
}

// Group r = g[r * gs, (r + 1) * gs): one warp per group, whole bytes per group.
__global__ void quant_groups(const float* __restrict__ g, int64_t G, int gs, int bits, int mode,
                             uint8_t* __restrict__ packed, uint16_t* __restrict__ scale16,
                             uint16_t* __restrict__ min16) {
  const int lane = threadIdx.x & 31;
  const int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (r >= G) return;
  const float* x = g + r * gs;
  float bmn, bst;
  group_grid(x, gs, bits, mode, lane, bmn, bst);
  if (lane == 0) {
    scale16[r] = __half_as_ushort(__float2half_rn(bst));
    min16[r] = __half_as_ushort(__float2half_rn(bmn));
  }
  uint8_t* out = packed + r * gs * bits / 8;
  for (int c = lane; c * 8 < gs; c += 32) {
    const int n = min(8, gs - c * 8);
    const uint64_t acc = pack8(x + c * 8, n, bits, mode, bmn, bst, nullptr);
    const int nbytes = (n * bits + 7) / 8;
    for (int b = 0; b < nbytes; ++b) out[c * bits + b] = (uint8_t)(acc >> (8 * b));
  }
}

extern "C" int kite_cuda_quantize_groups(const float* g, int64_t G, int64_t gs, int bits, int mode,
                                         uint8_t* packed, uint16_t* scale16, uint16_t* min16, void* stream) {
  if (bits < 1 || bits > 8 || G < 0 || gs < 1 || (gs * bits) % 8 || (mode != 0 && mode != 1)) return -1;
  if (G == 0) return 0;
  quant_groups<<<(unsigned)((G * 32 + 255) / 256), 256, 0, (cudaStream_t)stream>>>(g, G, (int)gs, bits, mode,
                                                                                   packed, scale16, min16);
  CK(cudaGetLastError());
  return 0;
}

// Planned quantization (the batched encoder's, see kite_runtime.h): item (r, j) is row r of src
// (rows[r] bits, 0 = not stored) times group j of the group table (part c, group g of the part,
// first column, size gs); its codes start at bit base_bit[r * C + c] + g * gs * bits of packed,
// its scale and minimum sit at base_sc[r * C + c] + g. One warp per item.
__global__ void quant_plan(const float* __restrict__ src, int64_t ld, int64_t n_rows,
                           const int64_t* __restrict__ row_bits, const int64_t* __restrict__ base_bit,
                           const int64_t* __restrict__ base_sc, int64_t C, const int64_t* __restrict__ grp,
                           int64_t n_grp, int mode, int use_or, uint8_t* __restrict__ packed,
                           uint16_t* __restrict__ scale16, uint16_t* __restrict__ min16, float* __restrict__ deq,
                           int64_t ld_deq) {
  const int lane = threadIdx.x & 31;
  const int64_t item = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (item >= n_rows * n_grp) return;
  const int64_t r = item / n_grp, j = item % n_grp;
  const int bits = (int)row_bits[r];
  if (bits <= 0) return;
  const int64_t c = grp[4 * j], g = grp[4 * j + 1], col = grp[4 * j + 2];
  const int gs = (int)grp[4 * j + 3];
  const float* x = src + r * ld + col;
  float bmn, bst;
  group_grid(x, gs, bits, mode, lane, bmn, bst);
  const int64_t si = base_sc[r * C + c] + g;
  if (lane == 0) {
    scale16[si] = __half_as_ushort(__float2half_rn(bst));
    min16[si] = __half_as_ushort(__float2half_rn(bmn));
  }
  const int64_t bit0 = base_bit[r * C + c] + g * gs * bits;
  float* dq = deq ? deq + r * ld_deq + col : nullptr;
  for (int ch = lane; ch * 8 < gs; ch += 32) {
    const int n = min(8, gs - ch * 8);
    const uint64_t acc = pack8(x + ch * 8, n, bits, mode, bmn, bst, dq ? dq + ch * 8 : nullptr);
    const int64_t b = bit0 + (int64_t)ch * 8 * bits;
    if (!use_or) {   // every group starts on a byte and owns whole bytes
      uint8_t* out = packed + (b >> 3);
      const int nbytes = (n * bits + 7) / 8;
      for (int k = 0; k < nbytes; ++k) out[k] = (uint8_t)(acc >> (8 * k));
    } else {         // groups share bytes: OR the bits into the zeroed buffer, 32-bit words
      uint32_t* w = reinterpret_cast<uint32_t*>(packed) + (b >> 5);
      const int sh = (int)(b & 31);
      const uint64_t lo = acc << sh, hi = sh ? acc >> (64 - sh) : 0;
      if ((uint32_t)lo) atomicOr(w, (uint32_t)lo);
      if ((uint32_t)(lo >> 32)) atomicOr(w + 1, (uint32_t)(lo >> 32));
      if ((uint32_t)hi) atomicOr(w + 2, (uint32_t)hi);
    }
  }
}

extern "C" int kite_cuda_quantize_plan(const float* src, int64_t ld, int64_t n_rows, const int64_t* row_bits,
                                       const int64_t* base_bit, const int64_t* base_sc, int64_t C,
                                       const int64_t* groups, int64_t n_groups, int mode, int use_or,
                                       uint8_t* packed, uint16_t* scale16, uint16_t* min16, float* deq,
                                       int64_t ld_deq, void* stream) {
  if (n_rows < 0 || n_groups < 0 || C < 1 || (mode != 0 && mode != 1) || (deq && ld_deq < 1)) return -1;
  if (n_rows == 0 || n_groups == 0) return 0;
  const int64_t items = n_rows * n_groups;
  quant_plan<<<(unsigned)((items * 32 + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
      src, ld, n_rows, row_bits, base_bit, base_sc, C, groups, n_groups, mode, use_or, packed, scale16, min16,
      deq, ld_deq);
  CK(cudaGetLastError());
  return 0;
}

// ---------------------------------------------------------------------------------------------
// split PCA load: dequantize every coefficient column of a layer's parts into out [R, ld] (the
// input of a tensor-core matmul), then, after the matmul Y = C @ basis, one pass adds the mean,
// puts back the fp16 sinks and re-applies RoPE into the cache layout. All buffers live in one
// staging region `base` (one copy per layer); fp16 scales, minimums and sink rows are read
// bytewise (blobs are not aligned there).

static __device__ __forceinline__ float h2f_at(const uint8_t* p) {
  return h2f((uint16_t)((uint16_t)p[0] | ((uint16_t)p[1] << 8)));
}

template <typename OT> static __device__ __forceinline__ OT from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
static __device__ __forceinline__ float to_f(float x) { return x; }
static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// tab [P, 6]: row0, T, gs, codes_off, scale_off, min_off (byte offsets from base)
template <typename OT>
__global__ void pca_coefs_kernel(const uint8_t* __restrict__ base, const int64_t* __restrict__ tab, int64_t R,
                                 const uint8_t* __restrict__ col_bits, const int64_t* __restrict__ col_bitoff,
                                 const int64_t* __restrict__ col_goff, OT* __restrict__ out, int64_t ld) {
  const int64_t p = blockIdx.z, j = blockIdx.y;
  const int64_t* e = tab + p * 6;
  const int64_t T = e[1];
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int bits = col_bits[j];
  const int64_t g = col_goff[p * R + j] + t / e[2];
  const float s = h2f_at(base + e[4] + 2 * g), m = h2f_at(base + e[5] + 2 * g);
  const float q = (float)code_at(base + e[3], col_bitoff[p * R + j] + t * bits, bits);
  out[j * ld + e[0] + t] = from_f<OT>(__fadd_rn(m, __fmul_rn(s, q)));
}

extern "C" int kite_cuda_pca_coefs(const uint8_t* base, int64_t P, const int64_t* tab, int64_t max_T, int64_t R,
                                   const uint8_t* col_bits, const int64_t* col_bitoff, const int64_t* col_goff,
                                   void* out, int64_t ld, int out_dtype, void* stream_) {
  if (P < 0 || R < 0 || max_T < 0 || ld < 0 || out_dtype < 0 || out_dtype > 2 || P > 65535 || R > 65535) return -1;
  if (P == 0 || R == 0 || max_T == 0) return 0;
  dim3 grid((unsigned)((max_T + 255) / 256), (unsigned)R, (unsigned)P);
  cudaStream_t st = (cudaStream_t)stream_;
  if (out_dtype == 0)
    pca_coefs_kernel<float><<<grid, 256, 0, st>>>(base, tab, R, col_bits, col_bitoff, col_goff, (float*)out, ld);
  else if (out_dtype == 1)
    pca_coefs_kernel<__nv_bfloat16><<<grid, 256, 0, st>>>(base, tab, R, col_bits, col_bitoff, col_goff,
                                                          (__nv_bfloat16*)out, ld);
  else
    pca_coefs_kernel<__half><<<grid, 256, 0, st>>>(base, tab, R, col_bits, col_bitoff, col_goff, (__half*)out, ld);
  CK(cudaGetLastError());
  return 0;
}

// Y: block b, row t, dim k at Y[b * sB + t * sT + k] (B * D == H * d); mean [H * d] float32;
// ovr [n_ovr, 4]: row, byte offset of the part's fp16 sinks [H, n, d] in base, n, index.
template <typename YT, int OUT>
__global__ void pca_finish_kernel(int64_t T, int64_t H, int64_t d, int64_t D, const YT* __restrict__ Y, int64_t sB,
                                  int64_t sT, const float* __restrict__ mean, const int64_t* __restrict__ dest,
                                  int64_t T_out, int64_t n_ovr, const int64_t* __restrict__ ovr,
                                  const uint8_t* __restrict__ base, const float* __restrict__ cosv,
                                  const float* __restrict__ sinv, void* __restrict__ out) {
  const int64_t half = d / 2, pairs = H * half;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= T * pairs) return;
  const int64_t t = idx / pairs, pr = idx % pairs;
  const int64_t row = dest ? dest[t] : t;
  if (row < 0) return;
  const int64_t h = pr / half, i = pr % half;
  const int64_t f_lo = h * d + i, f_hi = f_lo + half;
  float yl = to_f(Y[(f_lo / D) * sB + t * sT + f_lo % D]) + mean[f_lo];
  float yh = to_f(Y[(f_hi / D) * sB + t * sT + f_hi % D]) + mean[f_hi];
  for (int64_t o = 0; o < n_ovr; ++o) {
    const int64_t* e = ovr + 4 * o;
    if (e[0] != t) continue;
    const uint8_t* x = base + e[1] + 2 * ((h * e[2] + e[3]) * d + i);
    yl = h2f_at(x);
    yh = h2f_at(x + 2 * half);
    break;
  }
  store_roped<OUT>(out, (h * T_out + row) * d + i, half, cosv, sinv, row * d + i, yl, yh);
}

extern "C" int kite_cuda_pca_finish(int64_t T, int64_t H, int64_t d, int64_t D, const void* Y, int y_dtype,
                                    int64_t sB, int64_t sT, const float* mean, const int64_t* dest, int64_t T_out,
                                    int64_t n_ovr, const int64_t* ovr, const uint8_t* base, const float* cos,
                                    const float* sin, void* out, int out_dtype, void* stream_) {
  if (T < 0 || H < 1 || d < 2 || d % 2 || D < 1 || (H * d) % D || y_dtype < 0 || y_dtype > 2 || out_dtype < 0 ||
      out_dtype > 2 || n_ovr < 0)
    return -1;
  if (T == 0) return 0;
  const int64_t n = T * H * (d / 2);
  const unsigned blocks = (unsigned)((n + 255) / 256);
  cudaStream_t st = (cudaStream_t)stream_;
#define FIN(YT, O) pca_finish_kernel<YT, O><<<blocks, 256, 0, st>>>(T, H, d, D, (const YT*)Y, sB, sT, mean, dest, \
                                                                      T_out, n_ovr, ovr, base, cos, sin, out)
#define FIN_O(YT) if (out_dtype == 0) { FIN(YT, 0); } else if (out_dtype == 1) { FIN(YT, 1); } else { FIN(YT, 2); }
  if (y_dtype == 0) { FIN_O(float) }
  else if (y_dtype == 1) { FIN_O(__nv_bfloat16) }
  else { FIN_O(__half) }
#undef FIN_O
#undef FIN
  CK(cudaGetLastError());
  return 0;
}
