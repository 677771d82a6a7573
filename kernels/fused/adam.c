#include "../native/native.h"

/* ---- OnebitAdam's compression stage with its element-wise maths inside the codec's passes (as
   onebit.optimizers._fused does on a GPU). A bucket's table: tensor k covers flat elements
   [start[k], start[k] + count[k]); its gradient (0: a zero gradient), frozen variance v and
   parameter at the addresses g[k], d[k], p[k]; its float32 scalars sc[SC k ..]: b1, 1 - b1, decay
   (1 - lr * wd), -lr, bc1, then its stale denominator's floor, r, eps (native.h's den_run: d from v).
   The maths and its order are onebit.kernels.cpu_fused's: u = u * b1 + (w * g) / d;
   p = p * decay + (-lr) * clamp(u / bc1). */
#define FOLD_LOOP if (g) { for (int64_t i = 0; i < n; i++) u[i] = u[i] * b1 + (w * g[i]) / d[i]; } \
                  else { for (int64_t i = 0; i < n; i++) u[i] = u[i] * b1; } /* no gradient: u.mul_(b1) only */
#define UPDATE_LOOP for (int64_t i = 0; i < n; i++) { float v = u[i] / bc1; v = v < lo ? lo : v; v = v > hi ? hi : v; p[i] = p[i] * decay + nlr * v; }

ONEBIT_VARIANTS(fold, (float* u, const float* g, const float* d, float b1, float w, int64_t n), FOLD_LOOP)
ONEBIT_VARIANTS(update, (float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n),
                UPDATE_LOOP)

/* the fold over flat elements [a, b), u pointing at element a's momentum */
static void fold_range(int isa, float* u, int64_t a, int64_t b, const table_t* t, int* k) {
  int64_t lo, hi;
  float d[DEN_RUN] __attribute__((aligned(64)));
  for (int kk = table_first(t->start, t->count, t->K, a, k); table_part(t->start, t->count, t->K, a, b, kk, &lo, &hi);
       kk++) {
    const float* sc = t->sc + SC * kk;
    float b1 = sc[0], w = sc[1];
    for (int64_t r = lo; r < hi; r += DEN_RUN) { /* run by run: the run's d from v */
      int64_t n = hi - r < DEN_RUN ? hi - r : DEN_RUN, o = r - t->start[kk];
      const float* g = t->g[kk] ? (const float*)t->g[kk] + o : 0;
      den_run(isa, d, var_of(t->d[kk], o), var_bf(t->d[kk]), sc, n);
      ONEBIT_PICK(fold, isa)(u + (r - a), g, d, b1, w, n);
    }
  }
}

/* the update over flat elements [a, b), u pointing at element a's decoded mean */
static void update_range(int isa, const float* u, int64_t a, int64_t b, const table_t* t, float lo_c, float hi_c,
                         int* k) {
  int64_t lo, hi;
  for (int kk = table_first(t->start, t->count, t->K, a, k); table_part(t->start, t->count, t->K, a, b, kk, &lo, &hi);
       kk++) {
    if (hi <= lo) continue;
    float* p = (float*)t->p[kk] + (lo - t->start[kk]);
    const float* sc = t->sc + SC * kk;
    ONEBIT_PICK(update, isa)(p, u + (lo - a), sc[2], sc[3], sc[4], lo_c, hi_c, hi - lo);
  }
}

#ifdef ONEBIT_X86
/* 16 decoded elements (a last 8: full 0) in registers, as decompress16 computes them */
ONEBIT_AVX512
static inline __m512 decode16(const uint8_t* bits, __m512 s, int full) {
  __mmask16 on = full ? load16(bits) : bits[0];
  return _mm512_mul_ps(wire(_mm512_mask_blend_ps(on, _mm512_set1_ps(-1.0f), _mm512_set1_ps(1.0f))), s);
}

