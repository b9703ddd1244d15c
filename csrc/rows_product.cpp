// A CPU model's projections of a few rows (a decode step: one row a sequence; a short prompt: one row
// a token): out[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]), the weight read once, in order, at the
// memory's speed. BLAS's matrix products are made for many rows: a product of the embedded model's
// weights with six rows read them at ~16-25 GB/s of the dev CPU's ~52, with one row at ~21. Each pair
// of weight rows is summed against every block of KITE_ROWS_BLOCK rows of x while it sits in the
// core's cache, so more rows than a block still read the weight from memory once.
//
// Each (r, o) is summed the same way whatever the number of rows (lane-wise partial sums over i in
// steps of the vector width, the tail's products added after, then the lanes), so a row's answer does
// not depend on the rows beside it: a batch of sequences decodes what each decodes alone, bit for bit,
// and a prompt's token gets the sums it would get alone.
#include <stdint.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <omp.h>

#include "kite_runtime.h"

namespace {

#if defined(__AVX512F__)
constexpr int kWidth = 16;

inline float lanes_sum(__m512 v) {
  // the lanes added pairwise, in one fixed order: halves, quarters, then within 128 bits (the
  // shuffles' zero-masked forms: GCC 12 warns of the plain ones' undefined operand in every caller)
  const __mmask16 all = 0xFFFF;
  __m512 s = _mm512_add_ps(v, _mm512_maskz_shuffle_f32x4(all, v, v, 0x4E));
  s = _mm512_add_ps(s, _mm512_maskz_shuffle_f32x4(all, s, s, 0xB1));
  __m128 q = _mm512_maskz_extractf32x4_ps(0xF, s, 0);
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// Two outputs (w0, w1: rows o and o + 1 of the weight) against R rows of x.
template <int R>
inline void two_outputs(const float* w0, const float* w1, const float* x, int64_t ldx, int64_t n_in, float* s0,
                        float* s1, int64_t ahead = 0) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kWidth <= n_in; i += kWidth) {
    const __m512 v0 = _mm512_loadu_ps(w0 + i), v1 = _mm512_loadu_ps(w1 + i);
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + i + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + i + ahead), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + i);
      a0[r] = _mm512_fmadd_ps(v0, xv, a0[r]);
      a1[r] = _mm512_fmadd_ps(v1, xv, a1[r]);
    }
  }
  if (i < n_in) {
    const __mmask16 m = (__mmask16)((1u << (n_in - i)) - 1u);
    const __m512 v0 = _mm512_maskz_loadu_ps(m, w0 + i), v1 = _mm512_maskz_loadu_ps(m, w1 + i);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * ldx + i);
      a0[r] = _mm512_fmadd_ps(v0, xv, a0[r]);
      a1[r] = _mm512_fmadd_ps(v1, xv, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    s0[r] = lanes_sum(a0[r]);
    s1[r] = lanes_sum(a1[r]);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kWidth = 8;

inline float lanes_sum(__m256 v) {
  // the lanes added pairwise, in one fixed order
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// One output against R rows (16 vector registers: R accumulators, the weight's and a row's vectors).
template <int R>
inline void one_output(const float* w0, const float* x, int64_t ldx, int64_t n_in, float* s0, int64_t ahead = 0) {
  __m256 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kWidth <= n_in; i += kWidth) {
    const __m256 v = _mm256_loadu_ps(w0 + i);
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w0 + i + ahead), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + r * ldx + i), a[r]);
  }
  for (int r = 0; r < R; ++r) {
    float tail = 0.0f;
    for (int64_t j = i; j < n_in; ++j) tail += w0[j] * x[r * ldx + j];
    s0[r] = lanes_sum(a[r]) + tail;
  }
}

template <int R>
inline void two_outputs(const float* w0, const float* w1, const float* x, int64_t ldx, int64_t n_in, float* s0,
                        float* s1, int64_t ahead = 0) {
  one_output<R>(w0, x, ldx, n_in, s0, ahead);
  one_output<R>(w1, x, ldx, n_in, s1, ahead);
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// A step's rows (R <= KITE_ROWS_BLOCK), R known when compiled: the decode step's path.
template <int R>
void product(const float* w, int64_t ldw, const float* x, int64_t ldx, const float* bias, float* out, int64_t ldo,
             int64_t n_out, int64_t n_in, int threads) {
  const int64_t pairs = n_out / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t o = 2 * p;
    float s0[R], s1[R];
    // the next pair's weight rows asked for while this pair's are summed: the hardware's prefetch alone
    // read the weights at ~18 GB/s with 8 rows on the dev CPU (2 threads), ~32 GB/s with this
    two_outputs<R>(w + o * ldw, w + (o + 1) * ldw, x, ldx, n_in, s0, s1, p + 1 < pairs ? 2 * ldw : 0);
    const float b0 = bias ? bias[o] : 0.0f, b1 = bias ? bias[o + 1] : 0.0f;
    for (int r = 0; r < R; ++r) {
      out[r * ldo + o] = bias ? s0[r] + b0 : s0[r];
      out[r * ldo + o + 1] = bias ? s1[r] + b1 : s1[r];
    }
  }
  if (n_out % 2) {
    const int64_t o = n_out - 1;
    float s0[R], unused[R];
    two_outputs<R>(w + o * ldw, w + o * ldw, x, ldx, n_in, s0, unused);
    for (int r = 0; r < R; ++r) out[r * ldo + o] = bias ? s0[r] + bias[o] : s0[r];
  }
}

