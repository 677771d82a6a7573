"""The C source of :mod:`onebit.kernels.cpu_simd` (one string: no data file to package).

Over 450 lines for a reason: it is one C translation unit (the codec's encode, server and
decompress passes, OnebitAdam's fused passes and the DDP hook's, each in portable C, AVX2
and AVX-512), compiled and cached as one library; split into several strings it would still be
one compile and one file on disk. Lines up to 120 characters: the intrinsics' names are long."""
# ruff: noqa: E501

from __future__ import annotations

_REV = ", ".join(str(int(f"{b:08b}"[::-1], 2)) for b in range(256))

SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ONEBIT_X86 1
#endif

/* bit i of b moved to bit 7 - i: a movemask puts element i in bit i, the wire wants it in 7 - i */
static const uint8_t REV[256] = {@REV@};

#ifdef ONEBIT_X86
/* the squares of a vector's floats, as float64 (exact), added into two accumulators; their sum */
__attribute__((target("avx2,fma")))
static inline void sq256(__m256 z, __m256d* a0, __m256d* a1) {
  __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(z)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(z, 1));
  *a0 = _mm256_fmadd_pd(lo, lo, *a0);
  *a1 = _mm256_fmadd_pd(hi, hi, *a1);
}

__attribute__((target("avx2,fma")))
static inline double hsum256(__m256d a0, __m256d a1) {
  __m256d a = _mm256_add_pd(a0, a1);
  __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

__attribute__((target("avx512f")))
static inline void sq512(__m512 z, __m512d* a0, __m512d* a1) {
  __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(z));
  __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
  *a0 = _mm512_fmadd_pd(lo, lo, *a0);
  *a1 = _mm512_fmadd_pd(hi, hi, *a1);
}
#endif

#ifdef ONEBIT_X86
/* AVX-512 in wire order: element i of a run of 16 sits at bit 7 - i (bit 23 - i for the second 8) of
   the two bytes read as a little-endian uint16. With the floats' lanes reversed within each 8 (one
   permute, its own inverse) lane k meets mask bit k: the bytes are the mask as they are, no REV
   lookups. The main loops take whole 16s unmasked (masked loads and stores in every iteration ran
   3-4x slower on an AMD EPYC); a last 8 takes masks. */
static inline uint16_t load16(const uint8_t* b) { uint16_t v; memcpy(&v, b, 2); return v; }
static inline void store16(uint8_t* b, uint16_t v) { memcpy(b, &v, 2); }
__attribute__((target("avx512f")))
static inline __m512 wire(__m512 v) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8), v);
}
#endif

/* the 8 elements at x + i, e + i: their byte of bits, and the sum of their squares (float64) */
static inline uint8_t byte8(const float* x, const float* e, double* sum) {
  int b = 0;
  double s = 0.0;
  for (int k = 0; k < 8; k++) {
    float z = x[k] + e[k];
    b |= (!(z < 0.0f)) << (7 - k);
    s += (double)z * (double)z;
  }
  *sum += s;
  return (uint8_t)b;
}

/* elements [0, n) (n a multiple of 8); sums[j] = sum of block j (n / block of them) */
static void blocks_c(const float* x, const float* e, uint8_t* bits, double* sums, int64_t n, int64_t block) {
  for (int64_t j = 0; j < n / block; j++) {
    double s = 0.0;
    for (int64_t i = j * block; i < (j + 1) * block; i += 8) bits[i / 8] = byte8(x + i, e + i, &s);
    sums[j] = s;
  }
}

#ifdef ONEBIT_X86
__attribute__((target("avx2,fma")))
static void blocks_avx2(const float* x, const float* e, uint8_t* bits, double* sums, int64_t n, int64_t block) {
  for (int64_t j = 0; j < n / block; j++) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (int64_t i = j * block; i < (j + 1) * block; i += 8) {
      __m256 z = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(e + i));
      bits[i / 8] = REV[_mm256_movemask_ps(_mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_NLT_UQ))];
      sq256(z, &a0, &a1);
    }
    sums[j] = hsum256(a0, a1);
  }
}

__attribute__((target("avx512f")))
static void blocks_avx512(const float* x, const float* e, uint8_t* bits, double* sums, int64_t n, int64_t block) {
  for (int64_t j = 0; j < n / block; j++) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    int64_t i = j * block, end = (j + 1) * block;
    for (; i + 16 <= end; i += 16) {
      __m512 z = _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(e + i));
      __mmask16 m = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_NLT_UQ);
      bits[i / 8] = REV[m & 255];
      bits[i / 8 + 1] = REV[m >> 8];
      sq512(z, &a0, &a1);
    }
    if (i < end) { /* a block of 16k + 8 elements: its last 8 */
      __m512 z = _mm512_maskz_add_ps(0xFF, _mm512_maskz_loadu_ps(0xFF, x + i), _mm512_maskz_loadu_ps(0xFF, e + i));
      __mmask16 m = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_NLT_UQ);
      bits[i / 8] = REV[m & 255];
      __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(z));
      a0 = _mm512_fmadd_pd(lo, lo, a0);
    }
    sums[j] = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  }
}
#endif

typedef void (*blocks_fn)(const float*, const float*, uint8_t*, double*, int64_t, int64_t);

int onebit_best_isa(void) {
#ifdef ONEBIT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

static blocks_fn pick(int isa) {
#ifdef ONEBIT_X86
  if (isa >= 2) return blocks_avx512;
  if (isa == 1) return blocks_avx2;
#endif
  return blocks_c;
}

/* Block sums: sums[j] for each block of `block` elements (a multiple of 8) of [0, n); threads
   split the blocks, each block summed in the same order whatever the split. */
void onebit_encode_blocks(const float* x, const float* e, uint8_t* bits, double* sums, int64_t n,
                          int64_t block, int isa, int threads) {
  blocks_fn f = pick(isa);
  int64_t nb = n / block;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t lo = nb * t / T, hi = nb * (t + 1) / T;
    if (hi > lo) f(x + lo * block, e + lo * block, bits + lo * block / 8, sums + lo, (hi - lo) * block, block);
  }
}

/* The sum over [0, n) (a multiple of 8): thread t sums a contiguous range in runs of `run`
   elements, the runs' sums added in order; the threads' sums added in thread order. */
double onebit_encode_total(const float* x, const float* e, uint8_t* bits, int64_t n, int isa, int threads) {
  enum { RUN = 4096, MAXT = 256 };
  double part[MAXT];
  blocks_fn f = pick(isa);
  if (threads > MAXT) threads = MAXT;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t units = n / 8, lo = units * t / T * 8, hi = units * (t + 1) / T * 8;
    double s = 0.0, r;
    for (int64_t i = lo; i < hi; i += RUN) {
      int64_t len = hi - i < RUN ? hi - i : RUN;
      f(x + i, e + i, bits + i / 8, &r, len, len);
      s += r;
    }
    part[t] = s;
    if (t == 0) used = T;
  }
  double total = 0.0;
  for (int t = 0; t < used; t++) total += part[t];
  return total;
}

/* The server's sum m = sum_r (bit ? w_r : -w_r) + e over the W ranks' bits, in rank order as the
   plain path adds it (products with +-1 exact); then its bits and float64 sums of squares, as above.
   Row r of the bits starts at bits + r * stride; rank r's weight for block j is w[r * wr + j * wj]. */
static inline float weight(const float* w, int64_t wr, int64_t wj, int r, int64_t j) { return w[r * wr + j * wj]; }

static void server_c(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                     const float* e, uint8_t* out, double* sums, int64_t n, int64_t block) {
  for (int64_t j = 0; j < n / block; j++) {
    double s = 0.0;
    for (int64_t i = j * block; i < (j + 1) * block; i += 8) {
      int b = 0;
      for (int k = 0; k < 8; k++) {
        float m = 0.0f;
        for (int r = 0; r < W; r++) {
          float wv = weight(w, wr, wj, r, j), v = (bits[r * stride + i / 8] >> (7 - k)) & 1 ? wv : -wv;
          m = r == 0 ? v : m + v;
        }
        m = m + e[i + k];
        b |= (!(m < 0.0f)) << (7 - k);
        s += (double)m * (double)m;
      }
      out[i / 8] = (uint8_t)b;
    }
    sums[j] = s;
  }
}

