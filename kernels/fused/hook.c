#include "../native/native.h"

/* ---- The DDP hook's pre-pass with the local gradient norm inside: returns the float64 sum of g^2
   (g as it came), and writes g = (g + m * k) / d (the plain ops' order: c = m * k, g + c, a division). */
static double hook_pre_c(float* g, const float* m, const float* d, float k, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; i++) {
    s += (double)g[i] * (double)g[i];
    g[i] = (g[i] + m[i] * k) / d[i];
  }
  return s;
}

#ifdef ONEBIT_X86
ONEBIT_AVX512
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

/* ---- The DDP hook's passes (freeze_step) inside the codec's, as OnebitAdam's above: the table's
   entry k is a parameter with momentum, flat elements [start[k], start[k] + count[k]), its momentum
   at g[k], its factor at sc[SC k]; its denominators d from the address at d[k] (den_at): none (0: an
   SGD's or a Muon's momentum, d = 1), its frozen variance v (float32, or bfloat16 where bit 0 is set:
   native.h's var_of), from which each run of DEN_RUN computes d = max(sqrt(v), floor) * r + eps with
   the scalars at SC_FLOOR (native.h's den_run: bitwise the optimizer's stale_denominator; d is never
   stored), or, where sc[SC k + 1] is not 0, float32 denominators as they are (a checkpoint of a
   release that kept d). Elsewhere the bucket holds the gradient as it is. Before the encode, run by
   run: x = (g + m k) / d (hook_pre above) and the float64 sum of g^2 over every element (the local
   norm); after the decode: out = out * d - m k (the plain ops' order). */
ONEBIT_VARIANTS(post, (float* out, const float* m, const float* d, float k, int64_t n),
                for (int64_t i = 0; i < n; i++) out[i] = out[i] * d[i] - m[i] * k;)

/* entry kk's denominators of its elements [o, o + n), n <= DEN_RUN: in buf (made), or where they lie */
static const float* den_at(int isa, const table_t* t, int kk, int64_t o, int64_t n, float* buf) {
  const float* sc = t->sc + SC * kk;
  int64_t a = t->d[kk];
  if (!a) {
    for (int64_t i = 0; i < n; i++) buf[i] = 1.0f;
    return buf;
  }
  if (sc[1] != 0.0f) return (const float*)a + o;
  den_run(isa, buf, var_of(a, o), var_bf(a), sc, n);
  return buf;
}

/* flat elements [a, b): the pre-pass inside the table's entries, the sum of squares alone elsewhere */
static double pre_range(int isa, float* flat, int64_t a, int64_t b, const table_t* t, int* k) {
  double s = 0.0;
  int64_t pos = a, lo, hi;
  float buf[DEN_RUN] __attribute__((aligned(64)));
  for (int kk = table_first(t->start, t->count, t->K, a, k); table_part(t->start, t->count, t->K, a, b, kk, &lo, &hi);
       kk++) {
    if (hi <= lo) continue;
    if (lo > pos) s += sq_any(isa, flat + pos, lo - pos);
    float f = t->sc[SC * kk];
    for (int64_t r = lo; r < hi; r += DEN_RUN) {
      int64_t n = hi - r < DEN_RUN ? hi - r : DEN_RUN, o = r - t->start[kk];
      const float* d = den_at(isa, t, kk, o, n, buf);
      s += pre_any(isa, flat + r, (const float*)t->g[kk] + o, d, f, n);
    }
    pos = hi;
  }
  if (b > pos) s += sq_any(isa, flat + pos, b - pos);
  return s;
}

static void post_range(int isa, float* flat, int64_t a, int64_t b, const table_t* t, int* k) {
  int64_t lo, hi;
  float buf[DEN_RUN] __attribute__((aligned(64)));
  for (int kk = table_first(t->start, t->count, t->K, a, k); table_part(t->start, t->count, t->K, a, b, kk, &lo, &hi);
       kk++) {
    float f = t->sc[SC * kk];
    for (int64_t r = lo; r < hi; r += DEN_RUN) {
      int64_t n = hi - r < DEN_RUN ? hi - r : DEN_RUN, o = r - t->start[kk];
      const float* d = den_at(isa, t, kk, o, n, buf);
      ONEBIT_PICK(post, isa)(flat + r, (const float*)t->g[kk] + o, d, f, n);
    }
  }
}

/* runs of about 4096 elements, whole blocks */
static int64_t run_of(int64_t block) { return block ? (block < 4096 ? 4096 / block * block : block) : 4096; }

/* The worker's pass of chunk elements [off, off + n) with the pre-pass inside, run by run while in
   cache. block > 0: sums[j] for each block of the range (n a multiple of block), returns 0; block 0:
   returns the sum of squares, added as onebit_encode_total adds it. *sq: the sum of g^2 over the range.
   e bfloat16 (ebf16; block 0 or at most HOOK_RUN): each run widened (exactly) on the stack first. */
