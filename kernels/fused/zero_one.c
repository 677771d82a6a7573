#include "../native/native.h"

/* ---- ZeroOneAdam's phase-1 compressed step with its element-wise maths inside the codec's passes
   (kernels/fused/zero_one.py binds them). The table's address columns grad (sync_params when
   synchronising), var (the frozen variance v), param, momentum; the scalars b1, 1 - b1, wd, -lr, nl,
   then the stale denominator's floor, r, eps per tensor (d from v run by run: native.h's den_run). The unfused
   step's order: x = g / d (0 without a gradient) into the accumulator; its compressed mean;
   m = fma((1 - b1) * mean, d, m * b1) (docs/ALGORITHMS.md 6.4: torch's addcmul_ where it fuses, the
   Triton kernels' tl.fma); p = p + (-lr) * clamp(m / d) (+ wd * p inside the bracket with weight decay;
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
ONEBIT_VARIANTS(zoa_div, (ZOA_DIV_ARGS), ZOA_DIV_LOOP)
ONEBIT_VARIANTS(zoa_step, (ZOA_STEP_ARGS), ZOA_STEP_LOOP)
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
ONEBIT_VARIANTS(zos_diff, (ZOS_DIFF_ARGS), ZOS_DIFF_LOOP)
ONEBIT_VARIANTS(zos_sync, (ZOS_SYNC_ARGS), ZOS_SYNC_LOOP)

/* sync: phase 2's synchronisation, g[k] then the address of tensor k's sync_params (sc[SC k + 4]: nl);
   d[k]: tensor k's frozen variance */
typedef struct { const int64_t *start, *count, *g, *d, *m, *p; const float* sc; int K, sync; } zoa_t;

/* table tensor kk's part of flat elements [a, b): [lo, hi) (empty where hi <= lo), its offset o there
   and its gradient g (0: none) and variance d at that offset; 0 past [a, b) */
typedef struct { int64_t lo, hi, o; const float* g; const void* d; int vbf; } seg_t;
static int zoa_seg(const zoa_t* t, int64_t a, int64_t b, int kk, seg_t* s) {
  if (!table_part(t->start, t->count, t->K, a, b, kk, &s->lo, &s->hi)) return 0;
  s->o = s->lo - t->start[kk];
  s->g = t->g[kk] ? (const float*)t->g[kk] + s->o : 0;
  s->d = var_of(t->d[kk], s->o); /* (bit 0 of the address: bfloat16, native.h) */
  s->vbf = var_bf(t->d[kk]);
  return 1;
}

/* the first tensor that can overlap [a, ...): the cursor k moved past those that end before a */
static int zoa_first(const zoa_t* t, int64_t a, int* k) { return table_first(t->start, t->count, t->K, a, k); }

/* x over flat elements [a, b) into x[0, b - a) */
static void zoa_div_range(int isa, float* x, int64_t a, int64_t b, const zoa_t* t, int* k) {
  seg_t s;
  float d[DEN_RUN] __attribute__((aligned(64)));
  for (int kk = zoa_first(t, a, k); zoa_seg(t, a, b, kk, &s); kk++) {
    if (s.hi <= s.lo) continue;
    if (t->sync) { /* x = p - sync_params */
      ONEBIT_PICK(zos_diff, isa)(x + (s.lo - a), (const float*)t->p[kk] + s.o, s.g, s.hi - s.lo);
      continue;
    }
    for (int64_t r = 0; r < s.hi - s.lo; r += DEN_RUN) { /* run by run: the run's d from v */
      int64_t n = s.hi - s.lo - r < DEN_RUN ? s.hi - s.lo - r : DEN_RUN;
      const float* g = s.g ? s.g + r : 0;
      if (g) den_run(isa, d, var_at(s.d, s.vbf, r), s.vbf, t->sc + SC * kk, n);
      ONEBIT_PICK(zoa_div, isa)(x + (s.lo - a) + r, g, d, n);
    }
  }
}

/* the error, momentum and parameter updates over flat elements [a, b), mean[0, b - a) the decoded
   mean (e: the worker error of element a on, NULL: not updated) */
static void zoa_step_range(int isa, const float* mean, float* e, float ws, int64_t a, int64_t b, const zoa_t* t,
                           float lo_c, float hi_c, int* k) {
  seg_t s;
  float d[DEN_RUN] __attribute__((aligned(64)));
  for (int kk = zoa_first(t, a, k); zoa_seg(t, a, b, kk, &s); kk++) {
    const float* sc = t->sc + SC * kk;
    for (int64_t r = s.lo; r < s.hi; r += DEN_RUN) { /* run by run: the run's d from v */
      int64_t n = s.hi - r < DEN_RUN ? s.hi - r : DEN_RUN, o = r - s.lo;
      float *m = (float*)t->m[kk] + s.o + o, *p = (float*)t->p[kk] + s.o + o, *ee = e ? e + (r - a) : 0;
      const float *mv = mean + (r - a), *g = s.g ? s.g + o : 0;
      den_run(isa, d, var_at(s.d, s.vbf, o), s.vbf, sc, n);
      if (t->sync) {
        ONEBIT_PICK(zos_sync, isa)(mv, d, ee, ws, m, (float*)t->g[kk] + s.o + o, p, sc[4], n);
        continue;
      }
      ONEBIT_PICK(zoa_step, isa)(mv, g, d, ee, ws, m, p, sc[0], sc[1], sc[2], sc[3], lo_c, hi_c, n);
    }
  }
}