#ifdef ONEBIT_X86
__attribute__((target("avx2,fma")))
static void server_avx2(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                        const float* e, uint8_t* out, double* sums, int64_t n, int64_t block) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t j = 0; j < n / block; j++) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (int64_t i = j * block; i < (j + 1) * block; i += 8) {
      __m256 m = _mm256_setzero_ps();
      for (int r = 0; r < W; r++) {
        __m256i bit = _mm256_and_si256(_mm256_set1_epi32(REV[bits[r * stride + i / 8]]), lane);
        __m256 on = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, lane));
        __m256 wv = _mm256_set1_ps(weight(w, wr, wj, r, j));
        __m256 v = _mm256_blendv_ps(_mm256_xor_ps(wv, sign), wv, on);
        m = r == 0 ? v : _mm256_add_ps(m, v);
      }
      m = _mm256_add_ps(m, _mm256_loadu_ps(e + i));
      out[i / 8] = REV[_mm256_movemask_ps(_mm256_cmp_ps(m, _mm256_setzero_ps(), _CMP_NLT_UQ))];
      sq256(m, &a0, &a1);
    }
    sums[j] = hsum256(a0, a1);
  }
}

__attribute__((target("avx512f")))
static void server_avx512(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                          const float* e, uint8_t* out, double* sums, int64_t n, int64_t block) {
  const __m512i flip = _mm512_set1_epi32(INT32_MIN);
  for (int64_t j = 0; j < n / block; j++) {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    int64_t i = j * block, end = (j + 1) * block;
    for (; i + 16 <= end; i += 16) { /* in wire order (see wire) */
      __m512 m = _mm512_setzero_ps();
      for (int r = 0; r < W; r++) {
        __m512 wv = _mm512_set1_ps(weight(w, wr, wj, r, j));
        __m512 v = _mm512_mask_blend_ps(load16(bits + r * stride + i / 8),
                                        _mm512_castsi512_ps(_mm512_xor_epi32(_mm512_castps_si512(wv), flip)), wv);
        m = r == 0 ? v : _mm512_add_ps(m, v);
      }
      m = _mm512_add_ps(m, wire(_mm512_loadu_ps(e + i)));
      store16(out + i / 8, _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_NLT_UQ));
      sq512(m, &a0, &a1);
    }
    if (i < end) { /* a block of 16k + 8 elements: its last 8, in element order */
      __m512 m = _mm512_setzero_ps();
      for (int r = 0; r < W; r++) {
        __m512 wv = _mm512_set1_ps(weight(w, wr, wj, r, j));
        __m512 v = _mm512_mask_blend_ps((__mmask16)REV[bits[r * stride + i / 8]],
                                        _mm512_castsi512_ps(_mm512_xor_epi32(_mm512_castps_si512(wv), flip)), wv);
        m = r == 0 ? v : _mm512_add_ps(m, v);
      }
      m = _mm512_maskz_add_ps(0xFF, m, _mm512_maskz_loadu_ps(0xFF, e + i));
      out[i / 8] = REV[_mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_NLT_UQ) & 255];
      sq512(m, &a0, &a1);
    }
    sums[j] = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  }
}
#endif

typedef void (*server_fn)(const uint8_t*, int64_t, int, const float*, int64_t, int64_t, const float*, uint8_t*,
                          double*, int64_t, int64_t);

static server_fn pick_server(int isa) {
#ifdef ONEBIT_X86
  if (isa >= 2) return server_avx512;
  if (isa == 1) return server_avx2;
#endif
  return server_c;
}

/* Block scales: sums[j] per block (weights w[r * nb + j]); threads split the blocks. */
void onebit_server_blocks(const uint8_t* bits, int64_t stride, int W, const float* w, const float* e, uint8_t* out,
                          double* sums, int64_t n, int64_t block, int isa, int threads) {
  server_fn f = pick_server(isa);
  int64_t nb = n / block;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t lo = nb * t / T, hi = nb * (t + 1) / T;
    if (hi > lo) f(bits + lo * block / 8, stride, W, w + lo, nb, 1, e + lo * block, out + lo * block / 8, sums + lo,
                   (hi - lo) * block, block);
  }
}

/* One weight per rank (w[r]): the sum over [0, n), added as onebit_encode_total adds it. */
double onebit_server_total(const uint8_t* bits, int64_t stride, int W, const float* w, const float* e, uint8_t* out,
                           int64_t n, int isa, int threads) {
  enum { RUN = 4096, MAXT = 256 };
  double part[MAXT];
  server_fn f = pick_server(isa);
  if (threads > MAXT) threads = MAXT;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t units = n / 8, lo = units * t / T * 8, hi = units * (t + 1) / T * 8;
    double s = 0.0, r;
    for (int64_t i = lo; i < hi; i += RUN) {
      int64_t len = hi - i < RUN ? hi - i : RUN;
      f(bits + i / 8, stride, W, w, 1, 0, e + i, out + i / 8, &r, len, len);
      s += r;
    }
    part[t] = s;
    if (t == 0) used = T;
  }
  double total = 0.0;
  for (int t = 0; t < used; t++) total += part[t];
  return total;
}


/* ---- decompress: the deferred worker error (e = z - copysign(ws, z + 0), z = out + e), then the
   decode (out = +-1 * s); one pass. Scales by runs of 8: s[(i / block) * sstep] for element i. */
static inline float bitcopysign(float mag, float sgn) {
  union { float f; uint32_t u; } a = {mag}, b = {sgn};
  a.u = (a.u & 0x7FFFFFFFu) | (b.u & 0x80000000u);
  return a.f;
}

static void decompress_c(const uint8_t* bits, const float* s, int64_t sstep, float* out, float* e, const float* ws,
                         int64_t wstep, int64_t n, int64_t block) {
  for (int64_t i = 0, j = 0, rem = 0; i < n; i += 8, rem += 8) {
    if (rem == block) { rem = 0; j++; } /* j = i / block, without a division per 8 elements */
    if (e) {
      float w = ws[j * wstep];
      for (int k = 0; k < 8; k++) {
        float z = out[i + k] + e[i + k];
        e[i + k] = z - bitcopysign(w, z + 0.0f);
      }
    }
    float sc = s[j * sstep];
    for (int k = 0; k < 8; k++) out[i + k] = ((bits[i / 8] >> (7 - k)) & 1 ? 1.0f : -1.0f) * sc;
  }
}

#ifdef ONEBIT_X86
__attribute__((target("avx2,fma")))
static void decompress_avx2(const uint8_t* bits, const float* s, int64_t sstep, float* out, float* e, const float* ws,
                            int64_t wstep, int64_t n, int64_t block) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), zero = _mm256_setzero_ps();
  for (int64_t i = 0, j = 0, rem = 0; i < n; i += 8, rem += 8) {
    if (rem == block) { rem = 0; j++; }
    if (e) {
      __m256 z = _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_loadu_ps(e + i));
      __m256 w = _mm256_set1_ps(ws[j * wstep]);
      __m256 c = _mm256_or_ps(_mm256_and_ps(w, mag), _mm256_andnot_ps(mag, _mm256_add_ps(z, zero)));
      _mm256_storeu_ps(e + i, _mm256_sub_ps(z, c));
    }
    __m256i bit = _mm256_and_si256(_mm256_set1_epi32(REV[bits[i / 8]]), lane);
    __m256 on = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, lane));
    __m256 sg = _mm256_blendv_ps(_mm256_set1_ps(-1.0f), _mm256_set1_ps(1.0f), on);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(sg, _mm256_set1_ps(s[j * sstep])));
  }
}

/* the scales of elements i .. i + 15: v[j0 * step] for the first 8, v[j1 * step] for the next 8 */
__attribute__((target("avx512f")))
static inline __m512 halves(const float* v, int64_t step, int64_t j0, int64_t j1) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(v[j0 * step]), _mm512_set1_ps(v[j1 * step]));
}

