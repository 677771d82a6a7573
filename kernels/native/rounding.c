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