/* The worker pass of every chunk of a bucket (as onebit_fold_encode_all, the same thread split and
   sums): chunk j's [j C, j C + n_enc[j]) encoded from x + e run by run (x in a scratch run), and x
   written into flat over [j C + n_enc[j], j C + n_fold[j]) (the padded rest's data, for the caller's
   plain encode). ebf16: the error is bfloat16, each run widened on the stack (exact). */
void onebit_zoa_encode_all(float* flat, const void* e, uint8_t* bits, int64_t stride, int64_t C, int W,
                           const int64_t* n_enc, const int64_t* n_fold, double* sums, double* part,
                           const int64_t* start, const int64_t* count, const int64_t* g, const int64_t* d,
                           const int64_t* p, const float* sc, int K, int sync, int ebf16, int isa, int threads) {
  enum { RUN = 4096 };
  zoa_t tab = {start, count, g, d, 0, p, sc, K, sync};
  blocks_fn f = pick(isa);
  const int P = threads;
  int used = 1;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads(), k = 0;
    float x[RUN] __attribute__((aligned(64))), eb[RUN] __attribute__((aligned(64)));
    if (t == 0) used = T;
    for (int j = 0; j < W; j++) {
      int64_t off = j * C, lo, hi;
      if (!chunk_part(n_enc[j], t, T, &lo, &hi)) continue;
      double acc = 0.0, r;
      k = 0;
      for (int64_t i = lo; i < hi; i += RUN) {
        int64_t len = hi - i < RUN ? hi - i : RUN;
        zoa_div_range(isa, x, off + i, off + i + len, &tab, &k);
        const float* er = (const float*)e + off + i;
        if (ebf16) {
          widen_run(isa, eb, (const uint16_t*)e + off + i, len);
          er = eb;
        }
        f(x, er, bits + j * stride + i / 8, &r, len, len);
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
   parameter updates. ebf16: the error is bfloat16, each run widened on the stack and its new error
   stored rounded (onebit.kernels.rounding, the worker's role, keyed by ws[j]): bitwise what widening
   the whole buffer and storing it after the call gives. */
void onebit_zoa_step_all(const uint8_t* bits, int64_t stride, const float* s, void* e, const float* ws, int64_t C,
                         int W, const int64_t* n, const int64_t* start, const int64_t* count, const int64_t* g,
                         const int64_t* d, const int64_t* m, const int64_t* p, const float* sc, int K, float lo_c,
                         float hi_c, int sync, int ebf16, int isa, int threads) {
  enum { RUN = 4096 };
  zoa_t tab = {start, count, g, d, m, p, sc, K, sync};
  decompress_fn f = pick_decompress(isa);
  void (*nr) NARROW_ARGS = ONEBIT_PICK(narrow, isa);
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    float mean[RUN] __attribute__((aligned(64))), eb[RUN] __attribute__((aligned(64)));
    for (int j = 0; j < W; j++) {
      int k = 0;
      int64_t off = j * C, units = n[j] / 16, lo = units * t / T * 16, hi = t == T - 1 ? n[j] : units * (t + 1) / T * 16;
      for (int64_t i = lo; i < hi; i += RUN) {
        int64_t len = hi - i < RUN ? hi - i : RUN;
        uint16_t* e16 = ebf16 && e ? (uint16_t*)e + off + i : 0;
        float* er = e16 ? eb : e ? (float*)e + off + i : 0;
        if (e16) widen_run(isa, eb, e16, len);
        f(bits + j * stride + i / 8, s + j, 0, mean, 0, 0, 0, len, len);
        zoa_step_range(isa, mean, er, e ? ws[j] : 0.0f, off + i, off + i + len, &tab, lo_c, hi_c, &k);
        if (e16) nr(e16, (const uint32_t*)eb, round_key(ws[j], ROUND_WORKER), (uint32_t)(off + i), len);
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

/* ---- The per-tensor passes of ZeroOneAdam's unfused steps (onebit.kernels.cpu_fused binds them): the
   step on a stale variance p = p + (-lr) (clamp(m / d) [+ wd p]), and phase 2's local step, which
   first folds m = m * b1 + w * g. Each op rounded, in this order (the plain ops' order; their
   p.add_(x, alpha) may fuse its multiply-add: tests/test_cpu_fused.py bounds the difference). */
#define STALE_V float v = m[i] / d[i]; v = v < lo ? lo : v; v = v > hi ? hi : v;
#define STALE_ARGS (float* restrict p, const float* restrict m, const float* restrict d, float lo, float hi, float wd, \
                    float nlr, int64_t n)
#define LOCAL_ARGS (float* restrict p, float* restrict m, const float* restrict g, const float* restrict d, float b1, \
                    float w, float lo, float hi, float wd, float nlr, int64_t n)
ONEBIT_VARIANTS(stale, STALE_ARGS, for (int64_t i = 0; i < n; i++) { STALE_V p[i] = p[i] + nlr * v; })
ONEBIT_VARIANTS(stale_wd, STALE_ARGS, for (int64_t i = 0; i < n; i++) { STALE_V p[i] = p[i] + nlr * (v + wd * p[i]); })
ONEBIT_VARIANTS(local, LOCAL_ARGS,
                for (int64_t i = 0; i < n; i++) { m[i] = m[i] * b1 + w * g[i]; STALE_V p[i] = p[i] + nlr * v; })
ONEBIT_VARIANTS(local_wd, LOCAL_ARGS,
                for (int64_t i = 0; i < n; i++) { m[i] = m[i] * b1 + w * g[i]; STALE_V p[i] = p[i] + nlr * (v + wd * p[i]); })

/* the step over n elements, d from v run by run (dsc: floor, r, eps); g NULL: the stale step */
static void zoa_v(int isa, void (*stale_f) STALE_ARGS, void (*local_f) LOCAL_ARGS, float* p, float* m, const float* g,
                  const void* v, int vbf, const float* dsc, float b1, float w, float lo, float hi, float wd,
                  float nlr, int64_t n) {
  float d[DEN_RUN] __attribute__((aligned(64)));
  for (int64_t i = 0; i < n; i += DEN_RUN) {
    int64_t len = n - i < DEN_RUN ? n - i : DEN_RUN;
    den_fill_any(isa, d, var_at(v, vbf, i), vbf, dsc[0], dsc[1], dsc[2], len);
    if (g) local_f(p + i, m + i, g + i, d, b1, w, lo, hi, wd, nlr, len);
    else stale_f(p + i, m + i, d, lo, hi, wd, nlr, len);
  }
}

/* wd 0: the step without its term (the plain ops add nothing: 0 * inf would be NaN); d from the
   variance v (floor, r, eps: den_fill) */
void onebit_stale_step(float* p, const float* m, const void* v, float floor, float r, float eps, float lo, float hi,
                       float wd, float nlr, int64_t n, int isa, int threads, int vbf) {
  void (*f) STALE_ARGS = wd != 0.0f ? ONEBIT_PICK(stale_wd, isa) : ONEBIT_PICK(stale, isa);
  const float dsc[3] = {floor, r, eps};
  ONEBIT_PARALLEL(n, threads, zoa_v(isa, f, 0, p + a, (float*)m + a, 0, var_at(v, vbf, a), vbf, dsc, 0.0f, 0.0f, lo, hi, wd, nlr, len))
}

void onebit_local_step(float* p, float* m, const float* g, const void* v, float floor, float r, float eps, float b1,
                       float w, float lo, float hi, float wd, float nlr, int64_t n, int isa, int threads, int vbf) {
  void (*f) LOCAL_ARGS = wd != 0.0f ? ONEBIT_PICK(local_wd, isa) : ONEBIT_PICK(local, isa);
  const float dsc[3] = {floor, r, eps};
  ONEBIT_PARALLEL(n, threads, zoa_v(isa, 0, f, p + a, m + a, g + a, var_at(v, vbf, a), vbf, dsc, b1, w, lo, hi, wd, nlr, len))
}

/* ZeroOneAdam's momentum made again at rest after a synchronisation (optimizers/zero_one_adam.py _wake):
   m = (u * d) / nl, u the sync's decoded mean, d from v (den_fill) in the pass: the sync's own operations
   (zoa_step_all's m = mean d / nl), each rounded. */
#define ZOA_MOM_ARGS (float* restrict m, const float* restrict u, const float* restrict d, float nl, int64_t n)
ONEBIT_VARIANTS(zoa_mom, ZOA_MOM_ARGS, for (int64_t i = 0; i < n; i++) m[i] = (u[i] * d[i]) / nl;)

static void zoa_mom_v(int isa, float* m, const float* u, const void* v, int vbf, const float* dsc, float nl, int64_t n) {
  float d[DEN_RUN] __attribute__((aligned(64)));
  for (int64_t i = 0; i < n; i += DEN_RUN) {
    int64_t len = n - i < DEN_RUN ? n - i : DEN_RUN;
    den_fill_any(isa, d, var_at(v, vbf, i), vbf, dsc[0], dsc[1], dsc[2], len);
    ONEBIT_PICK(zoa_mom, isa)(m + i, u + i, d, nl, len);
  }
}

void onebit_zoa_momentum(float* m, const float* u, const void* v, float floor, float r, float eps, float nl, int64_t n,
                         int isa, int threads, int vbf) {
  const float dsc[3] = {floor, r, eps};
  ONEBIT_PARALLEL(n, threads, zoa_mom_v(isa, m + a, u + a, var_at(v, vbf, a), vbf, dsc, nl, len))
}
