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

static void fold_c(float* u, const float* g, const float* d, float b1, float w, int64_t n) { FOLD_LOOP }
static void update_c(float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n) { UPDATE_LOOP }
#ifdef ONEBIT_X86
ONEBIT_AVX512 static void fold_512(float* u, const float* g, const float* d, float b1, float w, int64_t n) { FOLD_LOOP }
ONEBIT_AVX512 static void update_512(float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n) { UPDATE_LOOP }
__attribute__((target("avx2,fma"))) static void fold_256(float* u, const float* g, const float* d, float b1, float w, int64_t n) { FOLD_LOOP }
__attribute__((target("avx2,fma"))) static void update_256(float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n) { UPDATE_LOOP }
#endif


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
      den_run(isa, d, (const float*)t->d[kk] + o, sc, n);
#ifdef ONEBIT_X86
      if (isa >= 2) { fold_512(u + (r - a), g, d, b1, w, n); continue; }
      if (isa == 1) { fold_256(u + (r - a), g, d, b1, w, n); continue; }
#endif
      fold_c(u + (r - a), g, d, b1, w, n);
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
#ifdef ONEBIT_X86
    if (isa >= 2) { update_512(p, u + (lo - a), sc[2], sc[3], sc[4], lo_c, hi_c, hi - lo); continue; }
    if (isa == 1) { update_256(p, u + (lo - a), sc[2], sc[3], sc[4], lo_c, hi_c, hi - lo); continue; }
#endif
    update_c(p, u + (lo - a), sc[2], sc[3], sc[4], lo_c, hi_c, hi - lo);
  }
}

#ifdef ONEBIT_X86
/* A run of n elements (a multiple of 8) inside one tensor with a gradient: the fold and the encode
   in one loop, the folded u stored and used from the register; bitwise den_run, fold_512 then
   blocks_avx512 over the run (the same operations, the same float64 accumulation order): d from v
   as den_fill computes it (max(floor, s) is s where s is NaN, and s for equal zeros: C's
   s < floor ? floor : s). keep_z: z = u + e stored over e where z is finite (the momentum kept as a
   message: onebit_decompress_update_all). */
ONEBIT_AVX512
static double fold_encode_run512(float* u, const float* g, const float* v, float* e, uint8_t* bits,
                                 const float* sc, int64_t n, int keep_z) {
  const float b1 = sc[0], w = sc[1];
  const __m512 vb = _mm512_set1_ps(b1), vw = _mm512_set1_ps(w), vf = _mm512_set1_ps(sc[SC_FLOOR]),
               vr = _mm512_set1_ps(sc[SC_FLOOR + 1]), ve = _mm512_set1_ps(sc[SC_FLOOR + 2]);
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_max_ps(vf, _mm512_sqrt_ps(_mm512_loadu_ps(v + i))), vr), ve);
    __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(u + i), vb),
                             _mm512_div_ps(_mm512_mul_ps(vw, _mm512_loadu_ps(g + i)), d));
    _mm512_storeu_ps(u + i, x);
    __m512 z = _mm512_add_ps(x, _mm512_loadu_ps(e + i));
    if (keep_z) /* where z - z == 0: z finite */
      _mm512_mask_storeu_ps(e + i, _mm512_cmp_ps_mask(_mm512_sub_ps(z, z), _mm512_setzero_ps(), _CMP_EQ_OQ), z);
    __mmask16 m = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_NLT_UQ);
    bits[i / 8] = REV[m & 255];
    bits[i / 8 + 1] = REV[m >> 8];
    sq512(z, &a0, &a1);
  }
  if (i < n) { /* the last 8 */
    float d[8];
    den_fill_c(d, v + i, sc[SC_FLOOR], sc[SC_FLOOR + 1], sc[SC_FLOOR + 2], n - i);
    for (int64_t k = i; k < n; k++) u[k] = u[k] * b1 + (w * g[k]) / d[k - i];
    __m512 z = _mm512_maskz_add_ps(0xFF, _mm512_maskz_loadu_ps(0xFF, u + i), _mm512_maskz_loadu_ps(0xFF, e + i));
    if (keep_z)
      _mm512_mask_storeu_ps(e + i, 0xFF & _mm512_cmp_ps_mask(_mm512_sub_ps(z, z), _mm512_setzero_ps(), _CMP_EQ_OQ),
                            z);
    __mmask16 m = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_NLT_UQ);
    bits[i / 8] = REV[m & 255];
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(z));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}

