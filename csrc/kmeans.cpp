// Cosine k-means (Lloyd) with the semantics of kite/upcycle/cluster.py's loop: argmax similarity
// (first index on ties), empty clusters take the points least similar to their centroid,
// centroids = normalised member sums, stop when the assignment no longer changes.
#include <math.h>
#include <omp.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "kite_runtime.h"
#include "threads.h"

extern "C" int kite_kmeans_cosine(const float* x, int64_t n, int64_t D, float* C, int64_t k,
                                  int iters, int64_t* assign) {
  if (n < 1 || D < 1 || k < 1 || iters < 0) return -1;
  std::vector<int64_t> cur((size_t)n, 0), nxt((size_t)n);
  std::vector<float> own((size_t)n);
  std::vector<int64_t> counts((size_t)k);
  const int nt = kite_threads_for(0.5 * n * k * D + 2.0 * n * D);
  std::vector<double> part((size_t)nt * k * D);
  int it = 0;
  for (; it < iters; ++it) {
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = x + i * D;
      int64_t best = 0;
      float bs = -INFINITY;
      for (int64_t c = 0; c < k; ++c) {
        const float* cc = C + c * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < D; ++j) s += xi[j] * cc[j];
        if (s > bs) { bs = s; best = c; }
      }
      nxt[i] = best;
      own[i] = bs;
    }
    std::fill(counts.begin(), counts.end(), 0);
    for (int64_t i = 0; i < n; ++i) counts[nxt[i]]++;
    std::vector<int64_t> empties;
    for (int64_t c = 0; c < k; ++c) if (counts[c] == 0) empties.push_back(c);
    if (!empties.empty()) {
      std::vector<int64_t> order((size_t)n);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return own[a] < own[b]; });
      for (size_t e = 0; e < empties.size() && e < (size_t)n; ++e) nxt[order[e]] = empties[e];
    }
    // member sums: per-thread partials in double, then reduce and normalise
    std::fill(part.begin(), part.end(), 0.0);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
      double* mine = part.data() + (size_t)omp_get_thread_num() * k * D;
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        double* dst = mine + nxt[i] * D;
        const float* xi = x + i * D;
        for (int64_t j = 0; j < D; ++j) dst[j] += xi[j];
      }
    }
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t c = 0; c < k; ++c) {
      double nrm = 0.0;
      float* cc = C + c * D;
      for (int64_t j = 0; j < D; ++j) {
        double s = 0.0;
        for (int t = 0; t < nt; ++t) s += part[((size_t)t * k + c) * D + j];
        cc[j] = (float)s;
        nrm += s * s;
      }
      const float inv = 1.0f / fmaxf((float)sqrt(nrm), 1e-12f);
      for (int64_t j = 0; j < D; ++j) cc[j] *= inv;
    }
    const bool same = std::equal(cur.begin(), cur.end(), nxt.begin());
    if (same) { ++it; break; }
    cur.swap(nxt);
  }
  std::copy(cur.begin(), cur.end(), assign);
  return it;
}