__attribute__((target("avx512f")))
static inline void decompress16(const uint8_t* bits, __m512 s, float* out, float* e, __m512 w, __mmask16 live) {
  const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF);
  if (e) {
    __m512 z = _mm512_add_ps(_mm512_maskz_loadu_ps(live, out), _mm512_maskz_loadu_ps(live, e));
    __m512i zz = _mm512_castps_si512(_mm512_add_ps(z, _mm512_setzero_ps()));
    __m512 c = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(mag, _mm512_castps_si512(w), zz, 0xCA)); /* mag ? w : zz */
    _mm512_mask_storeu_ps(e, live, _mm512_sub_ps(z, c));
  }
  __mmask16 on = live == 0xFFFF ? load16(bits) : bits[0]; /* wire order */
  __m512 sg = _mm512_mask_blend_ps(on, _mm512_set1_ps(-1.0f), _mm512_set1_ps(1.0f));
  _mm512_mask_storeu_ps(out, live, _mm512_mul_ps(wire(sg), s)); /* the signs from wire order to element order */
}

__attribute__((target("avx512f")))
static void decompress_avx512(const uint8_t* bits, const float* s, int64_t sstep, float* out, float* e, const float* ws,
                              int64_t wstep, int64_t n, int64_t block) {
  int64_t i = 0, j = 0, rem = 0;
  for (; i + 16 <= n; i += 16) { /* unmasked: the constant mask folds away */
    int64_t j1 = rem + 8 >= block ? j + 1 : j; /* the block of element i + 8 */
    decompress16(bits + i / 8, halves(s, sstep, j, j1), out + i, e ? e + i : 0,
                 e ? halves(ws, wstep, j, j1) : _mm512_setzero_ps(), 0xFFFF);
    for (rem += 16; rem >= block; rem -= block) j++;
  }
  if (i < n) /* a last 8 */
    decompress16(bits + i / 8, _mm512_set1_ps(s[j * sstep]), out + i, e ? e + i : 0,
                 e ? _mm512_set1_ps(ws[j * wstep]) : _mm512_setzero_ps(), 0xFF);
}
#endif

/* Thread t of T's elements [*a, *b) of [0, n): whole units (a block, or 16 elements), the last
   thread to n (n a multiple of 8; of the block, with blocks). */
static void thread_range(int64_t n, int64_t unit, int t, int T, int64_t* a, int64_t* b) {
  int64_t units = n / unit;
  *a = units * t / T * unit;
  *b = t == T - 1 ? n : units * (t + 1) / T * unit;
}

typedef void (*decompress_fn)(const uint8_t*, const float*, int64_t, float*, float*, const float*, int64_t, int64_t,
                              int64_t);

/* elements [0, n) (a multiple of 8); e NULL: the decode only. One scale (sstep and wstep 0): the
   threads split runs of 16 elements; else each thread takes whole blocks. */
void onebit_decompress(const uint8_t* bits, const float* s, int64_t sstep, float* out, float* e, const float* ws,
                       int64_t wstep, int64_t n, int64_t block, int isa, int threads) {
  decompress_fn f = decompress_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = decompress_avx512;
  else if (isa == 1) f = decompress_avx2;
#endif
  int per_block = sstep != 0 || wstep != 0;
  #pragma omp parallel num_threads(threads)
  {
    int64_t a, b;
    thread_range(n, per_block ? block : 16, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
    int64_t j = per_block ? a / block : 0;
    if (b > a) f(bits + a / 8, s + j * sstep, sstep, out + a, e ? e + a : 0, e ? ws + j * wstep : 0, wstep, b - a,
                 per_block ? block : b - a);
  }
}

/* ---- the server's error pass: m again from the bits and e (as its first pass), then
   e = m - copysign(scale, m + 0), the scale s[(i / block) * sstep]. */
static void server_update_c(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                            float* e, const float* s, int64_t sstep, int64_t n, int64_t block) {
  for (int64_t i = 0, j = 0, rem = 0; i < n; i += 8, rem += 8) {
    if (rem == block) { rem = 0; j++; }
    for (int k = 0; k < 8; k++) {
      float m = 0.0f;
      for (int r = 0; r < W; r++) {
        float wv = w[r * wr + j * wj], v = (bits[r * stride + i / 8] >> (7 - k)) & 1 ? wv : -wv;
        m = r == 0 ? v : m + v;
      }
      m = m + e[i + k];
      e[i + k] = m - bitcopysign(s[j * sstep], m + 0.0f);
    }
  }
}

#ifdef ONEBIT_X86
__attribute__((target("avx512f")))
static inline void server_update16(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                                   int64_t j, int64_t j1, float* e, __m512 sv, __mmask16 live) {
  const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF), flip = _mm512_set1_epi32(INT32_MIN);
  __m512 m = _mm512_setzero_ps();
  for (int r = 0; r < W; r++) { /* full 16s in wire order (see wire), a last 8 in element order */
    __mmask16 on = live == 0xFFFF ? load16(bits + r * stride) : (__mmask16)REV[bits[r * stride]];
    __m512 wv = halves(w + r * wr, wj, j, j1);
    __m512 v = _mm512_mask_blend_ps(on, _mm512_castsi512_ps(_mm512_xor_epi32(_mm512_castps_si512(wv), flip)), wv);
    m = r == 0 ? v : _mm512_add_ps(m, v);
  }
  __m512 ev = _mm512_maskz_loadu_ps(live, e);
  m = _mm512_add_ps(m, live == 0xFFFF ? wire(ev) : ev);
  __m512i mm = _mm512_castps_si512(_mm512_add_ps(m, _mm512_setzero_ps()));
  __m512 r = _mm512_sub_ps(m, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(mag, _mm512_castps_si512(sv), mm, 0xCA)));
  _mm512_mask_storeu_ps(e, live, live == 0xFFFF ? wire(r) : r);
}

__attribute__((target("avx512f")))
static void server_update_avx512(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                                 float* e, const float* s, int64_t sstep, int64_t n, int64_t block) {
  int64_t i = 0, j = 0, rem = 0;
  for (; i + 16 <= n; i += 16) {
    int64_t j1 = rem + 8 >= block ? j + 1 : j; /* the block of element i + 8 */
    server_update16(bits + i / 8, stride, W, w, wr, wj, j, j1, e + i, halves(s, sstep, j, j1), 0xFFFF);
    for (rem += 16; rem >= block; rem -= block) j++;
  }
  if (i < n) server_update16(bits + i / 8, stride, W, w, wr, wj, j, j, e + i, _mm512_set1_ps(s[j * sstep]), 0xFF);
}
#endif

typedef void (*server_update_fn)(const uint8_t*, int64_t, int, const float*, int64_t, int64_t, float*, const float*,
                                 int64_t, int64_t, int64_t);

