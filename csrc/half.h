// IEEE fp16 / bf16 conversions, bit-exact with torch's (round to nearest even).
// From Marat Dukhan's FP16 library (MIT); needs IEEE float arithmetic (no -ffast-math).
#pragma once
#include <stdint.h>
#include <string.h>

static inline uint32_t kite_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kite_f32_from(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float kite_h2f(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = kite_f32_from((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = kite_f32_from((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t r = sign | (two_w < (1u << 27) ? kite_f32_bits(denormalized) : kite_f32_bits(normalized));
  return kite_f32_from(r);
}

static inline uint16_t kite_f2h(float f) {
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = kite_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = kite_f32_from((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = kite_f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline uint16_t kite_f2bf(float f) {
  uint32_t u = kite_f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// code at bit offset `bitoff` of a LSB-first stream of `bits`-bit codes (bits <= 8)
static inline uint32_t kite_code_at(const uint8_t* p, int64_t bitoff, int bits) {
  const int64_t byte = bitoff >> 3;
  const int sh = (int)(bitoff & 7);
  uint32_t v = p[byte];
  if (sh + bits > 8) v |= (uint32_t)p[byte + 1] << 8;
  return (v >> sh) & ((1u << bits) - 1u);
}