/* The decoded values of a message whose scale is known take two values, sgn * s: a function of them
   computed once on +1.0 * s and -1.0 * s (the same operations as on each decoded lane: bitwise, NaNs
   included) and selected per element by its bit. unit: 1.0 read at run time (the compiler may not
   turn a multiplication by a constant -1.0 into a negation, which differs on a NaN's sign). */
static volatile float onebit_unit = 1.0f;

/* 16 elements' pos where their bit is set, neg where not (a last 8: full 0), in element order */
ONEBIT_AVX512
static inline __m512 select16(const uint8_t* bits, __m512 neg, __m512 pos, int full) {
  __mmask16 on = full ? load16(bits) : bits[0];
  return wire(_mm512_mask_blend_ps(on, neg, pos));
}

/* A run of n elements (a multiple of 8) inside one tensor with a gradient: the fold and the encode
   in one loop, the folded u stored and used from the register; bitwise den_run, fold_512 then
   blocks_avx512 over the run (the same operations, the same float64 accumulation order): d from v
   as den_fill computes it (max(floor, s) is s where s is NaN, and s for equal zeros: C's
   s < floor ? floor : s). old (not NULL): u is the decode of the old message's run (scale old_s),
   read in registers, the folded u not stored; e16 (not NULL): the error is bfloat16, widened in
   registers (e is then not read). */
ONEBIT_AVX512
static double fold_encode_run512(float* u, const float* g, const float* v, const uint16_t* v16, const float* e,
                                 const uint16_t* e16,
                                 const uint8_t* old, float old_s, uint8_t* bits, const float* sc, int64_t n) {
  const float b1 = sc[0], w = sc[1];
  const __m512 vb = _mm512_set1_ps(b1), vw = _mm512_set1_ps(w), vf = _mm512_set1_ps(sc[SC_FLOOR]),
               vr = _mm512_set1_ps(sc[SC_FLOOR + 1]), ve = _mm512_set1_ps(sc[SC_FLOOR + 2]),
               vold = _mm512_set1_ps(old_s);
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 vv = v16 ? widen16(v16 + i) : _mm512_loadu_ps(v + i);
    __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_max_ps(vf, _mm512_sqrt_ps(vv)), vr), ve);
    __m512 x = _mm512_add_ps(_mm512_mul_ps(old ? decode16(old + i / 8, vold, 1) : _mm512_loadu_ps(u + i), vb),
                             _mm512_div_ps(_mm512_mul_ps(vw, _mm512_loadu_ps(g + i)), d));
    if (!old) _mm512_storeu_ps(u + i, x);
    __m512 z = _mm512_add_ps(x, e16 ? widen16(e16 + i) : _mm512_loadu_ps(e + i));
    __mmask16 m = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_NLT_UQ);
    bits[i / 8] = REV[m & 255];
    bits[i / 8 + 1] = REV[m >> 8];
    sq512(z, &a0, &a1);
  }
  if (i < n) { /* the last 8 */
    float d[8], uo[16] __attribute__((aligned(64))), eo[8];
    float* ut = u + i;
    if (old) { /* their old values decoded */
      _mm512_store_ps(uo, decode16(old + i / 8, vold, 0));
      ut = uo;
    }
    if (v16) den_fill_any(0, d, v16 + i, 1, sc[SC_FLOOR], sc[SC_FLOOR + 1], sc[SC_FLOOR + 2], n - i);
    else den_fill_c(d, v + i, sc[SC_FLOOR], sc[SC_FLOOR + 1], sc[SC_FLOOR + 2], n - i);
    for (int64_t k = 0; k < n - i; k++) ut[k] = ut[k] * b1 + (w * g[i + k]) / d[k];
    const float* et = e + i;
    if (e16) {
      for (int64_t k = 0; k < n - i; k++) { uint32_t x = (uint32_t)e16[i + k] << 16; memcpy(eo + k, &x, 4); }
      et = eo;
    }
    __m512 z = _mm512_maskz_add_ps(0xFF, _mm512_maskz_loadu_ps(0xFF, ut), _mm512_maskz_loadu_ps(0xFF, et));
    __mmask16 m = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_NLT_UQ);
    bits[i / 8] = REV[m & 255];
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(z));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}

