/* Error buffers in bfloat16: the stochastic rounding of a float32 buffer into a bfloat16 one (native.h's
   round_bf16), for the paths that keep the error in float32 during a call and store it after
   (onebit.kernels.rounding). */
#include "native.h"

#define NARROW_ARGS (uint16_t* restrict out, const uint32_t* restrict x, uint32_t key, uint32_t i0, int64_t n)
#define NARROW_LOOP for (int64_t i = 0; i < n; i++) out[i] = round_bf16(x[i], key, i0 + (uint32_t)i);
ONEBIT_VARIANTS(narrow, NARROW_ARGS, NARROW_LOOP)

/* the rounding of src[a, b) (one thread's part), cut into runs of one scale */
static void narrow_range(void (*f) NARROW_ARGS, uint16_t* out, const uint32_t* x, const float* s, int64_t a, int64_t b,
                         int64_t unit, uint32_t role) {
  for (int64_t i = a; i < b;) {
    int64_t j = i / unit, end = (j + 1) * unit < b ? (j + 1) * unit : b;
    f(out + i, x + i, round_key(s[j], role), (uint32_t)i, end - i);
    i = end;
  }
}

/* out[i] = the rounding of src[i], i in [0, n), with the key of scale s[i / unit] and role; the threads
   split runs of 16 elements. */
void onebit_narrow(uint16_t* out, const float* src, const float* s, int64_t n, int64_t unit, uint32_t role, int isa,
                   int threads) {
  void (*f) NARROW_ARGS = ONEBIT_PICK(narrow, isa);
  ONEBIT_PARALLEL(n, threads, narrow_range(f, out, (const uint32_t*)src, s, a, a + len, unit, role))
}

/* ---- The server's whole call with one scale per chunk on a bfloat16 error (onebit_server_reduce_one's
   contract, codec.c): each run of the error widened on the stack as the passes read it, the error pass's
   runs stored rounded with the new scale's key. The sums run by run as onebit_server_total's, so the
   bits and the scale are bitwise the float32 buffer's. */
#ifdef ONEBIT_X86
/* W rows' weighted signs of 16 elements in wire order (a last 8: full 0, element order), as server_avx512 and
   server_update16 add them: rows in order, -w by flipping w's sign bit */
ONEBIT_AVX512
static inline __m512 server_sum16(const uint8_t* bits, int64_t stride, int W, const float* w, int full) {
  const __m512i flip = _mm512_set1_epi32(INT32_MIN);
  __m512 m = _mm512_setzero_ps();
  for (int r = 0; r < W; r++) {
    __mmask16 on = full ? load16(bits + r * stride) : (__mmask16)REV[bits[r * stride]];
    __m512 wv = _mm512_set1_ps(w[r]);
    __m512 v = _mm512_mask_blend_ps(on, _mm512_castsi512_ps(_mm512_xor_epi32(_mm512_castps_si512(wv), flip)), wv);
    m = r == 0 ? v : _mm512_add_ps(m, v);
  }
  return m;
}

/* server_avx512 over a run of n elements (a multiple of 8) with one scale, its bfloat16 error widened in
   registers: the same bits and float64 sum as widen_run then server_avx512 (block n) */
ONEBIT_AVX512
static double server_run16(const uint8_t* bits, int64_t stride, int W, const float* w, const uint16_t* e,
                           uint8_t* out, int64_t n) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 m = _mm512_add_ps(server_sum16(bits + i / 8, stride, W, w, 1), wire(widen16(e + i)));
    store16(out + i / 8, _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_NLT_UQ));
    sq512(m, &a0, &a1);
  }
  if (i < n) { /* the last 8, in element order */
    float eb[8];
    for (int k = 0; k < 8; k++) { uint32_t x = (uint32_t)e[i + k] << 16; memcpy(eb + k, &x, 4); }
    __m512 m = _mm512_maskz_add_ps(0xFF, server_sum16(bits + i / 8, stride, W, w, 0), _mm512_maskz_loadu_ps(0xFF, eb));
    out[i / 8] = REV[_mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_NLT_UQ) & 255];
    sq512(m, &a0, &a1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}

/* server_update16's error update over a run with one scale (sv), the bfloat16 error widened and the new one
   rounded (key, element i0 + k's index) in registers: the same bits as widen_run, server_update_avx512 and
   the narrow pass */
