/* The codec's passes: the worker's encode (packed signs and float64 sums of squares), the server's two
   passes and decompress (with the deferred worker error), each in portable C, AVX2 + FMA and AVX-512;
   the float64 sum of squares. Contracts: onebit/kernels/cpu_simd.py, docs/ALGORITHMS.md. */
#include "native.h"

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

ONEBIT_AVX512
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

int onebit_best_isa(void) {
#ifdef ONEBIT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
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
  enum { RUN = 4096 };
  blocks_fn f = pick(isa);
  double total;
  ONEBIT_THREAD_SUM(total, n, 8, threads, {
    double r;
    for (int64_t i = a; i < b; i += RUN) {
      int64_t len = b - i < RUN ? b - i : RUN;
      f(x + i, e + i, bits + i / 8, &r, len, len);
      s += r;
    }
  });
  return total;
}

/* The server's sum m = sum_r (bit ? w_r : -w_r) + e over the W ranks' bits, in rank order as the
   plain path adds it (products with +-1 exact); then its bits and float64 sums of squares, as above.
   Row r of the bits starts at bits + r * stride; rank r's weight for block j is w[r * wr + j * wj]. */
static inline float weight(const float* w, int64_t wr, int64_t wj, int r, int64_t j) { return w[r * wr + j * wj]; }

/* The portable variants run 8 elements at a time through SGN, the +-1.0 of each bit of a byte (bit 7 - k
   at k): loops of 8 floats that the compiler vectorises (SSE2, NEON). +-1 * w is exact: the plain path's
   unpack (a table of +-1 times the scale) computes the same products. */
static float SGN[256][8] __attribute__((aligned(32)));
__attribute__((constructor)) static void sgn_init(void) {
  for (int b = 0; b < 256; b++)
    for (int k = 0; k < 8; k++) SGN[b][k] = (b >> (7 - k)) & 1 ? 1.0f : -1.0f;
}

/* m over 8 elements at i: sum_r SGN * w_r in rank order, then + e */
static inline void server8(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                           int64_t j, const float* e, float* m) {
  const float* t = SGN[bits[0]];
  float w0 = weight(w, wr, wj, 0, j);
  for (int k = 0; k < 8; k++) m[k] = t[k] * w0;
  for (int r = 1; r < W; r++) {
    const float* tr = SGN[bits[r * stride]];
    float wv = weight(w, wr, wj, r, j);
    for (int k = 0; k < 8; k++) m[k] = m[k] + tr[k] * wv;
  }
  for (int k = 0; k < 8; k++) m[k] = m[k] + e[k];
}