/* AVX2 + FMA: 8 decoded elements (decompress_avx2's arithmetic) */
__attribute__((target("avx2,fma")))
static inline __m256 decode8(const uint8_t* bits, __m256 s) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i bit = _mm256_and_si256(_mm256_set1_epi32(REV[bits[0]]), lane);
  __m256 on = _mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, lane));
  return _mm256_mul_ps(_mm256_blendv_ps(_mm256_set1_ps(-1.0f), _mm256_set1_ps(1.0f), on), s);
}

/* 8 elements' pos where their bit is set, neg where not (decompress_avx2's bit test) */
__attribute__((target("avx2,fma")))
static inline __m256 select8(const uint8_t* bits, __m256 neg, __m256 pos) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i bit = _mm256_and_si256(_mm256_set1_epi32(REV[bits[0]]), lane);
  return _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, lane)));
}

/* fold_encode_run512 in AVX2 + FMA, 8 at a time: bitwise den_run, fold_256 then blocks_avx2 over the run */
__attribute__((target("avx2,fma")))
static double fold_encode_run256(float* u, const float* g, const float* v, const uint16_t* v16, const float* e,
                                 const uint16_t* e16,
                                 const uint8_t* old, float old_s, uint8_t* bits, const float* sc, int64_t n) {
  const __m256 vb = _mm256_set1_ps(sc[0]), vw = _mm256_set1_ps(sc[1]), vf = _mm256_set1_ps(sc[SC_FLOOR]),
               vr = _mm256_set1_ps(sc[SC_FLOOR + 1]), ve = _mm256_set1_ps(sc[SC_FLOOR + 2]),
               vold = _mm256_set1_ps(old_s);
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (int64_t i = 0; i < n; i += 8) {
    __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_max_ps(vf, _mm256_sqrt_ps(v16 ? widen8(v16 + i) : _mm256_loadu_ps(v + i))), vr), ve);
    __m256 x = _mm256_add_ps(_mm256_mul_ps(old ? decode8(old + i / 8, vold) : _mm256_loadu_ps(u + i), vb),
                             _mm256_div_ps(_mm256_mul_ps(vw, _mm256_loadu_ps(g + i)), d));
    if (!old) _mm256_storeu_ps(u + i, x);
    __m256 z = _mm256_add_ps(x, e16 ? widen8(e16 + i) : _mm256_loadu_ps(e + i));
    bits[i / 8] = REV[_mm256_movemask_ps(_mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_NLT_UQ))];
    sq256(z, &a0, &a1);
  }
  return hsum256(a0, a1);
}

/* fold_decompress_update_run512 in AVX2 + FMA, 8 at a time (decompress_avx2's and update_256's
   arithmetic) */