/* w: [W] (wj 0) or [W, n / block] (wj 1); s: one scale (sstep 0) or one per block (sstep 1). */
void onebit_server_update(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wj, float* e,
                          const float* s, int64_t sstep, int64_t n, int64_t block, int isa, int threads) {
  server_update_fn f = server_update_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = server_update_avx512;
#endif
  int per_block = sstep != 0 || wj != 0;
  int64_t wr = wj ? n / block : 1;
  #pragma omp parallel num_threads(threads)
  {
    int64_t a, b;
    thread_range(n, per_block ? block : 16, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
    int64_t j = per_block ? a / block : 0;
    if (b > a) f(bits + a / 8, stride, W, w + j * wj, wr, wj, e + a, s + j * sstep, sstep, b - a,
                 per_block ? block : b - a);
  }
}

/* The server's whole call without block scales in one call (onebit.kernels.cpu_compiled's AVX-512
   path): the weights w_r = s_r * (float)(1 / W) (rank r's scale at s[r * sstride]; as torch
   multiplies a float32 tensor by a Python float), the first pass (onebit_server_total: the bits
   into out), the scale (float)sqrt(total / n) into *scale, NaN where a received scale is not
   finite; where the scale is finite, the error pass (onebit_server_update). Returns whether the
   error pass ran (else e is unchanged). */
int onebit_server_reduce_one(const uint8_t* bits, int64_t stride, int W, const float* s, int64_t sstride, float* e,
                             uint8_t* out, float* scale, int64_t n, int isa, int threads) {
  float w[W];
  const float inv = (float)(1.0 / W);
  int finite = 1;
  for (int r = 0; r < W; r++) {
    float sr = s[r * sstride];
    finite = finite && isfinite(sr);
    w[r] = sr * inv;
  }
  double total = onebit_server_total(bits, stride, W, w, e, out, n, isa, threads);
  float sc = (float)sqrt(total / (double)n);
  int ran = finite && isfinite(sc);
  *scale = ran ? sc : NAN;
  if (ran) onebit_server_update(bits, stride, W, w, 0, e, scale, 0, n, n, isa, threads);
  return ran;
}

/* ---- OnebitAdam's compression stage with its element-wise maths inside the codec's passes (as
   onebit.optimizers._fused does on a GPU). A bucket's table: tensor k covers flat elements
   [start[k], start[k] + count[k]); its gradient (0: a zero gradient), frozen denominator and
   parameter at the addresses g[k], d[k], p[k]; its group's float32 scalars sc[5k .. 5k + 4]:
   b1, 1 - b1, decay (1 - lr * wd), -lr, bc1. The maths and its order are
   onebit.kernels.cpu_fused's: u = u * b1 + (w * g) / d; p = p * decay + (-lr) * clamp(u / bc1). */
#define FOLD_LOOP if (g) { for (int64_t i = 0; i < n; i++) u[i] = u[i] * b1 + (w * g[i]) / d[i]; } \
                  else { for (int64_t i = 0; i < n; i++) u[i] = u[i] * b1; } /* no gradient: u.mul_(b1) only */
#define UPDATE_LOOP for (int64_t i = 0; i < n; i++) { float v = u[i] / bc1; v = v < lo ? lo : v; v = v > hi ? hi : v; p[i] = p[i] * decay + nlr * v; }

static void fold_c(float* u, const float* g, const float* d, float b1, float w, int64_t n) { FOLD_LOOP }
static void update_c(float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n) { UPDATE_LOOP }
#ifdef ONEBIT_X86
__attribute__((target("avx512f"))) static void fold_512(float* u, const float* g, const float* d, float b1, float w, int64_t n) { FOLD_LOOP }
__attribute__((target("avx512f"))) static void update_512(float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n) { UPDATE_LOOP }
__attribute__((target("avx2,fma"))) static void fold_256(float* u, const float* g, const float* d, float b1, float w, int64_t n) { FOLD_LOOP }
__attribute__((target("avx2,fma"))) static void update_256(float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n) { UPDATE_LOOP }
#endif

typedef struct { const int64_t *start, *count, *g, *d, *p; const float* sc; int K; } table_t;

static void fold_range(int isa, float* flat, int64_t a, int64_t b, const table_t* t, int* k) {
  while (*k < t->K && t->start[*k] + t->count[*k] <= a) (*k)++;
  for (int kk = *k; kk < t->K && t->start[kk] < b; kk++) {
    int64_t lo = a > t->start[kk] ? a : t->start[kk], end = t->start[kk] + t->count[kk], hi = b < end ? b : end;
    if (hi <= lo) continue;
    int64_t o = lo - t->start[kk];
    const float* g = t->g[kk] ? (const float*)t->g[kk] + o : 0;
    const float* d = (const float*)t->d[kk] + o;
    float b1 = t->sc[5 * kk], w = t->sc[5 * kk + 1];
#ifdef ONEBIT_X86
    if (isa >= 2) { fold_512(flat + lo, g, d, b1, w, hi - lo); continue; }
    if (isa == 1) { fold_256(flat + lo, g, d, b1, w, hi - lo); continue; }
#endif
    fold_c(flat + lo, g, d, b1, w, hi - lo);
  }
}

static void update_range(int isa, const float* flat, int64_t a, int64_t b, const table_t* t, float lo_c, float hi_c, int* k) {
  while (*k < t->K && t->start[*k] + t->count[*k] <= a) (*k)++;
  for (int kk = *k; kk < t->K && t->start[kk] < b; kk++) {
    int64_t lo = a > t->start[kk] ? a : t->start[kk], end = t->start[kk] + t->count[kk], hi = b < end ? b : end;
    if (hi <= lo) continue;
    float* p = (float*)t->p[kk] + (lo - t->start[kk]);
    const float* sc = t->sc + 5 * kk;
#ifdef ONEBIT_X86
    if (isa >= 2) { update_512(p, flat + lo, sc[2], sc[3], sc[4], lo_c, hi_c, hi - lo); continue; }
    if (isa == 1) { update_256(p, flat + lo, sc[2], sc[3], sc[4], lo_c, hi_c, hi - lo); continue; }
#endif
    update_c(p, flat + lo, sc[2], sc[3], sc[4], lo_c, hi_c, hi - lo);
  }
}

/* The worker's pass of chunk elements [off, off + n_enc) of the flat bucket with the fold inside:
   each run of 4096 elements folded, then encoded (bits of u + e, float64 sum of squares) while in
   cache; the fold alone over [off + n_enc, off + n_fold) (the padded chunk's data tail). Returns
   the sum, added as onebit_encode_total adds it. */
double onebit_fold_encode(float* flat, const float* e, uint8_t* bits, int64_t off, int64_t n_enc, int64_t n_fold,
                          const int64_t* start, const int64_t* count, const int64_t* g, const int64_t* d,
                          const float* sc, int K, int isa, int threads) {
  enum { RUN = 4096, MAXT = 256 };
  table_t tab = {start, count, g, d, 0, sc, K};
  double part[MAXT];
  blocks_fn f = pick(isa);
  if (threads > MAXT) threads = MAXT;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads(), k = 0;
    int64_t units = n_enc / 8, lo = units * t / T * 8, hi = units * (t + 1) / T * 8;
    double s = 0.0, r;
    for (int64_t i = lo; i < hi; i += RUN) {
      int64_t len = hi - i < RUN ? hi - i : RUN;
      fold_range(isa, flat, off + i, off + i + len, &tab, &k);
      f(flat + off + i, e + off + i, bits + i / 8, &r, len, len);
      s += r;
    }
    part[t] = s;
    if (t == 0) used = T;
  }
  int k = 0;
  if (n_fold > n_enc) fold_range(isa, flat, off + n_enc, off + n_fold, &tab, &k);
  double total = 0.0;
  for (int t = 0; t < used; t++) total += part[t];
  return total;
}

/* Decompress of chunk elements [off, off + n) with the update inside: each run decoded (with the
   deferred worker error where e is not NULL), then the parameters it covers updated. */
void onebit_decompress_update(const uint8_t* bits, const float* s, float* flat, float* e, const float* ws, int64_t off,
                              int64_t n, const int64_t* start, const int64_t* count, const int64_t* p, const float* sc,
                              int K, float lo_c, float hi_c, int isa, int threads) {
  enum { RUN = 4096 };
  table_t tab = {start, count, 0, 0, p, sc, K};
  decompress_fn f = decompress_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = decompress_avx512;
  else if (isa == 1) f = decompress_avx2;
#endif
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads(), k = 0;
    int64_t units = n / 16, lo = units * t / T * 16, hi = t == T - 1 ? n : units * (t + 1) / T * 16;
    for (int64_t i = lo; i < hi; i += RUN) {
      int64_t len = hi - i < RUN ? hi - i : RUN;
      f(bits + i / 8, s, 0, flat + off + i, e ? e + off + i : 0, ws, 0, len, len);
      update_range(isa, flat, off + i, off + i + len, &tab, lo_c, hi_c, &k);
    }
  }
}

#ifdef ONEBIT_X86
/* A run of n elements (a multiple of 8) inside one tensor with a gradient: the fold and the encode
   in one loop, the folded u stored and used from the register; bitwise fold_512 then
   blocks_avx512 over the run (the same operations, the same float64 accumulation order). */