static void server_c(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                     const float* e, uint8_t* out, double* sums, int64_t n, int64_t block) {
  for (int64_t j = 0; j < n / block; j++) {
    double s8[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    for (int64_t i = j * block; i < (j + 1) * block; i += 8) {
      float m[8];
      server8(bits + i / 8, stride, W, w, wr, wj, j, e + i, m);
      int b = 0;
      for (int k = 0; k < 8; k++) b |= (!(m[k] < 0.0f)) << (7 - k);
      for (int k = 0; k < 8; k++) s8[k] += (double)m[k] * (double)m[k];
      out[i / 8] = (uint8_t)b;
    }
    sums[j] = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
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

ONEBIT_AVX512
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
  enum { RUN = 4096 };
  server_fn f = pick_server(isa);
  double total;
  ONEBIT_THREAD_SUM(total, n, 8, threads, {
    double r;
    for (int64_t i = a; i < b; i += RUN) {
      int64_t len = b - i < RUN ? b - i : RUN;
      f(bits + i / 8, stride, W, w, 1, 0, e + i, out + i / 8, &r, len, len);
      s += r;
    }
  });
  return total;
}

/* ---- decompress: the deferred worker error (e = z - copysign(ws, z + 0), z = out + e), then the
   decode (out = +-1 * s); one pass. Scales by runs of 8: s[(i / block) * sstep] for element i. */

static void decompress_c(const uint8_t* bits, const float* s, int64_t sstep, float* out, float* e, const float* ws,
                         int64_t wstep, int64_t n, int64_t block) {
  for (int64_t i = 0, j = 0, rem = 0; i < n; i += 8, rem += 8) {
    if (rem == block) { rem = 0; j++; } /* j = i / block, without a division per 8 elements */
    if (e) {
      float w = ws[j * wstep];
      for (int k = 0; k < 8; k++) {
        float z = out[i + k] + e[i + k];
        e[i + k] = z - copysignf(w, z + 0.0f);
      }
    }
    float sc = s[j * sstep];
    const float* t = SGN[bits[i / 8]];
    for (int k = 0; k < 8; k++) out[i + k] = t[k] * sc;
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
ONEBIT_AVX512
static inline __m512 halves(const float* v, int64_t step, int64_t j0, int64_t j1) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(v[j0 * step]), _mm512_set1_ps(v[j1 * step]));
}

ONEBIT_AVX512
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

ONEBIT_AVX512
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


static decompress_fn pick_decompress(int isa) {
#ifdef ONEBIT_X86
  if (isa >= 2) return decompress_avx512;
  if (isa == 1) return decompress_avx2;
#endif
  return decompress_c;
}

/* elements [0, n) (a multiple of 8); e NULL: the decode only. One scale (sstep and wstep 0): the
   threads split runs of 16 elements; else each thread takes whole blocks. */
void onebit_decompress(const uint8_t* bits, const float* s, int64_t sstep, float* out, float* e, const float* ws,
                       int64_t wstep, int64_t n, int64_t block, int isa, int threads) {
  decompress_fn f = pick_decompress(isa);
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

/* ---- the worker's error update alone (worker_compress with update_error; the collective defers it
   into decompress): e = z - copysign(s, z + 0), z = x + e, the scale s[(i / block) * sstep]. */
#define ERROR_LOOP for (int64_t i = 0; i < n; i++) { float z = x[i] + e[i]; e[i] = z - copysignf(sc, z + 0.0f); }
#define ERROR_ARGS const float* restrict x, float* restrict e, float sc, int64_t n
ONEBIT_VARIANTS(error, (ERROR_ARGS), ERROR_LOOP)

void onebit_error_update(const float* x, float* e, const float* s, int64_t sstep, int64_t n, int64_t block, int isa,
                         int threads) {
  void (*f)(ERROR_ARGS) = ONEBIT_PICK(error, isa);
  #pragma omp parallel num_threads(threads)
  {
    int64_t a, b;
    thread_range(n, sstep ? block : 16, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
    for (int64_t i = a; i < b;) { /* a run of one scale: to the end of its block (or of the range) */
      int64_t j = sstep ? i / block : 0, end = sstep ? (j + 1) * block : b;
      f(x + i, e + i, s[j * sstep], (end < b ? end : b) - i);
      i = end < b ? end : b;
    }
  }
}

/* ---- the server's error pass: m again from the bits and e (as its first pass), then
   e = m - copysign(scale, m + 0), the scale s[(i / block) * sstep]. */
static void server_update_c(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                            float* e, const float* s, int64_t sstep, int64_t n, int64_t block) {
  for (int64_t i = 0, j = 0, rem = 0; i < n; i += 8, rem += 8) {
    if (rem == block) { rem = 0; j++; }
    float m[8], sc = s[j * sstep];
    server8(bits + i / 8, stride, W, w, wr, wj, j, e + i, m);
    for (int k = 0; k < 8; k++) e[i + k] = m[k] - copysignf(sc, m[k] + 0.0f);
  }
}

#ifdef ONEBIT_X86
/* AVX2: 8 elements at a time in element order (the signs through REV, as server_avx2 reads them) */
__attribute__((target("avx2,fma")))
static void server_update_avx2(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wr, int64_t wj,
                               float* e, const float* s, int64_t sstep, int64_t n, int64_t block) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 sign = _mm256_set1_ps(-0.0f), mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0, j = 0, rem = 0; i < n; i += 8, rem += 8) {
    if (rem == block) { rem = 0; j++; }
    __m256 m = zero;
    for (int r = 0; r < W; r++) {
      __m256i bit = _mm256_and_si256(_mm256_set1_epi32(REV[bits[r * stride + i / 8]]), lane);
      __m256 on = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, lane));
      __m256 wv = _mm256_set1_ps(w[r * wr + j * wj]);
      __m256 v = _mm256_blendv_ps(_mm256_xor_ps(wv, sign), wv, on);
      m = r == 0 ? v : _mm256_add_ps(m, v);
    }
    m = _mm256_add_ps(m, _mm256_loadu_ps(e + i));
    __m256 c = _mm256_or_ps(_mm256_and_ps(_mm256_set1_ps(s[j * sstep]), mag), _mm256_andnot_ps(mag, _mm256_add_ps(m, zero)));
    _mm256_storeu_ps(e + i, _mm256_sub_ps(m, c));
  }
}

ONEBIT_AVX512
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

ONEBIT_AVX512
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

static server_update_fn pick_server_update(int isa) {
#ifdef ONEBIT_X86
  if (isa >= 2) return server_update_avx512;
  if (isa == 1) return server_update_avx2;
#endif
  return server_update_c;
}

/* w: [W] (wj 0) or [W, n / block] (wj 1); s: one scale (sstep 0) or one per block (sstep 1). */
void onebit_server_update(const uint8_t* bits, int64_t stride, int W, const float* w, int64_t wj, float* e,
                          const float* s, int64_t sstep, int64_t n, int64_t block, int isa, int threads) {
  server_update_fn f = pick_server_update(isa);
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
/* the weights w_r = s_r * (float)(1 / W) of the W received scales (rank r's at s[r * sstride]); whether all are
   finite (onebit_server_reduce_one and its bfloat16 twin) */
static int server_weights(const float* s, int64_t sstride, int W, float* w) {
  const float inv = (float)(1.0 / W);
  int finite = 1;
  for (int r = 0; r < W; r++) {
    float sr = s[r * sstride];
    finite = finite && isfinite(sr);
    w[r] = sr * inv;
  }
  return finite;
}

int onebit_server_reduce_one(const uint8_t* bits, int64_t stride, int W, const float* s, int64_t sstride, float* e,
                             uint8_t* out, float* scale, int64_t n, int isa, int threads) {
  float w[W];
  int finite = server_weights(s, sstride, W, w);
  double total = onebit_server_total(bits, stride, W, w, e, out, n, isa, threads);
  float sc = (float)sqrt(total / (double)n);
  int ran = finite && isfinite(sc);
  *scale = ran ? sc : NAN;
  if (ran) onebit_server_update(bits, stride, W, w, 0, e, scale, 0, n, n, isa, threads);
  return ran;
}

/* ---- The float64 sum of squares of n float32s (any n): exact squares, float64 adds; threads sum
   contiguous ranges, added in thread order. */
static double sumsq_c(const float* x, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
  return s;
}

#ifdef ONEBIT_X86
ONEBIT_AVX512
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
  double total;
  ONEBIT_THREAD_SUM(total, n, 16, threads, { if (b > a) s = sq_any(isa, x + a, b - a); });
  return total;
}

