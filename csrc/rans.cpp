// Interleaved rANS of one static table (kite/upcycle/format/rans.py): the same streams, states and
// words as its numpy coder, a stream at a time. Stream k holds codes k, k + K, k + 2K, ...; a state is
// kept in [2^16, 2^32) by 16-bit words, at most one a code.
#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "kite_runtime.h"

static const uint64_t kLow = 1u << 16;

extern "C" int kite_rans_encode(const uint8_t* codes, int64_t n, const int32_t* freq, int nsym, int scale,
                                int64_t K, uint32_t* states, int64_t* counts, uint16_t* words, int64_t cap) {
  if (n < 0 || K < 1 || nsym < 1 || scale < 1 || scale > 16) return 1;
  std::vector<uint64_t> cum(nsym, 0);
  for (int s = 1; s < nsym; ++s) cum[s] = cum[s - 1] + (uint64_t)freq[s - 1];
  std::vector<uint16_t> emitted;
  int64_t at = 0;
  for (int64_t k = 0; k < K; ++k) {
    emitted.clear();
    uint64_t x = kLow;
    int64_t last = k < n ? k + ((n - 1 - k) / K) * K : -1;
    for (int64_t i = last; i >= 0; i -= K) {
      uint8_t s = codes[i];
      if (s >= nsym || freq[s] <= 0) return 2;
      uint64_t f = (uint64_t)freq[s];
      if (x >= (f << (32 - scale))) {
        emitted.push_back((uint16_t)(x & 0xffff));
        x >>= 16;
      }
      x = ((x / f) << scale) + x % f + cum[s];
    }
    if (at + (int64_t)emitted.size() > cap) return 3;
    for (size_t j = 0; j < emitted.size(); ++j) words[at + j] = emitted[emitted.size() - 1 - j];
    at += (int64_t)emitted.size();
    states[k] = (uint32_t)x;
    counts[k] = (int64_t)emitted.size();
  }
  return 0;
}

// 0: decoded; 4: a stream ran out of words; 5: words left unread; 6: a stream ended off 2^16.
extern "C" int kite_rans_decode(const uint32_t* states, const int64_t* counts, const uint16_t* words, int64_t K,
                                const int32_t* freq, int nsym, int scale, int64_t n, uint8_t* out) {
  if (n < 0 || K < 1 || nsym < 1 || scale < 1 || scale > 16) return 1;
  const uint64_t table = 1u << scale, mask = table - 1;
  std::vector<uint8_t> code_of(table, 0);
  std::vector<uint64_t> cum(nsym, 0);
  uint64_t start = 0;
  for (int s = 0; s < nsym; ++s) {
    if (freq[s] < 0 || start + (uint64_t)freq[s] > table) return 1;
    cum[s] = start;
    for (int32_t j = 0; j < freq[s]; ++j) code_of[start + j] = (uint8_t)s;
    start += (uint64_t)freq[s];
  }
  if (start != table) return 1;
  int64_t read = 0;
  for (int64_t k = 0; k < K; ++k) {
    uint64_t x = states[k];
    const int64_t end = read + counts[k];
    for (int64_t i = k; i < n; i += K) {
      uint64_t slot = x & mask;
      uint8_t s = code_of[slot];
      out[i] = s;
      x = (uint64_t)freq[s] * (x >> scale) + slot - cum[s];
      if (x < kLow) {
        if (read >= end) return 4;
        x = (x << 16) | words[read++];
      }
    }
    if (read != end) return 5;
    if (x != kLow) return 6;
  }
  return 0;
}

// codes [n] (each < 2^bw) packed LSB-first at bw bits into out [nbytes] (zero bits after the last).
extern "C" int kite_pack_codes(const uint8_t* codes, int64_t n, int bw, uint8_t* out, int64_t nbytes) {
  if (bw < 1 || bw > 8 || n < 0 || (n * bw + 7) / 8 > nbytes) return -1;
  for (int64_t i = 0; i < nbytes; ++i) out[i] = 0;
  uint64_t acc = 0;
  int have = 0;
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc |= (uint64_t)codes[i] << have;
    have += bw;
    while (have >= 8) {
      out[at++] = (uint8_t)(acc & 0xff);
      acc >>= 8;
      have -= 8;
    }
  }
  if (have > 0) out[at] = (uint8_t)(acc & 0xff);
  return 0;
}
