#include "../native/native.h"

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

double onebit_hook_pre(float* g, const float* m, const float* d, float k, int64_t n, int isa, int threads) {
  double total;
  ONEBIT_THREAD_SUM(total, n, 16, threads, { if (b > a) s = pre_any(isa, g + a, m + a, d + a, k, b - a); });
  return total;
}

/* ---- The DDP hook's passes (freeze_step) inside the codec's, as OnebitAdam's above: the table's
   entry k is a parameter with momentum, flat elements [start[k], start[k] + count[k]), its momentum
   at g[k], its frozen denominators at d[k], its factor at sc[SC k]; elsewhere the bucket holds the
   gradient as it is. Before the encode, run by run: x = (g + m k) / d (hook_pre above) and the
   float64 sum of g^2 over every element (the local norm); after the decode: out = out * d - m k
   (onebit.kernels.cpu_fused.hook_post's order). */
#define POST_LOOP for (int64_t i = 0; i < n; i++) out[i] = out[i] * d[i] - m[i] * k;
static void post_c(float* out, const float* m, const float* d, float k, int64_t n) { POST_LOOP }
#ifdef ONEBIT_X86
ONEBIT_AVX512 static void post_512(float* out, const float* m, const float* d, float k, int64_t n) { POST_LOOP }
__attribute__((target("avx2,fma"))) static void post_256(float* out, const float* m, const float* d, float k, int64_t n) { POST_LOOP }
#endif

/* flat elements [a, b): the pre-pass inside the table's entries, the sum of squares alone elsewhere */
static double pre_range(int isa, float* flat, int64_t a, int64_t b, const table_t* t, int* k) {
  double s = 0.0;
  int64_t pos = a, lo, hi;
  for (int kk = table_first(t->start, t->count, t->K, a, k); table_part(t->start, t->count, t->K, a, b, kk, &lo, &hi);
       kk++) {
    if (hi <= lo) continue;
    if (lo > pos) s += sq_any(isa, flat + pos, lo - pos);
    int64_t o = lo - t->start[kk];
    float* g = flat + lo;
    const float *m = (const float*)t->g[kk] + o, *d = (const float*)t->d[kk] + o;
    s += pre_any(isa, g, m, d, t->sc[SC * kk], hi - lo);
    pos = hi;
  }
  if (b > pos) s += sq_any(isa, flat + pos, b - pos);
  return s;
}

static void post_range(int isa, float* flat, int64_t a, int64_t b, const table_t* t, int* k) {
  int64_t lo, hi;
  for (int kk = table_first(t->start, t->count, t->K, a, k); table_part(t->start, t->count, t->K, a, b, kk, &lo, &hi);
       kk++) {
    if (hi <= lo) continue;
    int64_t o = lo - t->start[kk];
    const float *m = (const float*)t->g[kk] + o, *d = (const float*)t->d[kk] + o;
    float f = t->sc[SC * kk];
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
   returns the sum of squares, added as onebit_encode_total adds it. *sq: the sum of g^2 over the range. */
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
  decompress_fn f = pick_decompress(isa);
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

/* ---- The hook's per-parameter passes where its passes inside the codec decline (a mesh, a bucket
   covered by remembered ones; onebit.kernels.cpu_fused binds them): g = (g + m k) / d before the
   collective, out = out d - m k after it (post_c's loop); and the AdamW step on the frozen
   denominator: m = m b1 + w g, p = p decay + (-step m) / d, d from the frozen variance v as den_fill
   computes it (d = max(sqrt(v), floor) * r + eps: v is read, never written). */
#define FROZEN_ARGS (float* restrict p, float* restrict m, const float* restrict g, const float* restrict v, \
                     float b1, float w, float decay, float nstep, float floor, float r, float eps, int64_t n)
ONEBIT_VARIANTS(pre_only, (float* restrict g, const float* restrict m, const float* restrict d, float k, int64_t n),
                for (int64_t i = 0; i < n; i++) g[i] = (g[i] + m[i] * k) / d[i];)
ONEBIT_VARIANTS(frozen, FROZEN_ARGS, for (int64_t i = 0; i < n; i++) {
  float s = sqrtf(v[i]);
  s = s < floor ? floor : s;
  float mn = m[i] * b1 + w * g[i];
  m[i] = mn;
  p[i] = p[i] * decay + (nstep * mn) / (s * r + eps);
})

void onebit_hook_pre_only(float* g, const float* m, const float* d, float k, int64_t n, int isa, int threads) {
  void (*f)(float* restrict, const float* restrict, const float* restrict, float, int64_t) = ONEBIT_PICK(pre_only, isa);
  ONEBIT_PARALLEL(n, threads, f(g + a, m + a, d + a, k, len))
}

void onebit_hook_post(float* out, const float* m, const float* d, float k, int64_t n, int isa, int threads) {
  void (*f)(float*, const float*, const float*, float, int64_t) = post_c;
#ifdef ONEBIT_X86
  if (isa >= 2) f = post_512;
  else if (isa == 1) f = post_256;
#endif
  ONEBIT_PARALLEL(n, threads, f(out + a, m + a, d + a, k, len))
}

void onebit_frozen_adam(float* p, float* m, const float* g, const float* v, float b1, float w, float decay,
                        float nstep, float floor, float r, float eps, int64_t n, int isa, int threads) {
  void (*f) FROZEN_ARGS = ONEBIT_PICK(frozen, isa);
  ONEBIT_PARALLEL(n, threads, f(p + a, m + a, g + a, v + a, b1, w, decay, nstep, floor, r, eps, len))
}