// Two outputs against the n = 1..KITE_ROWS_BLOCK rows of x (a block's tail: n known at run time).
inline void two_outputs_n(int64_t n, const float* w0, const float* w1, const float* x, int64_t ldx, int64_t n_in,
                          float* s0, float* s1) {
  switch (n) {
    case 1: two_outputs<1>(w0, w1, x, ldx, n_in, s0, s1); break;
    case 2: two_outputs<2>(w0, w1, x, ldx, n_in, s0, s1); break;
    case 3: two_outputs<3>(w0, w1, x, ldx, n_in, s0, s1); break;
    case 4: two_outputs<4>(w0, w1, x, ldx, n_in, s0, s1); break;
    case 5: two_outputs<5>(w0, w1, x, ldx, n_in, s0, s1); break;
    case 6: two_outputs<6>(w0, w1, x, ldx, n_in, s0, s1); break;
    case 7: two_outputs<7>(w0, w1, x, ldx, n_in, s0, s1); break;
    default: two_outputs<8>(w0, w1, x, ldx, n_in, s0, s1); break;
  }
}

// A prompt's rows (more than a block): each pair of weight rows summed against every block of
// KITE_ROWS_BLOCK rows of x while it is in the core's cache, so the weight is read from memory once
// per span of rows; a span is as many rows as keep x within a core's L2 (~512 KB), so a long prompt's
// rows are read from there, not from memory, by every pair (its weight, once per span, from L3 where a
// matrix fits there).
void product_blocks(const float* w, int64_t ldw, const float* x, int64_t ldx, const float* bias, float* out,
                    int64_t ldo, int64_t rows, int64_t n_out, int64_t n_in, int threads) {
  constexpr int B = KITE_ROWS_BLOCK;
  const int64_t pairs = (n_out + 1) / 2;
  int64_t span = (512 * 1024 / (int64_t)sizeof(float)) / ldx / B * B;
  if (span < B) span = B;
  for (int64_t first = 0; first < rows; first += span) {
    const int64_t last = first + span < rows ? first + span : rows;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t o = 2 * p;
      const bool two = o + 1 < n_out;
      const float* w0 = w + o * ldw;
      const float* w1 = two ? w0 + ldw : w0;      // an odd last output summed twice, one kept
      const float b0 = bias ? bias[o] : 0.0f, b1 = bias && two ? bias[o + 1] : 0.0f;
      float s0[B], s1[B];
      int64_t r0 = first;
      // the span's first block asks for the next pair's weight rows (the later ones find this pair's cached)
      for (; r0 + B <= last; r0 += B) {
        two_outputs<B>(w0, w1, x + r0 * ldx, ldx, n_in, s0, s1, r0 == first && p + 1 < pairs ? 2 * ldw : 0);
        for (int r = 0; r < B; ++r) {
          out[(r0 + r) * ldo + o] = bias ? s0[r] + b0 : s0[r];
          if (two) out[(r0 + r) * ldo + o + 1] = bias ? s1[r] + b1 : s1[r];
        }
      }
      if (r0 < last) {
        const int64_t n = last - r0;
        two_outputs_n(n, w0, w1, x + r0 * ldx, ldx, n_in, s0, s1);
        for (int64_t r = 0; r < n; ++r) {
          out[(r0 + r) * ldo + o] = bias ? s0[r] + b0 : s0[r];
          if (two) out[(r0 + r) * ldo + o + 1] = bias ? s1[r] + b1 : s1[r];
        }
      }
    }
  }
}
#endif

}  // namespace

extern "C" int kite_rows_product_width(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return kWidth;
#else
  return 0;
#endif
}

extern "C" int kite_rows_product(const float* w, int64_t ldw, const float* x, int64_t ldx, const float* bias,
                                 float* out, int64_t ldo, int64_t rows, int64_t n_out, int64_t n_in, int threads) {
  if (!w || !x || !out || rows < 1 || n_out < 1 || n_in < 1 || ldw < n_in || ldx < n_in || ldo < n_out || threads < 1)
    return -1;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  switch (rows) {
    case 1: product<1>(w, ldw, x, ldx, bias, out, ldo, n_out, n_in, threads); break;
    case 2: product<2>(w, ldw, x, ldx, bias, out, ldo, n_out, n_in, threads); break;
    case 3: product<3>(w, ldw, x, ldx, bias, out, ldo, n_out, n_in, threads); break;
    case 4: product<4>(w, ldw, x, ldx, bias, out, ldo, n_out, n_in, threads); break;
    case 5: product<5>(w, ldw, x, ldx, bias, out, ldo, n_out, n_in, threads); break;
    case 6: product<6>(w, ldw, x, ldx, bias, out, ldo, n_out, n_in, threads); break;
    case 7: product<7>(w, ldw, x, ldx, bias, out, ldo, n_out, n_in, threads); break;
    case 8: product<8>(w, ldw, x, ldx, bias, out, ldo, n_out, n_in, threads); break;
    default: product_blocks(w, ldw, x, ldx, bias, out, ldo, rows, n_out, n_in, threads); break;
  }
  return 0;
#else
  (void)bias;
  return -3;
#endif
}
