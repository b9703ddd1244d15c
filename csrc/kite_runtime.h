// KITE native runtime: C ABI of build/libkite_runtime.so (CPU, OpenMP) and
// build/libkite_runtime_cuda.so (CUDA). Every function returns 0 on success, a negative code on
// bad arguments (-1) or a CUDA error (-2). Pointers are plain contiguous buffers (row-major);
// fp16 values travel as their uint16 bit patterns. No Python headers: bound with ctypes.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KITE_RUNTIME_ABI 4

const char* kite_runtime_version(void);  // "kite-runtime <abi>.<rev> (cpu, openmp N threads)"
int kite_runtime_abi(void);
int kite_runtime_threads(void);

// ---- quantization (bit-for-bit kite/upcycle/quant.py on its [G, gs] grouped view) -----------
// g: [G, gs] float32 groups. mode 0 = minmax, 1 = mse. packed: ceil(G*gs*bits/8) bytes
// (codes LSB first); scale16, min16: [G] fp16 bits.
int kite_quantize_groups(const float* g, int64_t G, int64_t gs, int bits, int mode,
                         uint8_t* packed, uint16_t* scale16, uint16_t* min16);
// out [G, gs] = min + scale * code, float32.
int kite_dequantize_groups(const uint8_t* packed, int64_t G, int64_t gs, int bits,
                           const uint16_t* scale16, const uint16_t* min16, float* out);

// ---- rANS (kite/upcycle/format/rans.py: the same bytes as its numpy coder) -----------------------
// codes [n] over K interleaved streams, freq [nsym] summing to 2^scale. Out: the final states [K], the
// words per stream [K] and the words (cap at least n), each stream's in decoding order, stream by stream.
int kite_rans_encode(const uint8_t* codes, int64_t n, const int32_t* freq, int nsym, int scale, int64_t K,
                     uint32_t* states, int64_t* counts, uint16_t* words, int64_t cap);
// The n codes back (out [n]); 0, or 4 / 5 / 6: a stream ran out of words / left words / ended off 2^16.
int kite_rans_decode(const uint32_t* states, const int64_t* counts, const uint16_t* words, int64_t K,
                     const int32_t* freq, int nsym, int scale, int64_t n, uint8_t* out);
// codes [n] packed LSB-first at bw bits into out [nbytes], zero bits after the last (format/bitlayout.py).
int kite_pack_codes(const uint8_t* codes, int64_t n, int bw, uint8_t* out, int64_t nbytes);

// ---- a few rows' projections (kite/model/cpu_products.py) ---------------------------------------
// out[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o], optional) for r < rows: w [n_out, n_in] (leading
// dimension ldw), x [rows, n_in] (ldx), out [rows, n_out] (ldo), float32, on `threads` threads; the rows
// are summed KITE_ROWS_BLOCK at a time against each pair of weight rows. A row's sums do not depend on
// the rows beside it. -3 where the build has no vector path (kite_rows_product_width() is then 0; else
// the floats a vector holds).
#define KITE_ROWS_BLOCK 8
int kite_rows_product_width(void);
int kite_rows_product(const float* w, int64_t ldw, const float* x, int64_t ldx, const float* bias, float* out,
                      int64_t ldo, int64_t rows, int64_t n_out, int64_t n_in, int threads);

// ---- a CPU batch's decode attention (kite/runtime/attention.py: decode_rows) --------------------
// q [rows, q_heads, dim] (one new token a row), K and V of row b, KV head g, slot t at
// k + b * k_row + g * k_head + t * k_slot (the same for v), float32, dim contiguous; row b attends over
// its first lens[b] >= 1 slots; out [rows, q_heads, dim]. Query head h reads KV head h / (q_heads / kv_heads).
int kite_decode_attention(const float* q, const float* k, const float* v, int64_t k_row, int64_t k_head,
                          int64_t k_slot, int64_t v_row, int64_t v_head, int64_t v_slot, const int64_t* lens,
                          float* out, int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t dim, float scale,
                          int threads);

// ---- k-means (cosine, Lloyd iterations of kite/upcycle/cluster.py) ----------------------------
// x: [n, D] L2-normalised rows; C: [k, D] initial centroids, overwritten with the final ones;
// assign: [n] int64 out. Returns the number of iterations run (>= 1) or < 0.
int kite_kmeans_cosine(const float* x, int64_t n, int64_t D, float* C, int64_t k, int iters,
                       int64_t* assign);

