// Batched symmetric eigendecomposition in float64: Householder tridiagonalisation + implicit QL
// (EISPACK tred2 / tql2, as in JAMA, public domain), one matrix per OpenMP task. For the many
// small Gram matrices of kite/upcycle/codec.py's batched_pca (d = 64 ... 512).
#include <math.h>
#include <omp.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "kite_runtime.h"
#include "threads.h"

namespace {

// V: [n, n] row-major, in: the symmetric matrix, out: the orthogonal Householder product.
void tred2(int n, double* V, double* d, double* e) {
#define V_(r, c) V[(size_t)(r) * n + (c)]
  for (int j = 0; j < n; j++) d[j] = V_(n - 1, j);
  for (int i = n - 1; i > 0; i--) {
    double scale = 0.0, h = 0.0;
    for (int k = 0; k < i; k++) scale += fabs(d[k]);
    if (scale == 0.0) {
      e[i] = d[i - 1];
      for (int j = 0; j < i; j++) { d[j] = V_(i - 1, j); V_(i, j) = 0.0; V_(j, i) = 0.0; }
    } else {
      for (int k = 0; k < i; k++) { d[k] /= scale; h += d[k] * d[k]; }
      double f = d[i - 1], g = sqrt(h);
      if (f > 0) g = -g;
      e[i] = scale * g;
      h -= f * g;
      d[i - 1] = f - g;
      for (int j = 0; j < i; j++) e[j] = 0.0;
      for (int j = 0; j < i; j++) {
        f = d[j];
        V_(j, i) = f;
        g = e[j] + V_(j, j) * f;
        for (int k = j + 1; k <= i - 1; k++) { g += V_(k, j) * d[k]; e[k] += V_(k, j) * f; }
        e[j] = g;
      }
      f = 0.0;
      for (int j = 0; j < i; j++) { e[j] /= h; f += e[j] * d[j]; }
      const double hh = f / (h + h);
      for (int j = 0; j < i; j++) e[j] -= hh * d[j];
      for (int j = 0; j < i; j++) {
        f = d[j];
        g = e[j];
        for (int k = j; k <= i - 1; k++) V_(k, j) -= (f * e[k] + g * d[k]);
        d[j] = V_(i - 1, j);
        V_(i, j) = 0.0;
      }
    }
    d[i] = h;
  }
  for (int i = 0; i < n - 1; i++) {
    V_(n - 1, i) = V_(i, i);
    V_(i, i) = 1.0;
    const double h = d[i + 1];
    if (h != 0.0) {
      for (int k = 0; k <= i; k++) d[k] = V_(k, i + 1) / h;
      for (int j = 0; j <= i; j++) {
        double g = 0.0;
        for (int k = 0; k <= i; k++) g += V_(k, i + 1) * V_(k, j);
        for (int k = 0; k <= i; k++) V_(k, j) -= g * d[k];
      }
    }
    for (int k = 0; k <= i; k++) V_(k, i + 1) = 0.0;
  }
  for (int j = 0; j < n; j++) { d[j] = V_(n - 1, j); V_(n - 1, j) = 0.0; }
  V_(n - 1, n - 1) = 1.0;
  e[0] = 0.0;
#undef V_
}

// W = V^T (row i = column i of V), so the rotations below touch contiguous rows.
void tql2(int n, double* W, double* d, double* e) {
#define W_(r, c) W[(size_t)(r) * n + (c)]
  for (int i = 1; i < n; i++) e[i - 1] = e[i];
  e[n - 1] = 0.0;
  double f = 0.0, tst1 = 0.0;
  const double eps = 0x1.0p-52;
  for (int l = 0; l < n; l++) {
    tst1 = std::max(tst1, fabs(d[l]) + fabs(e[l]));
    int m = l;
    while (m < n) { if (fabs(e[m]) <= eps * tst1) break; m++; }
    if (m == n) m = n - 1;
    if (m > l) {
      int iter = 0;
      do {
        if (++iter > 60) break;
        double g = d[l];
        double p = (d[l + 1] - g) / (2.0 * e[l]);
        double r = hypot(p, 1.0);
        if (p < 0) r = -r;
        d[l] = e[l] / (p + r);
        d[l + 1] = e[l] * (p + r);
        const double dl1 = d[l + 1];
        double h = g - d[l];
        for (int i = l + 2; i < n; i++) d[i] -= h;
        f += h;
        p = d[m];
        double c = 1.0, c2 = c, c3 = c, s = 0.0, s2 = 0.0;
        const double el1 = e[l + 1];
        for (int i = m - 1; i >= l; i--) {
          c3 = c2; c2 = c; s2 = s;
          g = c * e[i];
          h = c * p;
          r = hypot(p, e[i]);
          e[i + 1] = s * r;
          s = e[i] / r;
          c = p / r;
          p = c * d[i] - s * g;
          d[i + 1] = h + s * (c * g + s * d[i]);
          double* wi = &W_(i, 0);
          double* wj = &W_(i + 1, 0);
#pragma omp simd
          for (int k = 0; k < n; k++) {
            const double t = wj[k];
            wj[k] = s * wi[k] + c * t;
            wi[k] = c * wi[k] - s * t;
          }
        }
        p = -s * s2 * c3 * el1 * e[l] / dl1;
        e[l] = s * p;
        d[l] = c * p;
      } while (fabs(e[l]) > eps * tst1);
    }
    d[l] += f;
    e[l] = 0.0;
  }
#undef W_
}

}  // namespace

extern "C" int kite_eigh_batched(const double* A, int64_t B, int64_t d, double* evals, double* evecs) {
  if (B < 0 || d < 1) return -1;
  const int n = (int)d;
  const int nt = kite_threads_for(10.0 * B * d * d * d);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::vector<double> V((size_t)n * n), W((size_t)n * n), dv(n), ev(n);
    std::vector<int> order(n);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      const double* a = A + (size_t)b * n * n;
      // symmetrise from the lower triangle (what tred2 reads)
      std::copy(a, a + (size_t)n * n, V.begin());
      tred2(n, V.data(), dv.data(), ev.data());
      for (int r = 0; r < n; ++r)
        for (int c = 0; c < n; ++c) W[(size_t)c * n + r] = V[(size_t)r * n + c];
      tql2(n, W.data(), dv.data(), ev.data());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return dv[x] > dv[y]; });
      double* lam = evals + (size_t)b * n;
      double* U = evecs + (size_t)b * n * n;
      for (int j = 0; j < n; ++j) {
        lam[j] = dv[order[j]];
        const double* w = &W[(size_t)order[j] * n];
        for (int r = 0; r < n; ++r) U[(size_t)r * n + j] = w[r];
      }
    }
  }
  return 0;
}