ONEBIT_AVX512
static void server_update_run16(const uint8_t* bits, int64_t stride, int W, const float* w, uint16_t* e, float s,
                                uint32_t key, uint32_t i0, int64_t n) {
  const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512 sv = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 m = _mm512_add_ps(server_sum16(bits + i / 8, stride, W, w, 1), wire(widen16(e + i)));
    __m512i mm = _mm512_castps_si512(_mm512_add_ps(m, _mm512_setzero_ps()));
    __m512 r = _mm512_sub_ps(m, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(mag, _mm512_castps_si512(sv), mm, 0xCA)));
    __m512i q = narrow16(wire(r), _mm512_set1_epi32((int)(key + (i0 + (uint32_t)i) * ROUND_GOLDEN)));
    _mm256_storeu_si256((__m256i*)(e + i), _mm512_cvtepi32_epi16(q));
  }
  if (i < n) { /* the last 8, in element order */
    float eb[8];
    for (int k = 0; k < 8; k++) { uint32_t x = (uint32_t)e[i + k] << 16; memcpy(eb + k, &x, 4); }
    __m512 m = _mm512_add_ps(server_sum16(bits + i / 8, stride, W, w, 0), _mm512_maskz_loadu_ps(0xFF, eb));
    __m512i mm = _mm512_castps_si512(_mm512_add_ps(m, _mm512_setzero_ps()));
    __m512 r = _mm512_sub_ps(m, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(mag, _mm512_castps_si512(sv), mm, 0xCA)));
    __m512i q = narrow16(r, _mm512_set1_epi32((int)(key + (i0 + (uint32_t)i) * ROUND_GOLDEN)));
    _mm512_mask_cvtepi32_storeu_epi16(e + i, 0xFF, q);
  }
}
#endif

static double server_total16(const uint8_t* bits, int64_t stride, int W, const float* w, const uint16_t* e,
                             uint8_t* out, int64_t n, int isa, int threads) {
  enum { RUN = 4096 };
  server_fn f = pick_server(isa);
  double total;
  ONEBIT_THREAD_SUM(total, n, 8, threads, {
    double r;
    float eb[RUN] __attribute__((aligned(64)));
    for (int64_t i = a; i < b; i += RUN) {
      int64_t len = b - i < RUN ? b - i : RUN;
#ifdef ONEBIT_X86
      if (isa >= 2) { /* in registers */
        s += server_run16(bits + i / 8, stride, W, w, e + i, out + i / 8, len);
        continue;
      }
#endif
      widen_run(isa, eb, e + i, len);
      f(bits + i / 8, stride, W, w, 1, 0, eb, out + i / 8, &r, len, len);
      s += r;
    }
  });
  return total;
}

static void server_update_range16(int isa, server_update_fn f, void (*nr) NARROW_ARGS, const uint8_t* bits,
                                  int64_t stride, int W, const float* w, uint16_t* e, const float* scale, int64_t a,
                                  int64_t b) {
  enum { RUN = 4096 };
  float eb[RUN] __attribute__((aligned(64)));
  uint32_t key = round_key(*scale, ROUND_SERVER);
  for (int64_t i = a; i < b; i += RUN) {
    int64_t len = b - i < RUN ? b - i : RUN;
#ifdef ONEBIT_X86
    if (isa >= 2) { /* in registers */
      server_update_run16(bits + i / 8, stride, W, w, e + i, *scale, key, (uint32_t)i, len);
      continue;
    }
#endif
    widen_run(isa, eb, e + i, len);
    f(bits + i / 8, stride, W, w, 1, 0, eb, scale, 0, len, len);
    nr(e + i, (const uint32_t*)eb, key, (uint32_t)i, len);
  }
}

int onebit_server_reduce_one16(const uint8_t* bits, int64_t stride, int W, const float* s, int64_t sstride,
                               uint16_t* e, uint8_t* out, float* scale, int64_t n, int isa, int threads) {
  float w[W];
  int finite = server_weights(s, sstride, W, w);
  double total = server_total16(bits, stride, W, w, e, out, n, isa, threads);
  float sc = (float)sqrt(total / (double)n);
  int ran = finite && isfinite(sc);
  *scale = ran ? sc : NAN;
  if (!ran) return 0;
  server_update_fn f = pick_server_update(isa);
  void (*nr) NARROW_ARGS = ONEBIT_PICK(narrow, isa);
  ONEBIT_PARALLEL(n, threads, server_update_range16(isa, f, nr, bits, stride, W, w, e, scale, a, a + len))
  return 1;
}

/* ---- The worker's side on a bfloat16 error (the collective's encode, update_error off, and decompress
   with the deferred error), bitwise the widened buffer's: each run of at most ENC16_RUN elements
   widened on the stack as the codec's passes read it, and in decompress the run's new error stored
   rounded with its scale's key (onebit.kernels.rounding: element i keyed by the worker scale of its
   block, or of its chunk, and its index i0 + i in the whole buffer). Blocks of at most ENC16_RUN
   elements (the caller widens the buffer otherwise). */
#define ENC16_RUN 4096

/* BODY over each thread's runs of whole blocks of e (bfloat16, n elements, blocks of at most ENC16_RUN): j the
   run's first block, k its blocks, len = k block elements, nb the blocks in all; the run widened into eb first */
