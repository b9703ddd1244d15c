// Group-wise asymmetric int quantization, the same arithmetic as kite/upcycle/quant.py:
// fp16 scale and minimum, codes computed against the stored fp16 values, LSB-first bit packing.
// Compiled with -ffp-contract=off so no multiply-add is fused (torch rounds each step).
#include <math.h>
#include <omp.h>

#include <vector>

#include "half.h"
#include "threads.h"
#include "kite_runtime.h"

namespace {

// Step of the MSE-optimal uniform quantizer of a unit Gaussian (quant.py GAUSS_STEP), grid factors.
const float kGaussStep[9] = {0.f, 1.596f, 0.9957f, 0.5860f, 0.3352f, 0.1881f, 0.1041f, 0.0569f, 0.0308f};
const float kMseGrid[8] = {0.6f, 0.75f, 0.9f, 1.0f, 1.15f, 1.35f, 1.6f, 2.0f};

inline float clampq(float q, float levels) { return q < 0.f ? 0.f : (q > levels ? levels : q); }

// codes of one group against (mn, st) already rounded to fp16; returns the squared error.
inline float group_codes(const float* x, int64_t gs, float mn, float st, float levels, uint8_t* q) {
  const float safe = st > 0.f ? st : 1.f;
  float err = 0.f;
  for (int64_t i = 0; i < gs; ++i) {
    const float c = clampq(nearbyintf((x[i] - mn) / safe), levels);
    q[i] = (uint8_t)c;
    const float e = (mn + c * st) - x[i];
    err += e * e;
  }
  return err;
}

void quant_minmax(const float* x, int64_t gs, int bits, uint8_t* q, uint16_t* s16, uint16_t* m16) {
  const float levels = (float)((1 << bits) - 1);
  float mn = x[0], mx = x[0];
  for (int64_t i = 1; i < gs; ++i) { mn = fminf(mn, x[i]); mx = fmaxf(mx, x[i]); }
  const uint16_t mnh = kite_f2h(mn);
  const float mnf = kite_h2f(mnh);
  uint16_t sh = kite_f2h((mx - mnf) / levels);
  float s = kite_h2f(sh);
  if ((mnf + s * levels) < mx) sh = kite_f2h(s * (1.0f + 0x1.0p-10f));
  const float sf = kite_h2f(sh);
  for (int64_t i = 0; i < gs; ++i)
    q[i] = sf > 0.f ? (uint8_t)clampq(nearbyintf((x[i] - mnf) / sf), levels) : 0;
  *s16 = sh;
  *m16 = mnh;
}

void quant_mse(const float* x, int64_t gs, int bits, uint8_t* q, uint8_t* tmp, uint16_t* s16, uint16_t* m16) {
  const float levels = (float)((1 << bits) - 1);
  double sum = 0.0;
  float mn = x[0], mx = x[0];
  for (int64_t i = 0; i < gs; ++i) { sum += x[i]; mn = fminf(mn, x[i]); mx = fmaxf(mx, x[i]); }
  const float mu = (float)(sum / (double)gs);
  double ss = 0.0;
  for (int64_t i = 0; i < gs; ++i) { const double e = (double)x[i] - mu; ss += e * e; }
  const float sd = (float)sqrt(ss / (double)gs);
  const float half_levels = (float)(((1 << bits) - 1) / 2.0);
  float best = INFINITY;
  for (int c = 0; c < 9; ++c) {
    float st, m;
    if (c < 8) { st = (sd * kGaussStep[bits]) * kMseGrid[c]; m = mu - st * half_levels; }
    else { st = (mx - mn) / levels; m = mn; }
    const uint16_t mh = kite_f2h(m), sh = kite_f2h(st);
    const float err = group_codes(x, gs, kite_h2f(mh), kite_h2f(sh), levels, tmp);
    if (c == 0 || err < best) {
      best = err; *m16 = mh; *s16 = sh;
      for (int64_t i = 0; i < gs; ++i) q[i] = tmp[i];
    }
  }
}

// Pack n codes LSB first. Chunks of 8 codes fill exactly `bits` bytes, so threads never share one.
void pack(const uint8_t* q, int64_t n, int bits, uint8_t* out) {
  const int64_t chunks = n / 8;
  const int nt = kite_threads_for(1.0 * n);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    uint64_t acc = 0;
    for (int i = 0; i < 8; ++i) acc |= (uint64_t)q[c * 8 + i] << (i * bits);
    for (int b = 0; b < bits; ++b) out[c * bits + b] = (uint8_t)(acc >> (8 * b));
  }
  const int64_t rest = n - chunks * 8;
  if (rest) {
    uint64_t acc = 0;
    for (int64_t i = 0; i < rest; ++i) acc |= (uint64_t)q[chunks * 8 + i] << (i * bits);
    const int64_t nbytes = (rest * bits + 7) / 8;
    for (int64_t b = 0; b < nbytes; ++b) out[chunks * bits + b] = (uint8_t)(acc >> (8 * b));
  }
}

}  // namespace

extern "C" int kite_quantize_groups(const float* g, int64_t G, int64_t gs, int bits, int mode,
                                    uint8_t* packed, uint16_t* scale16, uint16_t* min16) {
  if (bits < 1 || bits > 8 || G < 0 || gs < 1 || (mode != 0 && mode != 1)) return -1;
  const int64_t n = G * gs;
  std::vector<uint8_t> q((size_t)n);
  const int nt = kite_threads_for((mode == 1 && bits < 8 ? 40.0 : 4.0) * n);
  if (mode == 1 && bits < 8) {
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
      std::vector<uint8_t> tmp((size_t)gs);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < G; ++r)
        quant_mse(g + r * gs, gs, bits, q.data() + r * gs, tmp.data(), scale16 + r, min16 + r);
    }
  } else {
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t r = 0; r < G; ++r)
      quant_minmax(g + r * gs, gs, bits, q.data() + r * gs, scale16 + r, min16 + r);
  }
  pack(q.data(), n, bits, packed);
  return 0;
}

extern "C" int kite_dequantize_groups(const uint8_t* packed, int64_t G, int64_t gs, int bits,
                                      const uint16_t* scale16, const uint16_t* min16, float* out) {
  if (bits < 1 || bits > 8 || G < 0 || gs < 1) return -1;
  const int nt = kite_threads_for(2.0 * G * gs);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t r = 0; r < G; ++r) {
    const float mn = kite_h2f(min16[r]), s = kite_h2f(scale16[r]);
    float* o = out + r * gs;
    const int64_t base = r * gs * bits;
    if (bits == 8) {
      for (int64_t i = 0; i < gs; ++i) o[i] = mn + s * (float)packed[r * gs + i];
    } else {
      for (int64_t i = 0; i < gs; ++i) o[i] = mn + s * (float)kite_code_at(packed, base + i * bits, bits);
    }
  }
  return 0;
}
