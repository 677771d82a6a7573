/* OnebitLamb's count sketch with a hashed index (docs/ALGORITHMS.md 6.3; kernels/sketch.py): element i
   adds into sums[fmix32(key + i * 0x9E3779B9) mod buckets], in element order (the plain path's bits). The
   hash of a run of elements first (vectorised), then the adds. */
#include "native.h"

#define SKETCH_ARGS (uint32_t* restrict out, uint32_t key, uint32_t i0, uint32_t mask, int64_t n)
#define SKETCH_LOOP for (int64_t i = 0; i < n; i++) out[i] = fmix32(key + (i0 + (uint32_t)i) * ROUND_GOLDEN) & mask;
ONEBIT_VARIANTS(sketch_hash, SKETCH_ARGS, SKETCH_LOOP)

/* sums[0, buckets) += the sketch of x[0, n); buckets a power of two (2k) */
void onebit_count_sketch(const float* x, int64_t n, uint32_t key, int64_t buckets, float* sums, int isa) {
  enum { RUN = 1024 };
  uint32_t h[RUN] __attribute__((aligned(64)));
  void (*f) SKETCH_ARGS = ONEBIT_PICK(sketch_hash, isa);
  for (int64_t a = 0; a < n; a += RUN) {
    int64_t len = n - a < RUN ? n - a : RUN;
    f(h, key, (uint32_t)a, (uint32_t)(buckets - 1), len);
    for (int64_t i = 0; i < len; i++) sums[h[i]] += x[a + i];
  }
}