__attribute__((target("avx512f")))
static double fold_encode_run512(float* u, const float* g, const float* d, const float* e, uint8_t* bits, float b1,
                                 float w, int64_t n) {
  const __m512 vb = _mm512_set1_ps(b1), vw = _mm512_set1_ps(w);
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(u + i), vb),
                             _mm512_div_ps(_mm512_mul_ps(vw, _mm512_loadu_ps(g + i)), _mm512_loadu_ps(d + i)));
    _mm512_storeu_ps(u + i, x);
    __m512 z = _mm512_add_ps(x, _mm512_loadu_ps(e + i));
    __mmask16 m = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_NLT_UQ);
    bits[i / 8] = REV[m & 255];
    bits[i / 8 + 1] = REV[m >> 8];
    sq512(z, &a0, &a1);
  }
  if (i < n) { /* the last 8 */
    for (int64_t k = i; k < n; k++) u[k] = u[k] * b1 + (w * g[k]) / d[k];
    __m512 z = _mm512_maskz_add_ps(0xFF, _mm512_maskz_loadu_ps(0xFF, u + i), _mm512_maskz_loadu_ps(0xFF, e + i));
    __mmask16 m = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_NLT_UQ);
    bits[i / 8] = REV[m & 255];
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(z));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}

/* the table's tensor holding all of [a, b), with a gradient, or -1 (k: the cursor, as fold_range's) */
static int one_tensor(int64_t a, int64_t b, const table_t* t, int* k) {
  while (*k < t->K && t->start[*k] + t->count[*k] <= a) (*k)++;
  if (*k < t->K && t->start[*k] <= a && b <= t->start[*k] + t->count[*k] && t->g[*k]) return *k;
  return -1;
}
#endif

/* The worker passes over every chunk of a bucket: thread t of T's elements [*lo, *hi) of a chunk's n
   to encode, as onebit_fold_encode splits them (one thread below 65536 elements, as
   cpu_simd._threads); 0 where it has none. */
static int chunk_part(int64_t n, int t, int T, int64_t* lo, int64_t* hi) {
  int Tj = n < (1 << 16) ? 1 : T;
  if (t >= Tj) return 0;
  int64_t units = n / 8;
  *lo = units * t / Tj * 8;
  *hi = units * (t + 1) / Tj * 8;
  return 1;
}

/* chunk j's sum: its threads' partial sums part[j P + t] in thread order (used: the region's threads) */
static void chunk_sums(const int64_t* n_enc, int W, const double* part, int P, int used, double* sums) {
  for (int j = 0; j < W; j++) {
    int Tj = n_enc[j] < (1 << 16) ? 1 : used;
    double total = 0.0;
    for (int t = 0; t < Tj; t++) total += part[(size_t)j * P + t];
    sums[j] = total;
  }
}

/* All W chunks of a bucket in one parallel region (optimizers/_fused_cpu.py): chunk j covers flat
   elements [j C, j C + n_enc[j]) encoded into bits + j stride, its fold up to j C + n_fold[j];
   sums[j] its float64 total, with onebit_fold_encode's thread split and order within each chunk
   (one thread below 65536 elements, as cpu_simd._threads): bitwise W calls of it. part: the
   caller's W * threads doubles for the threads' partial sums. */
void onebit_fold_encode_all(float* flat, const float* e, uint8_t* bits, int64_t stride, int64_t C, int W,
                            const int64_t* n_enc, const int64_t* n_fold, double* sums, double* part,
                            const int64_t* start, const int64_t* count, const int64_t* g, const int64_t* d,
                            const float* sc, int K, int isa, int threads) {
  enum { RUN = 4096 };
  table_t tab = {start, count, g, d, 0, sc, K};
  blocks_fn f = pick(isa);
  const int P = threads;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads(), k = 0;
    if (t == 0) used = T;
    for (int j = 0; j < W; j++) {
      int64_t off = j * C, lo, hi;
      if (!chunk_part(n_enc[j], t, T, &lo, &hi)) continue;
      double acc = 0.0, r;
      k = 0;
      for (int64_t i = lo; i < hi; i += RUN) {
        int64_t len = hi - i < RUN ? hi - i : RUN;
#ifdef ONEBIT_X86
        int kk = isa >= 2 ? one_tensor(off + i, off + i + len, &tab, &k) : -1;
        if (kk >= 0) { /* one loop (fold_encode_run512) */
          int64_t o = off + i - tab.start[kk];
          r = fold_encode_run512(flat + off + i, (const float*)tab.g[kk] + o, (const float*)tab.d[kk] + o, e + off + i,
                                 bits + j * stride + i / 8, tab.sc[5 * kk], tab.sc[5 * kk + 1], len);
          acc += r;
          continue;
        }
#endif
        fold_range(isa, flat, off + i, off + i + len, &tab, &k);
        f(flat + off + i, e + off + i, bits + j * stride + i / 8, &r, len, len);
        acc += r;
      }
      part[(size_t)j * P + t] = acc;
    }
  }
  for (int j = 0; j < W; j++) {
    int k = 0;
    if (n_fold[j] > n_enc[j]) fold_range(isa, flat, j * C + n_enc[j], j * C + n_fold[j], &tab, &k);
  }
  chunk_sums(n_enc, W, part, P, used, sums);
}

/* onebit_decompress_update over all W chunks of a bucket in one parallel region: chunk j's elements
   [j C, j C + n[j]) from bits + j stride, scale s[j], worker scale ws[j] (e NULL: no error). */
void onebit_decompress_update_all(const uint8_t* bits, int64_t stride, const float* s, float* flat, float* e,
                                  const float* ws, int64_t C, int W, const int64_t* n, const int64_t* start,
                                  const int64_t* count, const int64_t* p, const float* sc, int K, float lo_c,
                                  float hi_c, int isa, int threads) {
  enum { RUN = 4096 };
  table_t tab = {start, count, 0, 0, p, sc, K};
  decompress_fn f = decompress_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = decompress_avx512;
  else if (isa == 1) f = decompress_avx2;
#endif
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int j = 0; j < W; j++) {
      int k = 0;
      int64_t off = j * C, units = n[j] / 16, lo = units * t / T * 16, hi = t == T - 1 ? n[j] : units * (t + 1) / T * 16;
      for (int64_t i = lo; i < hi; i += RUN) {
        int64_t len = hi - i < RUN ? hi - i : RUN;
        f(bits + j * stride + i / 8, s + j, 0, flat + off + i, e ? e + off + i : 0, e ? ws + j : 0, 0, len, len);
        update_range(isa, flat, off + i, off + i + len, &tab, lo_c, hi_c, &k);
      }
    }
  }
}

/* The update alone over flat elements [a, b) (a chunk's tail, decoded by the caller). */
void onebit_update(const float* flat, int64_t a, int64_t b, const int64_t* start, const int64_t* count, const int64_t* p,
                   const float* sc, int K, float lo_c, float hi_c, int isa) {
  table_t tab = {start, count, 0, 0, p, sc, K};
  int k = 0;
  update_range(isa, flat, a, b, &tab, lo_c, hi_c, &k);
}

/* ---- ZeroOneAdam's phase-1 compressed step with its element-wise maths inside the codec's passes
   (optimizers/_fused_cpu_zoa.py). The table as OnebitAdam's, plus m[k] (the momentum's address) and
   the scalars b1, 1 - b1, wd, -lr per tensor. The unfused step's order: x = g / d (0 without a
   gradient) into the accumulator; its compressed mean; m = fma((1 - b1) * mean, d, m * b1) (torch's
   addcmul_ on FMA CPUs); p = p + (-lr) * clamp(m / d) (+ wd * p inside the bracket with weight decay;
   cpu_fused.stale_step). The worker pass writes nothing but the bits: x is computed again in the
   decompress pass, for the deferred error z = x + e. */