__attribute__((target("avx2,fma")))
static void fold_decompress_update_run256(const uint8_t* old_bits, float old_s, const float* g, const float* v,
                                          const uint16_t* v16,
                                          float* e, uint16_t* e16, uint32_t key, uint32_t i0, const uint8_t* bits,
                                          float s, float ws, float* p, const float* sc, float lo_c, float hi_c,
                                          int64_t n) {
  const __m256 vb = _mm256_set1_ps(sc[0]), vw = _mm256_set1_ps(sc[1]), vdecay = _mm256_set1_ps(sc[2]),
               vnlr = _mm256_set1_ps(sc[3]), vbc1 = _mm256_set1_ps(sc[4]), vf = _mm256_set1_ps(sc[SC_FLOOR]),
               vr = _mm256_set1_ps(sc[SC_FLOOR + 1]), ve = _mm256_set1_ps(sc[SC_FLOOR + 2]),
               vlo = _mm256_set1_ps(lo_c), vhi = _mm256_set1_ps(hi_c), vold = _mm256_set1_ps(old_s),
               vs = _mm256_set1_ps(s), vws = _mm256_set1_ps(ws), zero = _mm256_setzero_ps(),
               mag = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const float one = onebit_unit; /* as in fold_decompress_update_run512 */
  const __m256 up = _mm256_set1_ps(one), un = _mm256_set1_ps(-one);
  const __m256 oldp = _mm256_mul_ps(_mm256_mul_ps(up, vold), vb), oldn = _mm256_mul_ps(_mm256_mul_ps(un, vold), vb);
  const __m256 stepp = _mm256_mul_ps(vnlr, _mm256_min_ps(vhi, _mm256_max_ps(vlo, _mm256_div_ps(_mm256_mul_ps(up, vs), vbc1)))),
               stepn = _mm256_mul_ps(vnlr, _mm256_min_ps(vhi, _mm256_max_ps(vlo, _mm256_div_ps(_mm256_mul_ps(un, vs), vbc1))));
  for (int64_t i = 0; i < n; i += 8) {
    __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_max_ps(vf, _mm256_sqrt_ps(v16 ? widen8(v16 + i) : _mm256_loadu_ps(v + i))), vr), ve);
    __m256 x = _mm256_add_ps(select8(old_bits + i / 8, oldn, oldp),
                             _mm256_div_ps(_mm256_mul_ps(vw, _mm256_loadu_ps(g + i)), d));
    if (e || e16) {
      __m256 z = _mm256_add_ps(x, e16 ? widen8(e16 + i) : _mm256_loadu_ps(e + i));
      __m256 c = _mm256_or_ps(_mm256_and_ps(vws, mag), _mm256_andnot_ps(mag, _mm256_add_ps(z, zero)));
      if (e16)
        narrow8(e16 + i, _mm256_sub_ps(z, c), _mm256_set1_epi32((int)(key + (i0 + (uint32_t)i) * ROUND_GOLDEN)));
      else
        _mm256_storeu_ps(e + i, _mm256_sub_ps(z, c));
    }
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), vdecay), select8(bits + i / 8, stepn, stepp)));
  }
}

/* the table's tensor holding all of [a, b), with a gradient, or -1 (k: the cursor, as fold_range's) */
static int one_tensor(int64_t a, int64_t b, const table_t* t, int* k) {
  table_first(t->start, t->count, t->K, a, k);
  if (*k < t->K && t->start[*k] <= a && b <= t->start[*k] + t->count[*k] && t->g[*k]) return *k;
  return -1;
}

/* The decompress pass's run of n elements (a multiple of 8) inside one tensor with a gradient, the
   momentum kept as a message, in one loop and in registers: the worker's u folded again from the old
   message (its decode, then fold_encode_run512's arithmetic), decompress16's error update on it (z =
   u + e, e = z - ws sgn(z), where e is not NULL), the new message's decode (the mean) and update_512's
   p = p * decay + (-lr) clamp(mean / bc1): bitwise the run's decode, fold_range, decompress and
   update_range (clamp: max(lo, x) is x < lo ? lo : x, NaN and equal zeros included; min(hi, x)
   likewise). Whole 16s unmasked, a last 8 masked (see wire). */