#define ONEBIT_BLOCK_RUNS16(n, block, threads, e, BODY) \
  do { \
    int64_t nb = (n) / (block), per_ = (block) < ENC16_RUN ? ENC16_RUN / (block) : 1; \
    _Pragma("omp parallel num_threads(threads)") \
    { \
      int t_ = omp_get_thread_num(), T_ = omp_get_num_threads(); \
      int64_t lo_ = nb * t_ / T_, hi_ = nb * (t_ + 1) / T_; \
      float eb[ENC16_RUN] __attribute__((aligned(64))); \
      for (int64_t j = lo_; j < hi_; j += per_) { \
        int64_t k = hi_ - j < per_ ? hi_ - j : per_, len = k * (block); \
        widen_run(isa, eb, (e) + j * (block), len); \
        BODY; \
      } \
    } \
  } while (0)

/* onebit_encode_total's sum: the same runs of 4096, so the same float64 total */
double onebit_encode_total16(const float* x, const uint16_t* e, uint8_t* bits, int64_t n, int isa, int threads) {
  blocks_fn f = pick(isa);
  double total;
  ONEBIT_THREAD_SUM(total, n, 8, threads, {
    double r;
    float eb[ENC16_RUN] __attribute__((aligned(64)));
    for (int64_t i = a; i < b; i += ENC16_RUN) {
      int64_t len = b - i < ENC16_RUN ? b - i : ENC16_RUN;
      widen_run(isa, eb, e + i, len);
      f(x + i, eb, bits + i / 8, &r, len, len);
      s += r;
    }
  });
  return total;
}

/* onebit_encode_blocks' sums: each block summed whole, in runs of whole blocks */
void onebit_encode_blocks16(const float* x, const uint16_t* e, uint8_t* bits, double* sums, int64_t n,
                            int64_t block, int isa, int threads) {
  blocks_fn f = pick(isa);
  ONEBIT_BLOCK_RUNS16(n, block, threads, e, f(x + j * block, eb, bits + j * block / 8, sums + j, len, block));
}

/* onebit_decompress with a bfloat16 error (not NULL): per thread as there, run by run */
void onebit_decompress16(const uint8_t* bits, const float* s, int64_t sstep, float* out, uint16_t* e, const float* ws,
                         int64_t wstep, int64_t n, int64_t block, int64_t i0, int isa, int threads) {
  decompress_fn f = pick_decompress(isa);
  void (*nr) NARROW_ARGS = ONEBIT_PICK(narrow, isa);
  int per_block = sstep != 0 || wstep != 0;
  int64_t unit = per_block ? block : 16, run = per_block ? (block < ENC16_RUN ? ENC16_RUN / block * block : block)
                                                         : ENC16_RUN;
  #pragma omp parallel num_threads(threads)
  {
    int64_t a, b;
    float eb[ENC16_RUN] __attribute__((aligned(64)));
    thread_range(n, unit, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
    for (int64_t i = a; i < b; i += run) {
      int64_t len = b - i < run ? b - i : run, j = per_block ? i / block : 0;
      widen_run(isa, eb, e + i, len);
      f(bits + i / 8, s + j * sstep, sstep, out + i, eb, ws + j * wstep, wstep, len, per_block ? block : len);
      int64_t one = per_block ? block : len; /* a run of one scale */
      for (int64_t q = 0; q < len; q += one) {
        int64_t jb = per_block ? (i + q) / block : 0, cnt = len - q < one ? len - q : one;
        nr(e + i + q, (const uint32_t*)eb + q, round_key(ws[jb * wstep], ROUND_WORKER), (uint32_t)(i0 + i + q), cnt);
      }
    }
  }
}

/* ---- The server's two passes with block scales on a bfloat16 error (onebit_server_blocks and
   onebit_server_update with w [W, n / block] and one scale per block), bitwise the widened buffer's: runs
   of whole blocks (at most ENC16_RUN elements, block at most that) widened on the stack; the error pass's
   runs stored rounded, each block with its new scale's key and the element's index in the buffer (i0: where
   e starts in it, a slice's offset). */
void onebit_server_blocks16(const uint8_t* bits, int64_t stride, int W, const float* w, const uint16_t* e,
                            uint8_t* out, double* sums, int64_t n, int64_t block, int isa, int threads) {
  server_fn f = pick_server(isa);
  ONEBIT_BLOCK_RUNS16(n, block, threads, e,
                      f(bits + j * block / 8, stride, W, w + j, nb, 1, eb, out + j * block / 8, sums + j, len, block));
}

void onebit_server_update16(const uint8_t* bits, int64_t stride, int W, const float* w, uint16_t* e,
                            const float* s, int64_t n, int64_t block, int64_t i0, int isa, int threads) {
  server_update_fn f = pick_server_update(isa);
  void (*nr) NARROW_ARGS = ONEBIT_PICK(narrow, isa);
  ONEBIT_BLOCK_RUNS16(n, block, threads, e, {
    f(bits + j * block / 8, stride, W, w + j, nb, 1, eb, s + j, 1, len, block);
    for (int64_t q = 0; q < k; q++)
      nr(e + (j + q) * block, (const uint32_t*)eb + q * block, round_key(s[j + q], ROUND_SERVER),
         (uint32_t)(i0 + (j + q) * block), block);
  });
}
