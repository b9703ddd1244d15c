// A CPU batch's decode attention: one new token a row, each row over its own first lens[b] slots.
// out[b, h] = softmax(q[b, h] . K[b, g]^T * scale) V[b, g] for query head h of KV head g = h / rep.
// Every (row, KV head) is one task on the thread team (its rep query heads read the keys and values
// once), so a step's rows of unlike lengths share the cores; torch's fused CPU attention called a
// row at a time split one row's 3 KV heads over 2 threads.
//
// A (row, head)'s sums run in one fixed order whatever rows are beside it: a batch's tokens are
// those of each sequence alone.
#include <math.h>
#include <stdint.h>

#include <vector>

#include <omp.h>

#include "kite_runtime.h"

extern "C" int kite_decode_attention(const float* q, const float* k, const float* v, int64_t k_row, int64_t k_head,
                                     int64_t k_slot, int64_t v_row, int64_t v_head, int64_t v_slot,
                                     const int64_t* lens, float* out, int64_t rows, int64_t q_heads, int64_t kv_heads,
                                     int64_t dim, float scale, int threads) {
  if (!q || !k || !v || !lens || !out || rows < 1 || kv_heads < 1 || q_heads < kv_heads || q_heads % kv_heads ||
      dim < 1 || threads < 1)
    return -1;
  for (int64_t b = 0; b < rows; ++b)
    if (lens[b] < 1) return -1;
  const int64_t rep = q_heads / kv_heads, tasks = rows * kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p;
    std::vector<double> total(rep);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads, n = lens[b];
      const float* kb = k + b * k_row + g * k_head;
      const float* vb = v + b * v_row + g * v_head;
      const float* qb = q + (b * q_heads + g * rep) * dim;
      float* ob = out + (b * q_heads + g * rep) * dim;
      p.resize(rep * n);   // every entry is written below
      // scores, each query head's row of n
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = kb + t * k_slot;
        for (int64_t r = 0; r < rep; ++r) {
          const float* qr = qb + r * dim;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < dim; ++i) s += qr[i] * kt[i];
          p[r * n + t] = s * scale;
        }
      }
      // softmax by the row's maximum
      for (int64_t r = 0; r < rep; ++r) {
        float* pr = p.data() + r * n;
        float top = pr[0];
        for (int64_t t = 1; t < n; ++t) top = pr[t] > top ? pr[t] : top;
        double sum = 0.0;
        for (int64_t t = 0; t < n; ++t) {
          pr[t] = expf(pr[t] - top);
          sum += pr[t];
        }
        total[r] = sum;
      }
      // the values weighed by the probabilities
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t i = 0; i < dim; ++i) ob[r * dim + i] = 0.0f;
      for (int64_t t = 0; t < n; ++t) {
        const float* vt = vb + t * v_slot;
        for (int64_t r = 0; r < rep; ++r) {
          const float w = p[r * n + t];
          float* orow = ob + r * dim;
#pragma omp simd
          for (int64_t i = 0; i < dim; ++i) orow[i] += w * vt[i];
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        const float inv = (float)(1.0 / total[r]);
        for (int64_t i = 0; i < dim; ++i) ob[r * dim + i] *= inv;
      }
    }
  }
  return 0;
}