ONEBIT_AVX512
static void fold_decompress_update_run512(const uint8_t* old_bits, float old_s, const float* g, const float* v,
                                          const uint16_t* v16,
                                          float* e, uint16_t* e16, uint32_t key, uint32_t i0, const uint8_t* bits,
                                          float s, float ws, float* p, const float* sc, float lo_c, float hi_c,
                                          int64_t n) {
  const __m512 vb = _mm512_set1_ps(sc[0]), vw = _mm512_set1_ps(sc[1]), vdecay = _mm512_set1_ps(sc[2]),
               vnlr = _mm512_set1_ps(sc[3]), vbc1 = _mm512_set1_ps(sc[4]), vf = _mm512_set1_ps(sc[SC_FLOOR]),
               vr = _mm512_set1_ps(sc[SC_FLOOR + 1]), ve = _mm512_set1_ps(sc[SC_FLOOR + 2]),
               vlo = _mm512_set1_ps(lo_c), vhi = _mm512_set1_ps(hi_c), vold = _mm512_set1_ps(old_s),
               vs = _mm512_set1_ps(s), vws = _mm512_set1_ps(ws), zero = _mm512_setzero_ps();
  const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF);
  const float one = onebit_unit;
  const __m512 up = _mm512_set1_ps(one), un = _mm512_set1_ps(-one);
  /* the old decode times b1, and the update's -lr clamp(mean / bc1), for sgn = +1 and -1 */
  const __m512 oldp = _mm512_mul_ps(_mm512_mul_ps(up, vold), vb), oldn = _mm512_mul_ps(_mm512_mul_ps(un, vold), vb);
  const __m512 stepp = _mm512_mul_ps(vnlr, _mm512_min_ps(vhi, _mm512_max_ps(vlo, _mm512_div_ps(_mm512_mul_ps(up, vs), vbc1)))),
               stepn = _mm512_mul_ps(vnlr, _mm512_min_ps(vhi, _mm512_max_ps(vlo, _mm512_div_ps(_mm512_mul_ps(un, vs), vbc1))));
#define ONEBIT_FDU_BODY(LOAD, STORE, FULL)                                                                   \
  {                                                                                                          \
    __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_max_ps(vf, _mm512_sqrt_ps(v16 ? WIDEN(v16 + i) : LOAD(v + i))), \
                                           vr), ve);                                                          \
    __m512 x = _mm512_add_ps(select16(old_bits + i / 8, oldn, oldp, FULL),                                  \
                             _mm512_div_ps(_mm512_mul_ps(vw, LOAD(g + i)), d));                               \
    if (e || e16) {                                                                                          \
      __m512 z = _mm512_add_ps(x, e16 ? WIDEN(e16 + i) : LOAD(e + i));                                       \
      __m512i zz = _mm512_castps_si512(_mm512_add_ps(z, zero));                                              \
      __m512 c = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(mag, _mm512_castps_si512(vws), zz, 0xCA));    \
      if (e16)                                                                                               \
        NARROW(e16 + i, narrow16(_mm512_sub_ps(z, c),                                                        \
                                 _mm512_set1_epi32((int)(key + (i0 + (uint32_t)i) * ROUND_GOLDEN))));        \
      else                                                                                                   \
        STORE(e + i, _mm512_sub_ps(z, c));                                                                   \
    }                                                                                                        \
    STORE(p + i, _mm512_add_ps(_mm512_mul_ps(LOAD(p + i), vdecay), select16(bits + i / 8, stepn, stepp, FULL))); \
  }
#define ONEBIT_LOAD_ALL(a) _mm512_loadu_ps(a)
#define ONEBIT_STORE_ALL(a, x) _mm512_storeu_ps(a, x)
#define ONEBIT_LOAD_8(a) _mm512_maskz_loadu_ps(0xFF, a)
#define ONEBIT_STORE_8(a, x) _mm512_mask_storeu_ps(a, 0xFF, x)
#define WIDEN(a) widen16(a)
#define NARROW(a, x) _mm256_storeu_si256((__m256i*)(a), _mm512_cvtepi32_epi16(x))
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) ONEBIT_FDU_BODY(ONEBIT_LOAD_ALL, ONEBIT_STORE_ALL, 1)
#undef WIDEN
#undef NARROW
#define WIDEN(a) /* 8: 16 bytes */                                                                         \
  _mm512_castsi512_ps(_mm512_slli_epi32(                                                                     \
      _mm512_cvtepu16_epi32(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(a)))), 16))
#define NARROW(a, x) _mm512_mask_cvtepi32_storeu_epi16(a, 0xFF, x)
  if (i < n) ONEBIT_FDU_BODY(ONEBIT_LOAD_8, ONEBIT_STORE_8, 0)