#define ZOA_DIV_LOOP for (int64_t i = 0; i < n; i++) x[i] = g ? g[i] / d[i] : 0.0f;
#define ZOA_STEP_BODY(ERR, PNEW) \
  for (int64_t i = 0; i < n; i++) { \
    ERR \
    float mm = fmaf(w * mean[i], d[i], m[i] * b1); \
    m[i] = mm; \
    float v = mm / d[i]; v = v < lo ? lo : v; v = v > hi ? hi : v; \
    p[i] = PNEW; \
  }
#define ZOA_ERR(X) { float z = (X) + e[i]; e[i] = z - copysignf(ws, z + 0.0f); }
#define ZOA_STEP_WD(PNEW) \
  if (e && g) ZOA_STEP_BODY(ZOA_ERR(g[i] / d[i]), PNEW) \
  else if (e) ZOA_STEP_BODY(ZOA_ERR(0.0f), PNEW) \
  else ZOA_STEP_BODY(, PNEW)
/* the branches outside the loops, which then vectorise */
#define ZOA_STEP_LOOP if (wd != 0.0f) { ZOA_STEP_WD(p[i] + nlr * (v + wd * p[i])) } else { ZOA_STEP_WD(p[i] + nlr * v) }
#define ZOA_DIV_ARGS float* restrict x, const float* restrict g, const float* restrict d, int64_t n
#define ZOA_STEP_ARGS const float* restrict mean, const float* restrict g, const float* restrict d, float* restrict e, \
  float ws, float* restrict m, float* restrict p, float b1, float w, float wd, float nlr, float lo, float hi, int64_t n
static void zoa_div_c(ZOA_DIV_ARGS) { ZOA_DIV_LOOP }
static void zoa_step_c(ZOA_STEP_ARGS) { ZOA_STEP_LOOP }
/* Phase 2's synchronisation (ZeroOneAdam._sync, preconditioned): x = p - s (s: the parameters of the
   last synchronisation) is what the ranks average; then e from z = x + e, m = (mean * d) / nl (nl:
   minus the group's learning rates summed since), s = s + mean and p = s. */
#define ZOS_DIFF_ARGS float* restrict x, const float* restrict p, const float* restrict s, int64_t n
#define ZOS_DIFF_LOOP for (int64_t i = 0; i < n; i++) x[i] = p[i] - s[i];
#define ZOS_SYNC_ARGS const float* restrict mean, const float* restrict d, float* restrict e, float ws, \
  float* restrict m, float* restrict s, float* restrict p, float nl, int64_t n
#define ZOS_SYNC_BODY(ERR) \
  for (int64_t i = 0; i < n; i++) { \
    ERR \
    m[i] = (mean[i] * d[i]) / nl; \
    float sn = s[i] + mean[i]; \
    s[i] = sn; \
    p[i] = sn; \
  }
#define ZOS_SYNC_LOOP if (e) ZOS_SYNC_BODY(ZOA_ERR(p[i] - s[i])) else ZOS_SYNC_BODY()
static void zos_diff_c(ZOS_DIFF_ARGS) { ZOS_DIFF_LOOP }
static void zos_sync_c(ZOS_SYNC_ARGS) { ZOS_SYNC_LOOP }
#ifdef ONEBIT_X86
__attribute__((target("avx512f"))) static void zos_diff_512(ZOS_DIFF_ARGS) { ZOS_DIFF_LOOP }
__attribute__((target("avx512f"))) static void zos_sync_512(ZOS_SYNC_ARGS) { ZOS_SYNC_LOOP }
__attribute__((target("avx2,fma"))) static void zos_diff_256(ZOS_DIFF_ARGS) { ZOS_DIFF_LOOP }
__attribute__((target("avx2,fma"))) static void zos_sync_256(ZOS_SYNC_ARGS) { ZOS_SYNC_LOOP }
#endif

#ifdef ONEBIT_X86
__attribute__((target("avx512f"))) static void zoa_div_512(ZOA_DIV_ARGS) { ZOA_DIV_LOOP }
__attribute__((target("avx512f"))) static void zoa_step_512(ZOA_STEP_ARGS) { ZOA_STEP_LOOP }
__attribute__((target("avx2,fma"))) static void zoa_div_256(ZOA_DIV_ARGS) { ZOA_DIV_LOOP }
__attribute__((target("avx2,fma"))) static void zoa_step_256(ZOA_STEP_ARGS) { ZOA_STEP_LOOP }
#endif

/* sync: phase 2's synchronisation, g[k] then the address of tensor k's sync_params (sc[5 k + 4]: nl) */
typedef struct { const int64_t *start, *count, *g, *d, *m, *p; const float* sc; int K, sync; } zoa_t;

/* table tensor kk's part of flat elements [a, b): [lo, hi) (empty where hi <= lo), its offset o there
   and its gradient g (0: none) and denominator d at that offset; 0 past [a, b) */
typedef struct { int64_t lo, hi, o; const float *g, *d; } seg_t;
static int zoa_seg(const zoa_t* t, int64_t a, int64_t b, int kk, seg_t* s) {
  if (kk >= t->K || t->start[kk] >= b) return 0;
  int64_t end = t->start[kk] + t->count[kk];
  s->lo = a > t->start[kk] ? a : t->start[kk];
  s->hi = b < end ? b : end;
  s->o = s->lo - t->start[kk];
  s->g = t->g[kk] ? (const float*)t->g[kk] + s->o : 0;
  s->d = (const float*)t->d[kk] + s->o;
  return 1;
}

/* the first tensor that can overlap [a, ...): the cursor k moved past those that end before a */
static int zoa_first(const zoa_t* t, int64_t a, int* k) {
  while (*k < t->K && t->start[*k] + t->count[*k] <= a) (*k)++;
  return *k;
}

/* x over flat elements [a, b) into x[0, b - a) */
static void zoa_div_range(int isa, float* x, int64_t a, int64_t b, const zoa_t* t, int* k) {
  seg_t s;
  for (int kk = zoa_first(t, a, k); zoa_seg(t, a, b, kk, &s); kk++) {
    if (s.hi <= s.lo) continue;
    if (t->sync) { /* x = p - sync_params */
      const float* p = (const float*)t->p[kk] + s.o;
#ifdef ONEBIT_X86
      if (isa >= 2) { zos_diff_512(x + (s.lo - a), p, s.g, s.hi - s.lo); continue; }
      if (isa == 1) { zos_diff_256(x + (s.lo - a), p, s.g, s.hi - s.lo); continue; }
#endif
      zos_diff_c(x + (s.lo - a), p, s.g, s.hi - s.lo);
      continue;
    }
#ifdef ONEBIT_X86
    if (isa >= 2) { zoa_div_512(x + (s.lo - a), s.g, s.d, s.hi - s.lo); continue; }
    if (isa == 1) { zoa_div_256(x + (s.lo - a), s.g, s.d, s.hi - s.lo); continue; }
#endif
    zoa_div_c(x + (s.lo - a), s.g, s.d, s.hi - s.lo);
  }
}

/* the error, momentum and parameter updates over flat elements [a, b), mean[0, b - a) the decoded
   mean (e: the whole worker error buffer, NULL: not updated) */
static void zoa_step_range(int isa, const float* mean, float* e, float ws, int64_t a, int64_t b, const zoa_t* t,
                           float lo_c, float hi_c, int* k) {
  seg_t s;
  for (int kk = zoa_first(t, a, k); zoa_seg(t, a, b, kk, &s); kk++) {
    if (s.hi <= s.lo) continue;
    float *m = (float*)t->m[kk] + s.o, *p = (float*)t->p[kk] + s.o, *ee = e ? e + s.lo : 0;
    const float *sc = t->sc + 5 * kk, *mv = mean + (s.lo - a);
    int64_t n = s.hi - s.lo;
    if (t->sync) {
      float* sp = (float*)t->g[kk] + s.o;
#ifdef ONEBIT_X86
      if (isa >= 2) { zos_sync_512(mv, s.d, ee, ws, m, sp, p, sc[4], n); continue; }
      if (isa == 1) { zos_sync_256(mv, s.d, ee, ws, m, sp, p, sc[4], n); continue; }
#endif
      zos_sync_c(mv, s.d, ee, ws, m, sp, p, sc[4], n);
      continue;
    }
#ifdef ONEBIT_X86
    if (isa >= 2) { zoa_step_512(mv, s.g, s.d, ee, ws, m, p, sc[0], sc[1], sc[2], sc[3], lo_c, hi_c, n); continue; }
    if (isa == 1) { zoa_step_256(mv, s.g, s.d, ee, ws, m, p, sc[0], sc[1], sc[2], sc[3], lo_c, hi_c, n); continue; }
#endif
    zoa_step_c(mv, s.g, s.d, ee, ws, m, p, sc[0], sc[1], sc[2], sc[3], lo_c, hi_c, n);
  }
}