#define HOOK_RUN 4096
double onebit_hook_encode(float* flat, const float* e, uint8_t* bits, double* sums, int64_t off, int64_t n,
                          int64_t block, const int64_t* start, const int64_t* count, const int64_t* m,
                          const int64_t* d, const float* sc, int K, double* sq, int ebf16, int isa, int threads) {
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
    float eb[HOOK_RUN] __attribute__((aligned(64)));
    for (int64_t i = lo; i < hi; i += run) {
      int64_t len = hi - i < run ? hi - i : run;
      const float* er = e + off + i;
      if (ebf16) {
        widen_run(isa, eb, (const uint16_t*)e + off + i, len);
        er = eb;
      }
      q += pre_range(isa, flat, off + i, off + i + len, &tab, &k);
      if (block) f(flat + off + i, er, bits + i / 8, sums + i / block, len, block);
      else { f(flat + off + i, er, bits + i / 8, &r, len, len); s += r; }
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
   and wstep 0: one scale) with the post-pass inside, run by run. e bfloat16 (ebf16; block 0 or at
   most HOOK_RUN): each run widened on the stack, updated there and stored rounded
   (onebit.kernels.rounding: element i of the buffer keyed by its block's worker scale, or the range's
   one, and i). */
void onebit_hook_decompress(const uint8_t* bits, const float* s, int64_t sstep, float* flat, float* e, const float* ws,
                            int64_t wstep, int64_t off, int64_t n, int64_t block, const int64_t* start,
                            const int64_t* count, const int64_t* m, const int64_t* d, const float* sc, int K,
                            int ebf16, int isa, int threads) {
  table_t tab = {start, count, m, d, 0, sc, K};
  decompress_fn f = pick_decompress(isa);
  void (*nr) NARROW_ARGS = ONEBIT_PICK(narrow, isa);
  int64_t unit = block ? block : 16, run = run_of(block);
  if (!e) ebf16 = 0;
  #pragma omp parallel num_threads(threads)
  {
    int k = 0;
    int64_t lo, hi;
    float eb[HOOK_RUN] __attribute__((aligned(64)));
    thread_range(n, unit, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
    for (int64_t i = lo; i < hi; i += run) {
      int64_t len = hi - i < run ? hi - i : run, j = block ? i / block : 0;
      uint16_t* e16 = ebf16 ? (uint16_t*)e + off + i : 0;
      float* er = e16 ? eb : e ? e + off + i : 0;
      if (e16) widen_run(isa, eb, e16, len);
      f(bits + i / 8, s + j * sstep, sstep, flat + off + i, er, e ? ws + j * wstep : 0, wstep, len,
        block ? block : len);
      if (e16) { /* stored rounded, one key per scale */
        int64_t per = block ? block : len;
        for (int64_t q = 0; q < len; q += per) {
          int64_t jb = block ? (i + q) / block : 0, cnt = len - q < per ? len - q : per;
          nr(e16 + q, (const uint32_t*)eb + q, round_key(ws[jb * wstep], ROUND_WORKER), (uint32_t)(off + i + q), cnt);
        }
      }
      post_range(isa, flat, off + i, off + i + len, &tab, &k);
    }
  }
}

/* The two passes alone over flat elements [a, b), threaded (a chunk's padded tail, encoded or decoded by
   the caller; a whole bucket where the passes inside the codec decline: a mesh, a covered bucket). The
   sum of squares: each thread's in thread order. */
double onebit_hook_pre_range(float* flat, int64_t lo, int64_t hi, const int64_t* start, const int64_t* count,
                             const int64_t* m, const int64_t* d, const float* sc, int K, int isa, int threads) {
  table_t tab = {start, count, m, d, 0, sc, K};
  double total;
  ONEBIT_THREAD_SUM(total, hi - lo, 16, threads, {
    int k = 0;
    if (b > a) s = pre_range(isa, flat, lo + a, lo + b, &tab, &k);
  });
  return total;
}

void onebit_hook_post_range(float* flat, int64_t lo, int64_t hi, const int64_t* start, const int64_t* count,
                            const int64_t* m, const int64_t* d, const float* sc, int K, int isa, int threads) {
  table_t tab = {start, count, m, d, 0, sc, K};
  ONEBIT_PARALLEL(hi - lo, threads, {
    int k = 0;
    post_range(isa, flat, lo + a, lo + a + len, &tab, &k);
  })
}

/* ---- The hook's AdamW step on the frozen denominator (onebit.kernels.cpu_fused binds it):
   m = m b1 + w g, p = p decay + (-step m) / d, d from the frozen variance v as den_fill computes it
   (d = max(sqrt(v), floor) * r + eps: v is read, never written). */
#define FROZEN_ARGS (float* restrict p, float* restrict m, const float* restrict g, const float* restrict v, \
                     float b1, float w, float decay, float nstep, float floor, float r, float eps, int64_t n)
ONEBIT_VARIANTS(frozen, FROZEN_ARGS, for (int64_t i = 0; i < n; i++) {
  float s = sqrtf(v[i]);
  s = s < floor ? floor : s;
  float mn = m[i] * b1 + w * g[i];
  m[i] = mn;
  p[i] = p[i] * decay + (nstep * mn) / (s * r + eps);
})

void onebit_frozen_adam(float* p, float* m, const float* g, const float* v, float b1, float w, float decay,
                        float nstep, float floor, float r, float eps, int64_t n, int isa, int threads) {
  void (*f) FROZEN_ARGS = ONEBIT_PICK(frozen, isa);
  ONEBIT_PARALLEL(n, threads, f(p + a, m + a, g + a, v + a, b1, w, decay, nstep, floor, r, eps, len))
}