#undef WIDEN
#undef NARROW
#undef ONEBIT_FDU_BODY
#undef ONEBIT_LOAD_ALL
#undef ONEBIT_STORE_ALL
#undef ONEBIT_LOAD_8
#undef ONEBIT_STORE_8
}
#endif



/* The worker pass of all W chunks of a bucket in one parallel region (optimizers/_fused_cpu.py), the
   fold inside: run by run of 4096 elements, the gradients folded into the momentum u = u * b1 +
   (w * g) / d, then u + e encoded (bits, float64 sum of squares) while in cache. Chunk j covers flat
   elements [j C, j C + n_enc[j]) encoded into bits + j stride, its fold (the chunk's padded data
   tail) up to j C + n_fold[j]; sums[j] its float64 total: each thread's runs in order, the threads'
   partial sums in thread order (chunk_part: one thread below 65536 elements, as cpu_simd._threads),
   so a chunk's sum does not depend on the other chunks. part: the caller's W * threads doubles.
   flat NULL: the momentum is kept as the last message (old_bits + j old_stride, old_scales[j]),
   each run decoded from it as it is read and folded on the stack; the pass then writes nothing but
   the message and the padded rests' folded data (8 floats per chunk, into tails): the decompress
   pass folds again (onebit_decompress_update_all), so the pass can run before the ranks agree on the
   gradients and be dropped. e bfloat16 (ebf16): each run widened on the stack. */
void onebit_fold_encode_all(float* flat, const float* e, uint8_t* bits, int64_t stride, int64_t C, int W,
                            const int64_t* n_enc, const int64_t* n_fold, double* sums, double* part,
                            const int64_t* start, const int64_t* count, const int64_t* g, const int64_t* d,
                            const float* sc, int K, const uint8_t* old_bits, int64_t old_stride,
                            const float* old_scales, float* tails, int ebf16, int isa, int threads) {
  enum { RUN = 4096 };
  table_t tab = {start, count, g, d, 0, sc, K};
  blocks_fn f = pick(isa);
  decompress_fn dec = pick_decompress(isa);
  const int P = threads;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads(), k = 0;
    float ub[RUN] __attribute__((aligned(64))), eb[RUN] __attribute__((aligned(64)));
    if (t == 0) used = T;
    for (int j = 0; j < W; j++) {
      int64_t off = j * C, lo, hi;
      if (!chunk_part(n_enc[j], t, T, &lo, &hi)) continue;
      double acc = 0.0, r;
      k = 0;
      for (int64_t i = lo; i < hi; i += RUN) {
        int64_t len = hi - i < RUN ? hi - i : RUN;
        float* u = flat ? flat + off + i : ub;
        const float* er = e + off + i;
#ifdef ONEBIT_X86
        int kk = isa >= 1 ? one_tensor(off + i, off + i + len, &tab, &k) : -1;
        if (kk >= 0) { /* one loop (fold_encode_run512 or 256), the old message and a bfloat16 error read in it */
          int64_t o = off + i - tab.start[kk];
          r = (isa >= 2 ? fold_encode_run512 : fold_encode_run256)(
              u, (const float*)tab.g[kk] + o, var_bf(tab.d[kk]) ? 0 : (const float*)var_of(tab.d[kk], o),
              var_bf(tab.d[kk]) ? (const uint16_t*)var_of(tab.d[kk], o) : 0, er, ebf16 ? (const uint16_t*)e + off + i : 0,
              flat ? 0 : old_bits + j * old_stride + i / 8, flat ? 0.0f : old_scales[j], bits + j * stride + i / 8,
              tab.sc + SC * kk, len);
          acc += r;
          continue;
        }
#endif
        if (ebf16) { /* widened on the stack */
          widen_run(isa, eb, (const uint16_t*)e + off + i, len);
          er = eb;
        }
        if (!flat) dec(old_bits + j * old_stride + i / 8, old_scales + j, 0, ub, 0, 0, 0, len, len);
        fold_range(isa, u, off + i, off + i + len, &tab, &k);
        f(u, er, bits + j * stride + i / 8, &r, len, len);
        acc += r;
      }
      part[(size_t)j * P + t] = acc;
    }
  }
  for (int j = 0; j < W; j++) {
    int k = 0;
    if (n_fold[j] <= n_enc[j]) continue;
    float* u = flat ? flat + j * C + n_enc[j] : tails + 8 * j;
    if (!flat) { /* the padded rest's data (fewer than 8 elements): its old values from the message */
      float byte[8];
      dec(old_bits + j * old_stride + n_enc[j] / 8, old_scales + j, 0, byte, 0, 0, 0, 8, 8);
      for (int64_t q = 0; q < n_fold[j] - n_enc[j]; q++) u[q] = byte[q];
    }
    fold_range(isa, u, j * C + n_enc[j], j * C + n_fold[j], &tab, &k);
  }
  chunk_sums(n_enc, W, part, P, used, sums);
}

