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
