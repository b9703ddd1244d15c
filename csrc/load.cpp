// Fused load of one encoded part: dequantize its PCA coefficients, reconstruct
// (coefficients @ basis^T + mean per block), overwrite sink/outlier tokens with their raw values,
// re-apply RoPE and store into the cache layout [H, T_out, d] at each token's row.
#include <omp.h>

#include <vector>

#include "half.h"
#include "kite_runtime.h"
#include "threads.h"

extern "C" int kite_pca_load(int64_t T, int64_t R, int64_t B, int64_t D, int64_t H, int64_t d,
                             const uint8_t* codes, const int64_t* col_bitoff, const uint8_t* col_bits,
                             const int64_t* col_goff, int64_t gs, const uint16_t* scale16,
                             const uint16_t* min16, const int64_t* blk_off, const float* basis_t,
                             const float* mean, const int64_t* dest, int64_t T_out,
                             const int32_t* override_idx, const uint16_t* ovr_x16, int64_t n_ovr,
                             const float* cos, const float* sin, void* out, int out_dtype) {
  if (T < 0 || R < 0 || B < 1 || D < 1 || d < 2 || B * D != H * d || D % d || d % 2 || gs < 1 ||
      out_dtype < 0 || out_dtype > 2 || blk_off[0] != 0 || blk_off[B] != R)
    return -1;
  const int64_t half = d / 2, HD = H * d;
  const int nt = kite_threads_for(0.5 * T * R * D + 5.0 * T * HD);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::vector<float> c((size_t)R + 1), y((size_t)HD);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = dest ? dest[t] : t;
      const int32_t ov = override_idx ? override_idx[t] : -1;
      if (ov >= 0) {
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < d; ++i) y[h * d + i] = kite_h2f(ovr_x16[(h * n_ovr + ov) * d + i]);
      } else {
        for (int64_t j = 0; j < R; ++j) {
          const int bits = col_bits[j];
          const int64_t g = col_goff[j] + t / gs;
          const float q = (float)kite_code_at(codes, col_bitoff[j] + t * bits, bits);
          c[j] = kite_h2f(min16[g]) + kite_h2f(scale16[g]) * q;
        }
        for (int64_t b = 0; b < B; ++b) {
          float* yb = y.data() + b * D;
          for (int64_t k = 0; k < D; ++k) yb[k] = 0.f;
          for (int64_t j = blk_off[b]; j < blk_off[b + 1]; ++j) {
            const float cj = c[j];
            const float* bj = basis_t + j * D;
#pragma omp simd
            for (int64_t k = 0; k < D; ++k) yb[k] += cj * bj[k];
          }
          for (int64_t k = 0; k < D; ++k) yb[k] += mean[b * D + k];
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const float* yh = y.data() + h * d;
        const int64_t o = (h * T_out + row) * d;
        for (int64_t i = 0; i < d; ++i) {
          float v = yh[i];
          if (cos) {
            const float rot = i < half ? -yh[i + half] : yh[i - half];
            v = v * cos[row * d + i] + rot * sin[row * d + i];
          }
          if (out_dtype == 0) ((float*)out)[o + i] = v;
          else if (out_dtype == 1) ((uint16_t*)out)[o + i] = kite_f2bf(v);
          else ((uint16_t*)out)[o + i] = kite_f2h(v);
        }
      }
    }
  }
  return 0;
}