/* The decompress pass of all W chunks of a bucket in one parallel region, the update inside: run by
   run, the decode (with the deferred worker error where e is not NULL), then the parameters the run
   covers updated. Chunk j's elements [j C, j C + n[j]) from bits + j stride, scale s[j], worker
   scale ws[j]; e bfloat16 (ebf16): each run widened on the stack, its new error stored rounded
   (onebit.kernels.rounding). flat NULL: the momentum is kept as the last message (old_bits + j
   old_stride, old_scales[j]): each run's worker u folded again from it (fold_range: the worker
   pass's u, bitwise) into a run buffer, then the same decode as over a flat run (z = u + e, e = z -
   ws sgn(z) where update, the decoded mean over u), the update reading it. update (with flat NULL):
   whether the error is updated (every scale finite); e NULL (with flat): no error update. */
void onebit_decompress_update_all(const uint8_t* bits, int64_t stride, const float* s, float* flat, float* e,
                                  const float* ws, int64_t C, int W, const int64_t* n, const int64_t* start,
                                  const int64_t* count, const int64_t* g, const int64_t* d, const int64_t* p,
                                  const float* sc, int K, float lo_c, float hi_c, const uint8_t* old_bits,
                                  int64_t old_stride, const float* old_scales, int update, int ebf16, int isa,
                                  int threads) {
  enum { RUN = 4096 };
  table_t tab = {start, count, g, d, p, sc, K};
  decompress_fn f = pick_decompress(isa);
  void (*nr) NARROW_ARGS = ONEBIT_PICK(narrow, isa);
  if (!flat && !update) e = 0;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    float ub[RUN] __attribute__((aligned(64))), eb[RUN] __attribute__((aligned(64)));
    for (int j = 0; j < W; j++) {
      int k = 0, kf = 0;
      int64_t off = j * C, units = n[j] / 16, lo = units * t / T * 16, hi = t == T - 1 ? n[j] : units * (t + 1) / T * 16;
      for (int64_t i = lo; i < hi; i += RUN) {
        int64_t len = hi - i < RUN ? hi - i : RUN;
        uint16_t* e16 = ebf16 && e ? (uint16_t*)e + off + i : 0;
        float* u = flat ? flat + off + i : ub;
#ifdef ONEBIT_X86
        int kk = !flat && isa >= 1 ? one_tensor(off + i, off + i + len, &tab, &kf) : -1;
        if (kk >= 0) { /* one loop (fold_decompress_update_run512 or 256) */
          int64_t o = off + i - tab.start[kk];
          (isa >= 2 ? fold_decompress_update_run512 : fold_decompress_update_run256)(old_bits + j * old_stride + i / 8, old_scales[j], (const float*)tab.g[kk] + o,
                                        var_bf(tab.d[kk]) ? 0 : (const float*)var_of(tab.d[kk], o),
                                        var_bf(tab.d[kk]) ? (const uint16_t*)var_of(tab.d[kk], o) : 0,
                                        e16 ? 0 : e ? e + off + i : 0, e16,
                                        e16 ? round_key(ws[j], ROUND_WORKER) : 0, (uint32_t)(off + i),
                                        bits + j * stride + i / 8, s[j], e ? ws[j] : 0.0f, (float*)tab.p[kk] + o,
                                        tab.sc + SC * kk, lo_c, hi_c, len);
          continue;
        }
#endif
        if (!flat) { /* the worker's u again: the old message's decode, folded */
          f(old_bits + j * old_stride + i / 8, old_scales + j, 0, ub, 0, 0, 0, len, len);
          fold_range(isa, ub, off + i, off + i + len, &tab, &kf);
        }
        float* er = e16 ? eb : e ? e + off + i : 0;
        if (e16) widen_run(isa, eb, e16, len);
        f(bits + j * stride + i / 8, s + j, 0, u, er, e ? ws + j : 0, 0, len, len);
        if (e16) nr(e16, (const uint32_t*)eb, round_key(ws[j], ROUND_WORKER), (uint32_t)(off + i), len);
        update_range(isa, u, off + i, off + i + len, &tab, lo_c, hi_c, &k);
      }
    }
  }
}