/* The worker pass of every chunk of a bucket (as onebit_fold_encode_all, the same thread split and
   sums): chunk j's [j C, j C + n_enc[j]) encoded from x + e run by run (x in a scratch run), and x
   written into flat over [j C + n_enc[j], j C + n_fold[j]) (the padded rest's data, for the caller's
   plain encode). */
void onebit_zoa_encode_all(float* flat, const float* e, uint8_t* bits, int64_t stride, int64_t C, int W,
                           const int64_t* n_enc, const int64_t* n_fold, double* sums, double* part,
                           const int64_t* start, const int64_t* count, const int64_t* g, const int64_t* d,
                           const int64_t* p, int K, int sync, int isa, int threads) {
  enum { RUN = 4096 };
  zoa_t tab = {start, count, g, d, 0, p, 0, K, sync};
  blocks_fn f = pick(isa);
  const int P = threads;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads(), k = 0;
    float x[RUN] __attribute__((aligned(64)));
    if (t == 0) used = T;
    for (int j = 0; j < W; j++) {
      int64_t off = j * C, lo, hi;
      if (!chunk_part(n_enc[j], t, T, &lo, &hi)) continue;
      double acc = 0.0, r;
      k = 0;
      for (int64_t i = lo; i < hi; i += RUN) {
        int64_t len = hi - i < RUN ? hi - i : RUN;
        zoa_div_range(isa, x, off + i, off + i + len, &tab, &k);
        f(x, e + off + i, bits + j * stride + i / 8, &r, len, len);
        acc += r;
      }
      part[(size_t)j * P + t] = acc;
    }
  }
  for (int j = 0; j < W; j++) {
    int k = 0;
    if (n_fold[j] > n_enc[j]) zoa_div_range(isa, flat + j * C + n_enc[j], j * C + n_enc[j], j * C + n_fold[j], &tab, &k);
  }
  chunk_sums(n_enc, W, part, P, used, sums);
}

/* The decompress pass of every chunk of a bucket: chunk j's [j C, j C + n[j]) decoded run by run
   (scale s[j]) into a scratch run, then the error (ws[j]; e NULL: not updated), momentum and
   parameter updates. */
void onebit_zoa_step_all(const uint8_t* bits, int64_t stride, const float* s, float* e, const float* ws, int64_t C,
                         int W, const int64_t* n, const int64_t* start, const int64_t* count, const int64_t* g,
                         const int64_t* d, const int64_t* m, const int64_t* p, const float* sc, int K, float lo_c,
                         float hi_c, int sync, int isa, int threads) {
  enum { RUN = 4096 };
  zoa_t tab = {start, count, g, d, m, p, sc, K, sync};
  decompress_fn f = decompress_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = decompress_avx512;
  else if (isa == 1) f = decompress_avx2;
#endif
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    float mean[RUN] __attribute__((aligned(64)));
    for (int j = 0; j < W; j++) {
      int k = 0;
      int64_t off = j * C, units = n[j] / 16, lo = units * t / T * 16, hi = t == T - 1 ? n[j] : units * (t + 1) / T * 16;
      for (int64_t i = lo; i < hi; i += RUN) {
        int64_t len = hi - i < RUN ? hi - i : RUN;
        f(bits + j * stride + i / 8, s + j, 0, mean, 0, 0, 0, len, len);
        zoa_step_range(isa, mean, e, e ? ws[j] : 0.0f, off + i, off + i + len, &tab, lo_c, hi_c, &k);
      }
    }
  }
}

/* The updates alone over flat elements [a, b), their decoded mean at mean[0, b - a) (a chunk's
   padded rest, decoded by the caller; its error too: e not updated here). */
void onebit_zoa_step_range(const float* mean, int64_t a, int64_t b, const int64_t* start, const int64_t* count,
                           const int64_t* g, const int64_t* d, const int64_t* m, const int64_t* p, const float* sc,
                           int K, float lo_c, float hi_c, int sync, int isa) {
  zoa_t tab = {start, count, g, d, m, p, sc, K, sync};
  int k = 0;
  zoa_step_range(isa, mean, 0, 0.0f, a, b, &tab, lo_c, hi_c, &k);
}

/* ---- The float64 sum of squares of n float32s (any n): exact squares, float64 adds; threads sum
   contiguous ranges, added in thread order. */
static double sumsq_c(const float* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
  return s;
}

#ifdef ONEBIT_X86
__attribute__((target("avx512f")))
static double sumsq_avx512(const float* x, int64_t n) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 z = _mm512_loadu_ps(x + i);
    sq512(z, &a0, &a1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1)) + sumsq_c(x + i, n - i);
}

__attribute__((target("avx2,fma")))
static double sumsq_avx2(const float* x, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 z = _mm256_loadu_ps(x + i);
    sq256(z, &a0, &a1);
  }
  return hsum256(a0, a1) + sumsq_c(x + i, n - i);
}
#endif

static double sq_any(int isa, const float* x, int64_t n) {
#ifdef ONEBIT_X86
  if (isa >= 2) return sumsq_avx512(x, n);
  if (isa == 1) return sumsq_avx2(x, n);
#endif
  return sumsq_c(x, n);
}

double onebit_sumsq(const float* x, int64_t n, int isa, int threads) {
  enum { MAXT = 256 };
  double part[MAXT];
  if (threads > MAXT) threads = MAXT;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t lo, hi;
    thread_range(n, 16, t, T, &lo, &hi);
    double s = hi > lo ? sq_any(isa, x + lo, hi - lo) : 0.0;
    part[t] = s;
    if (t == 0) used = T;
  }
  double total = 0.0;
  for (int t = 0; t < used; t++) total += part[t];
  return total;
}

/* ---- The DDP hook's pre-pass with the local gradient norm inside: returns the float64 sum of g^2
   (g as it came), and writes g = (g + m * k) / d (onebit.kernels.cpu_fused.hook_pre's order). */
static double hook_pre_c(float* g, const float* m, const float* d, float k, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) {
    s += (double)g[i] * (double)g[i];
    g[i] = (g[i] + m[i] * k) / d[i];
  }
  return s;
}

#ifdef ONEBIT_X86
__attribute__((target("avx512f")))
static double hook_pre_512(float* g, const float* m, const float* d, float k, int64_t n) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  const __m512 kv = _mm512_set1_ps(k);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 z = _mm512_loadu_ps(g + i);
    sq512(z, &a0, &a1);
    __m512 t = _mm512_add_ps(z, _mm512_mul_ps(_mm512_loadu_ps(m + i), kv));
    _mm512_storeu_ps(g + i, _mm512_div_ps(t, _mm512_loadu_ps(d + i)));
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1)) + hook_pre_c(g + i, m + i, d + i, k, n - i);
}

__attribute__((target("avx2,fma")))
static double hook_pre_256(float* g, const float* m, const float* d, float k, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  const __m256 kv = _mm256_set1_ps(k);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 z = _mm256_loadu_ps(g + i);
    sq256(z, &a0, &a1);
    __m256 t = _mm256_add_ps(z, _mm256_mul_ps(_mm256_loadu_ps(m + i), kv));
    _mm256_storeu_ps(g + i, _mm256_div_ps(t, _mm256_loadu_ps(d + i)));
  }
  return hsum256(a0, a1) + hook_pre_c(g + i, m + i, d + i, k, n - i);
}
#endif