// ---- batched symmetric eigendecomposition (Householder + implicit QL, float64) --------------
// A: [B, d, d] symmetric; evals [B, d] descending; evecs [B, d, d] with column j = eigvec j.
int kite_eigh_batched(const double* A, int64_t B, int64_t d, double* evals, double* evecs);

// ---- CUDA (libkite_runtime_cuda.so; device pointers; stream = cudaStream_t or NULL) ----------
const char* kite_cuda_version(void);
int kite_cuda_kmeans_cosine(const float* x, int64_t n, int64_t D, float* C, int64_t k, int iters,
                            int64_t* assign, void* stream);
// Same as kite_quantize_groups (minmax bit-exact; mse: the grid search sums in another order and
// multiplies by the reciprocal, so a near-tie may pick another grid point); gs * bits % 8 == 0.
int kite_cuda_quantize_groups(const float* g, int64_t G, int64_t gs, int bits, int mode,
                              uint8_t* packed, uint16_t* scale16, uint16_t* min16, void* stream);
// Planned quantization of many rows of one row-major matrix src (leading dimension ld) in one launch,
// each row at its own bit width (row_bits[r], int64; 0 = the row is not stored) and cut into the
// groups of a table (groups: n_groups x {part c, group g of the part, first column, size gs}, int64).
// Group (r, j) is quantized as kite_quantize_groups quantizes a group (mode: 0 minmax, 1 mse below
// 8 bits); its codes go to packed from bit base_bit[r * C + c] + g * gs * bits (LSB first), its fp16
// scale and minimum to index base_sc[r * C + c] + g. use_or = 0: every group starts on a byte and
// gs * bits % 8 == 0 (plain stores); use_or = 1: the codes are OR-ed into 32-bit words (packed must be
// zeroed, 4-byte aligned, and 8 bytes longer than the last code). deq (optional, leading dimension
// ld_deq): the dequantized values, min + scale * code, at the rows' and groups' positions.
int kite_cuda_quantize_plan(const float* src, int64_t ld, int64_t n_rows, const int64_t* row_bits,
                            const int64_t* base_bit, const int64_t* base_sc, int64_t C, const int64_t* groups,
                            int64_t n_groups, int mode, int use_or, uint8_t* packed, uint16_t* scale16,
                            uint16_t* min16, float* deq, int64_t ld_deq, void* stream);
// A: [B, d, d] float32 symmetric, d even and <= 128: one launch, one block per matrix (Jacobi).
int kite_cuda_eigh_batched(const float* A, int64_t B, int64_t d, float* evals, float* evecs,
                           int max_sweeps, void* stream);

// Split PCA load, CUDA only. pca_coefs: dequantize coefficient columns of P parts held in one staging
// region `base`: tab [P, 6] = row0, T, gs, codes_off, scale_off, min_off (bytes from base);
// column j of part p: bits col_bits[j], codes from bit col_bitoff[p*R + j] of the part's codes,
// groups from col_goff[p*R + j]; out [R, ld] (dtype 0 f32, 1 bf16, 2 f16), token t of part p at
// column row0 + t. pca_finish: Y (block b, token t, dim k at b*sB + t*sT + k; dtype as out) + mean
// [H*d] f32, sink rows from ovr [n_ovr, 4] (token, byte offset of fp16 [H, n, d] in base, n, index),
// RoPE by cos/sin [T_out, d] at row dest[t] (< 0: skipped) of out [H, T_out, d].
int kite_cuda_pca_coefs(const uint8_t* base, int64_t P, const int64_t* tab, int64_t max_T, int64_t R,
                        const uint8_t* col_bits, const int64_t* col_bitoff, const int64_t* col_goff,
                        void* out, int64_t ld, int out_dtype, void* stream);
int kite_cuda_pca_finish(int64_t T, int64_t H, int64_t d, int64_t D, const void* Y, int y_dtype,
                         int64_t sB, int64_t sT, const float* mean, const int64_t* dest, int64_t T_out,
                         int64_t n_ovr, const int64_t* ovr, const uint8_t* base, const float* cos,
                         const float* sin, void* out, int out_dtype, void* stream);

#ifdef __cplusplus
}
#endif