/* The update alone over flat elements [a, b) (a chunk's tail, decoded by the caller), u pointing at
   element a's decoded mean. */
void onebit_update(const float* u, int64_t a, int64_t b, const int64_t* start, const int64_t* count, const int64_t* p,
                   const float* sc, int K, float lo_c, float hi_c, int isa) {
  table_t tab = {start, count, 0, 0, p, sc, K};
  int k = 0;
  update_range(isa, u, a, b, &tab, lo_c, hi_c, &k);
}

/* ---- The per-tensor passes of OnebitAdam's unfused compression step (where the fused passes above
   decline: masks, block scales, a mesh, overlap; onebit.kernels.cpu_fused binds them): the fold
   u = u * b1 + (w * g) / d (fold_c's loop; d from the variance v, floor, r, eps: den_fill) and the update p = p * decay + (-lr) clamp(u / bc1)
   (update_c's loop), each one pass over a tensor. */
/* The stale denominators themselves, out = max(sqrt(v), floor) * r + eps (den_fill's loop): what the
   plain path reads where no pass computes them in place (onebit.kernels.preconditioning). */
void onebit_stale_denominator(float* out, const void* v, float floor, float r, float eps, int64_t n, int isa,
                              int threads, int vbf) {
  ONEBIT_PARALLEL(n, threads, den_fill_any(isa, out + a, var_at(v, vbf, a), vbf, floor, r, eps, len))
}

typedef void (*fold_fn)(float*, const float*, const float*, float, float, int64_t);

/* the fold over n elements, d from v run by run (dsc: floor, r, eps) */
static void fold_v(int isa, fold_fn f, float* u, const float* g, const void* v, int vbf, const float* dsc, float b1,
                   float w, int64_t n) {
  float d[DEN_RUN] __attribute__((aligned(64)));
  for (int64_t i = 0; i < n; i += DEN_RUN) {
    int64_t len = n - i < DEN_RUN ? n - i : DEN_RUN;
    den_fill_any(isa, d, var_at(v, vbf, i), vbf, dsc[0], dsc[1], dsc[2], len);
    f(u + i, g + i, d, b1, w, len);
  }
}

void onebit_fold(float* u, const float* g, const void* v, float floor, float r, float eps, float b1, float w,
                 int64_t n, int isa, int threads, int vbf) {
  fold_fn f = ONEBIT_PICK(fold, isa);
  const float dsc[3] = {floor, r, eps};
  ONEBIT_PARALLEL(n, threads, fold_v(isa, f, u + a, g + a, var_at(v, vbf, a), vbf, dsc, b1, w, len))
}

void onebit_stale_update(float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n,
                         int isa, int threads) {
  void (*f)(float*, const float*, float, float, float, float, float, int64_t) = ONEBIT_PICK(update, isa);
  ONEBIT_PARALLEL(n, threads, f(p + a, u + a, decay, nlr, bc1, lo, hi, len))
}