static double pre_any(int isa, float* g, const float* m, const float* d, float k, int64_t n) {
#ifdef ONEBIT_X86
  if (isa >= 2) return hook_pre_512(g, m, d, k, n);
  if (isa == 1) return hook_pre_256(g, m, d, k, n);
#endif
  return hook_pre_c(g, m, d, k, n);
}

double onebit_hook_pre(float* g, const float* m, const float* d, float k, int64_t n, int isa, int threads) {
  enum { MAXT = 256 };
  double part[MAXT];
  if (threads > MAXT) threads = MAXT;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t lo, hi;
    thread_range(n, 16, t, T, &lo, &hi);
    double s = hi > lo ? pre_any(isa, g + lo, m + lo, d + lo, k, hi - lo) : 0.0;
    part[t] = s;
    if (t == 0) used = T;
  }
  double total = 0.0;
  for (int t = 0; t < used; t++) total += part[t];
  return total;
}

/* ---- The DDP hook's passes (freeze_step) inside the codec's, as OnebitAdam's above: the table's
   entry k is a parameter with momentum, flat elements [start[k], start[k] + count[k]), its momentum
   at g[k], its frozen denominators at d[k], its factor at sc[5k]; elsewhere the bucket holds the
   gradient as it is. Before the encode, run by run: x = (g + m k) / d (hook_pre above) and the
   float64 sum of g^2 over every element (the local norm); after the decode: out = out * d - m k
   (onebit.kernels.cpu_fused.hook_post's order). */
#define POST_LOOP for (int64_t i = 0; i < n; i++) out[i] = out[i] * d[i] - m[i] * k;
static void post_c(float* out, const float* m, const float* d, float k, int64_t n) { POST_LOOP }
#ifdef ONEBIT_X86
__attribute__((target("avx512f"))) static void post_512(float* out, const float* m, const float* d, float k, int64_t n) { POST_LOOP }
__attribute__((target("avx2,fma"))) static void post_256(float* out, const float* m, const float* d, float k, int64_t n) { POST_LOOP }
#endif

/* flat elements [a, b): the pre-pass inside the table's entries, the sum of squares alone elsewhere */
static double pre_range(int isa, float* flat, int64_t a, int64_t b, const table_t* t, int* k) {
  double s = 0.0;
  int64_t pos = a;
  while (*k < t->K && t->start[*k] + t->count[*k] <= a) (*k)++;
  for (int kk = *k; kk < t->K && t->start[kk] < b; kk++) {
    int64_t lo = a > t->start[kk] ? a : t->start[kk], end = t->start[kk] + t->count[kk], hi = b < end ? b : end;
    if (hi <= lo) continue;
    if (lo > pos) s += sq_any(isa, flat + pos, lo - pos);
    int64_t o = lo - t->start[kk];
    float* g = flat + lo;
    const float *m = (const float*)t->g[kk] + o, *d = (const float*)t->d[kk] + o;
    s += pre_any(isa, g, m, d, t->sc[5 * kk], hi - lo);
    pos = hi;
  }
  if (b > pos) s += sq_any(isa, flat + pos, b - pos);
  return s;
}

static void post_range(int isa, float* flat, int64_t a, int64_t b, const table_t* t, int* k) {
  while (*k < t->K && t->start[*k] + t->count[*k] <= a) (*k)++;
  for (int kk = *k; kk < t->K && t->start[kk] < b; kk++) {
    int64_t lo = a > t->start[kk] ? a : t->start[kk], end = t->start[kk] + t->count[kk], hi = b < end ? b : end;
    if (hi <= lo) continue;
    int64_t o = lo - t->start[kk];
    const float *m = (const float*)t->g[kk] + o, *d = (const float*)t->d[kk] + o;
    float f = t->sc[5 * kk];
#ifdef ONEBIT_X86
    if (isa >= 2) { post_512(flat + lo, m, d, f, hi - lo); continue; }
    if (isa == 1) { post_256(flat + lo, m, d, f, hi - lo); continue; }
#endif
    post_c(flat + lo, m, d, f, hi - lo);
  }
}

/* runs of about 4096 elements, whole blocks */
static int64_t run_of(int64_t block) { return block ? (block < 4096 ? 4096 / block * block : block) : 4096; }

/* The worker's pass of chunk elements [off, off + n) with the pre-pass inside, run by run while in
   cache. block > 0: sums[j] for each block of the range (n a multiple of block), returns 0; block 0:
   returns the sum of squares, added as onebit_fold_encode adds it. *sq: the sum of g^2 over the range. */
double onebit_hook_encode(float* flat, const float* e, uint8_t* bits, double* sums, int64_t off, int64_t n,
                          int64_t block, const int64_t* start, const int64_t* count, const int64_t* m,
                          const int64_t* d, const float* sc, int K, double* sq, int isa, int threads) {
  enum { MAXT = 256 };
  table_t tab = {start, count, m, d, 0, sc, K};
  double part[MAXT], psq[MAXT];
  blocks_fn f = pick(isa);
  int64_t unit = block ? block : 8, run = run_of(block);
  if (threads > MAXT) threads = MAXT;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads(), k = 0;
    int64_t units = n / unit, lo = units * t / T * unit, hi = units * (t + 1) / T * unit;
    double s = 0.0, q = 0.0, r;
    for (int64_t i = lo; i < hi; i += run) {
      int64_t len = hi - i < run ? hi - i : run;
      q += pre_range(isa, flat, off + i, off + i + len, &tab, &k);
      if (block) f(flat + off + i, e + off + i, bits + i / 8, sums + i / block, len, block);
      else { f(flat + off + i, e + off + i, bits + i / 8, &r, len, len); s += r; }
    }
    part[t] = s;
    psq[t] = q;
    if (t == 0) used = T;
  }
  double total = 0.0, q = 0.0;
  for (int t = 0; t < used; t++) { total += part[t]; q += psq[t]; }
  *sq = q;
  return total;
}

/* Decompress of chunk elements [off, off + n) (as onebit_decompress: e NULL, the decode only; sstep
   and wstep 0: one scale) with the post-pass inside, run by run. */
void onebit_hook_decompress(const uint8_t* bits, const float* s, int64_t sstep, float* flat, float* e, const float* ws,
                            int64_t wstep, int64_t off, int64_t n, int64_t block, const int64_t* start,
                            const int64_t* count, const int64_t* m, const int64_t* d, const float* sc, int K, int isa,
                            int threads) {
  table_t tab = {start, count, m, d, 0, sc, K};
  decompress_fn f = decompress_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = decompress_avx512;
  else if (isa == 1) f = decompress_avx2;
#endif
  int64_t unit = block ? block : 16, run = run_of(block);
  #pragma omp parallel num_threads(threads)
  {
    int k = 0;
    int64_t lo, hi;
    thread_range(n, unit, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
    for (int64_t i = lo; i < hi; i += run) {
      int64_t len = hi - i < run ? hi - i : run, j = block ? i / block : 0;
      f(bits + i / 8, s + j * sstep, sstep, flat + off + i, e ? e + off + i : 0, e ? ws + j * wstep : 0, wstep, len,
        block ? block : len);
      post_range(isa, flat, off + i, off + i + len, &tab, &k);
    }
  }
}

/* The two passes alone over flat elements [a, b) (a chunk's padded tail, encoded or decoded by the caller). */
double onebit_hook_pre_range(float* flat, int64_t a, int64_t b, const int64_t* start, const int64_t* count,
                             const int64_t* m, const int64_t* d, const float* sc, int K, int isa) {
  table_t tab = {start, count, m, d, 0, sc, K};
  int k = 0;
  return pre_range(isa, flat, a, b, &tab, &k);
}

void onebit_hook_post_range(float* flat, int64_t a, int64_t b, const int64_t* start, const int64_t* count,
                            const int64_t* m, const int64_t* d, const float* sc, int K, int isa) {
  table_t tab = {start, count, m, d, 0, sc, K};
  int k = 0;
  post_range(isa, flat, a, b, &tab, &k);
}
""".replace("@REV@", _REV)