/* the table's tensor holding all of [a, b), with a gradient, or -1 (k: the cursor, as fold_range's) */
static int one_tensor(int64_t a, int64_t b, const table_t* t, int* k) {
  table_first(t->start, t->count, t->K, a, k);
  if (*k < t->K && t->start[*k] <= a && b <= t->start[*k] + t->count[*k] && t->g[*k]) return *k;
  return -1;
}
#endif



/* The worker pass of all W chunks of a bucket in one parallel region (optimizers/_fused_cpu.py), the
   fold inside: run by run of 4096 elements, the gradients folded into the momentum u = u * b1 +
   (w * g) / d, then u + e encoded (bits, float64 sum of squares) while in cache. Chunk j covers flat
   elements [j C, j C + n_enc[j]) encoded into bits + j stride, its fold (the chunk's padded data
   tail) up to j C + n_fold[j]; sums[j] its float64 total: each thread's runs in order, the threads'
   partial sums in thread order (chunk_part: one thread below 65536 elements, as cpu_simd._threads),
   so a chunk's sum does not depend on the other chunks. part: the caller's W * threads doubles. */
void onebit_fold_encode_all(float* flat, float* e, uint8_t* bits, int64_t stride, int64_t C, int W,
                            const int64_t* n_enc, const int64_t* n_fold, double* sums, double* part,
                            const int64_t* start, const int64_t* count, const int64_t* g, const int64_t* d,
                            const float* sc, int K, const uint8_t* old_bits, int64_t old_stride,
                            const float* old_scales, float* tails, int ebf16, float* zbuf, int isa, int threads) {
  enum { RUN = 4096 };
  table_t tab = {start, count, g, d, 0, sc, K};
  /* the momentum kept as a message: z = u + e kept for the decompress pass, over a float32 e, or in zbuf
     (float32, the bucket's N) beside a bfloat16 one; a float32 flat buffer: nothing kept */
  const int keep_z = !flat && (!ebf16 || zbuf);
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
        float* er = e + off + i;
        if (ebf16) { /* widened on the stack, or into zbuf where z is kept (stored over it) */
          er = keep_z ? zbuf + off + i : eb;
          widen_run(isa, er, (const uint16_t*)e + off + i, len);
        }
        if (!flat) dec(old_bits + j * old_stride + i / 8, old_scales + j, 0, ub, 0, 0, 0, len, len);
#ifdef ONEBIT_X86
        int kk = isa >= 2 ? one_tensor(off + i, off + i + len, &tab, &k) : -1;
        if (kk >= 0) { /* one loop (fold_encode_run512) */
          int64_t o = off + i - tab.start[kk];
          r = fold_encode_run512(u, (const float*)tab.g[kk] + o, (const float*)tab.d[kk] + o, er,
                                 bits + j * stride + i / 8, tab.sc + SC * kk, len, keep_z);
          acc += r;
          continue;
        }
#endif
        fold_range(isa, u, off + i, off + i + len, &tab, &k);
        f(u, er, bits + j * stride + i / 8, &r, len, len);
        if (keep_z) { /* z = u + e (the encode's) kept over e where finite: the decompress pass reads it */
          float* ez = er;
          for (int64_t q = 0; q < len; q++) { float z = u[q] + ez[q]; ez[q] = z - z == 0.0f ? z : ez[q]; }
        }
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
   scale ws[j]. flat NULL: the momentum is kept as the last message (old_bits + j old_stride,
   old_scales[j]) and the worker pass left z = u + e in e (onebit_fold_encode_all); the decoded mean
   goes to a run buffer the update reads. update: whether the error is updated (every scale finite):
   e = z - ws sgn(z), decompress's own arithmetic on z (out 0: 0 + z is z, the sign of a zero aside,
   which copysign(ws, z + 0) ignores); where not, e = z - u with u folded again from the message
   (the worker's u, bitwise): the error the float32 buffer's run keeps, to its last rounding, and
   exactly where z was not finite (the worker pass left e there; u is not finite there either,
   but for a u + e past float32's range). */
void onebit_decompress_update_all(const uint8_t* bits, int64_t stride, const float* s, float* flat, float* e,
                                  const float* ws, int64_t C, int W, const int64_t* n, const int64_t* start,
                                  const int64_t* count, const int64_t* g, const int64_t* d, const int64_t* p,
                                  const float* sc, int K, float lo_c, float hi_c, const uint8_t* old_bits,
                                  int64_t old_stride, const float* old_scales, int update, int ebf16, float* zbuf,
                                  int isa, int threads) {
  enum { RUN = 4096 };
  table_t tab = {start, count, g, d, p, sc, K};
  decompress_fn f = pick_decompress(isa);
  void (*nr) NARROW_ARGS = ONEBIT_PICK(narrow, isa);
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
        if (flat) {
          float* er = e16 ? eb : e ? e + off + i : 0;
          if (e16) widen_run(isa, eb, e16, len);
          f(bits + j * stride + i / 8, s + j, 0, flat + off + i, er, e ? ws + j : 0, 0, len, len);
          if (e16) nr(e16, (const uint32_t*)eb, round_key(ws[j], ROUND_WORKER), (uint32_t)(off + i), len);
          update_range(isa, flat + off + i, off + i, off + i + len, &tab, lo_c, hi_c, &k);
          continue;
        }
        if (e16) { /* the worker pass kept z in zbuf: e = z - ws sgn(z) there (as over a float32 e below),
                      stored rounded into bfloat16, then the decode; no update: e is left as it is */
          float* z = zbuf + off + i;
          memset(ub, 0, (size_t)len * sizeof(float));
          f(bits + j * stride + i / 8, s + j, 0, ub, update ? z : 0, update ? ws + j : 0, 0, len, len);
          if (update) nr(e16, (const uint32_t*)z, round_key(ws[j], ROUND_WORKER), (uint32_t)(off + i), len);
          update_range(isa, ub, off + i, off + i + len, &tab, lo_c, hi_c, &k);
          continue;
        }
        if (update) {
          memset(ub, 0, (size_t)len * sizeof(float));
        } else { /* e back from z: z - u */
          f(old_bits + j * old_stride + i / 8, old_scales + j, 0, ub, 0, 0, 0, len, len);
          fold_range(isa, ub, off + i, off + i + len, &tab, &kf);
          float* ez = e + off + i; /* where u is not finite, z was not: e was kept */
          for (int64_t q = 0; q < len; q++) ez[q] = ub[q] - ub[q] == 0.0f ? ez[q] - ub[q] : ez[q];
        }
        f(bits + j * stride + i / 8, s + j, 0, ub, update ? e + off + i : 0, update ? ws + j : 0, 0, len, len);
        update_range(isa, ub, off + i, off + i + len, &tab, lo_c, hi_c, &k);
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
void onebit_stale_denominator(float* out, const float* v, float floor, float r, float eps, int64_t n, int isa,
                              int threads) {
  void (*f) DEN_ARGS = ONEBIT_PICK(den_fill, isa);
  ONEBIT_PARALLEL(n, threads, f(out + a, v + a, floor, r, eps, len))
}

typedef void (*fold_fn)(float*, const float*, const float*, float, float, int64_t);

/* the fold over n elements, d from v run by run (dsc: floor, r, eps) */
static void fold_v(int isa, fold_fn f, float* u, const float* g, const float* v, const float* dsc, float b1, float w,
                   int64_t n) {
  float d[DEN_RUN] __attribute__((aligned(64)));
  for (int64_t i = 0; i < n; i += DEN_RUN) {
    int64_t len = n - i < DEN_RUN ? n - i : DEN_RUN;
    ONEBIT_PICK(den_fill, isa)(d, v + i, dsc[0], dsc[1], dsc[2], len);
    f(u + i, g + i, d, b1, w, len);
  }
}

void onebit_fold(float* u, const float* g, const float* v, float floor, float r, float eps, float b1, float w,
                 int64_t n, int isa, int threads) {
  fold_fn f = fold_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = fold_512;
  else if (isa == 1) f = fold_256;
#endif
  const float dsc[3] = {floor, r, eps};
  ONEBIT_PARALLEL(n, threads, fold_v(isa, f, u + a, g + a, v + a, dsc, b1, w, len))
}

void onebit_stale_update(float* p, const float* u, float decay, float nlr, float bc1, float lo, float hi, int64_t n,
                         int isa, int threads) {
  void (*f)(float*, const float*, float, float, float, float, float, int64_t) = update_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = update_512;
  else if (isa == 1) f = update_256;
#endif
  ONEBIT_PARALLEL(n, threads, f(p + a, u + a, decay, nlr, bc1, lo, hi, len))
}
