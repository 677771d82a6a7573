/* onebit's native CPU passes: what every .c file of the library shares. The .c files (this folder's
   codec.c, the .c files in ../fused) are compiled as ONE translation unit (onebit/kernels/native/build.py lists
   them in order), so a static function defined in one of them is seen by those after it; this header
   declares the ones the fused passes take from the codec. Lines up to 120 characters: the intrinsics'
   names are long. Every float operation is written out (-ffp-contract=off): the roundings are the
   plain torch path's, as docs/ALGORITHMS.md states them. */
#ifndef ONEBIT_NATIVE_H
#define ONEBIT_NATIVE_H

#include <stdint.h>
#include <math.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ONEBIT_X86 1
/* the AVX-512 level (onebit_best_isa's 2): AVX-512 F and BW, the compiler's loops on 512-bit vectors (gcc
   prefers 256 by default: the bfloat16 widening and rounding loops, on 16-bit words, need BW for zmm) */
#define ONEBIT_AVX512 __attribute__((target("avx512f,avx512bw,prefer-vector-width=512")))
#endif

/* bit i of b moved to bit 7 - i: a movemask puts element i in bit i, the wire wants it in 7 - i */
static const uint8_t REV[256] = {
  0, 128, 64, 192, 32, 160, 96, 224, 16, 144, 80, 208, 48, 176, 112, 240,
  8, 136, 72, 200, 40, 168, 104, 232, 24, 152, 88, 216, 56, 184, 120, 248,
  4, 132, 68, 196, 36, 164, 100, 228, 20, 148, 84, 212, 52, 180, 116, 244,
  12, 140, 76, 204, 44, 172, 108, 236, 28, 156, 92, 220, 60, 188, 124, 252,
  2, 130, 66, 194, 34, 162, 98, 226, 18, 146, 82, 210, 50, 178, 114, 242,
  10, 138, 74, 202, 42, 170, 106, 234, 26, 154, 90, 218, 58, 186, 122, 250,
  6, 134, 70, 198, 38, 166, 102, 230, 22, 150, 86, 214, 54, 182, 118, 246,
  14, 142, 78, 206, 46, 174, 110, 238, 30, 158, 94, 222, 62, 190, 126, 254,
  1, 129, 65, 193, 33, 161, 97, 225, 17, 145, 81, 209, 49, 177, 113, 241,
  9, 137, 73, 201, 41, 169, 105, 233, 25, 153, 89, 217, 57, 185, 121, 249,
  5, 133, 69, 197, 37, 165, 101, 229, 21, 149, 85, 213, 53, 181, 117, 245,
  13, 141, 77, 205, 45, 173, 109, 237, 29, 157, 93, 221, 61, 189, 125, 253,
  3, 131, 67, 195, 35, 163, 99, 227, 19, 147, 83, 211, 51, 179, 115, 243,
  11, 139, 75, 203, 43, 171, 107, 235, 27, 155, 91, 219, 59, 187, 123, 251,
  7, 135, 71, 199, 39, 167, 103, 231, 23, 151, 87, 215, 55, 183, 119, 247,
  15, 143, 79, 207, 47, 175, 111, 239, 31, 159, 95, 223, 63, 191, 127, 255,
};

#ifdef ONEBIT_X86
/* the squares of a vector's floats, as float64 (exact), added into two accumulators; their sum */
__attribute__((target("avx2,fma")))
static inline void sq256(__m256 z, __m256d* a0, __m256d* a1) {
  __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(z)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(z, 1));
  *a0 = _mm256_fmadd_pd(lo, lo, *a0);
  *a1 = _mm256_fmadd_pd(hi, hi, *a1);
}

__attribute__((target("avx2,fma")))
static inline double hsum256(__m256d a0, __m256d a1) {
  __m256d a = _mm256_add_pd(a0, a1);
  __m128d h = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

ONEBIT_AVX512
static inline void sq512(__m512 z, __m512d* a0, __m512d* a1) {
  __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(z));
  __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
  *a0 = _mm512_fmadd_pd(lo, lo, *a0);
  *a1 = _mm512_fmadd_pd(hi, hi, *a1);
}
#endif

#ifdef ONEBIT_X86
/* AVX-512 in wire order: element i of a run of 16 sits at bit 7 - i (bit 23 - i for the second 8) of
   the two bytes read as a little-endian uint16. With the floats' lanes reversed within each 8 (one
   permute, its own inverse) lane k meets mask bit k: the bytes are the mask as they are, no REV
   lookups. The main loops take whole 16s unmasked (masked loads and stores in every iteration ran
   3-4x slower on an AMD EPYC); a last 8 takes masks. */
static inline uint16_t load16(const uint8_t* b) { uint16_t v; memcpy(&v, b, 2); return v; }
static inline void store16(uint8_t* b, uint16_t v) { memcpy(b, &v, 2); }
ONEBIT_AVX512
static inline __m512 wire(__m512 v) {
  return _mm512_permutexvar_ps(_mm512_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8), v);
}
#endif


/* Thread t of T's elements [*a, *b) of [0, n): whole units (a block, or 16 elements), the last
   thread to n (n a multiple of 8; of the block, with blocks). */
static inline void thread_range(int64_t n, int64_t unit, int t, int T, int64_t* a, int64_t* b) {
  int64_t units = n / unit;
  *a = units * t / T * unit;
  *b = t == T - 1 ? n : units * (t + 1) / T * unit;
}

/* The worker passes over every chunk of a bucket: thread t of T's elements [*lo, *hi) of a chunk's n
   to encode (one thread below 65536 elements, as cpu_simd._threads); 0 where it has none. */
static inline int chunk_part(int64_t n, int t, int T, int64_t* lo, int64_t* hi) {
  int Tj = n < (1 << 16) ? 1 : T;
  if (t >= Tj) return 0;
  int64_t units = n / 8;
  *lo = units * t / Tj * 8;
  *hi = units * (t + 1) / Tj * 8;
  return 1;
}

/* chunk j's sum: its threads' partial sums part[j P + t] in thread order (used: the region's threads) */
static inline void chunk_sums(const int64_t* n_enc, int W, const double* part, int P, int used, double* sums) {
  for (int j = 0; j < W; j++) {
    int Tj = n_enc[j] < (1 << 16) ? 1 : used;
    double total = 0.0;
    for (int t = 0; t < Tj; t++) total += part[(size_t)j * P + t];
    sums[j] = total;
  }
}

/* A bucket's table for the fused passes: tensor k covers flat elements [start[k], start[k] + count[k]);
   the addresses g[k], d[k], p[k] (their meaning is the pass's: see each fused file) and the tensor's
   float32 scalars sc[SC k .. SC k + SC - 1] (onebit.kernels.fused.table). */
/* A table's variance column (d) holds each tensor's address with bit 0 set where its variance is bfloat16
   (a variance frozen for good, stored so: variance_dtype; onebit.kernels.fused.table), else float32 */
typedef struct { const int64_t *start, *count, *g, *d, *p; const float* sc; int K; } table_t;

/* A per-tensor element-wise pass in three variants from one loop (LOOP: over i in [0, n) of the
   arguments ARGS): NAME_c (portable C), NAME_256 (AVX2 + FMA), NAME_512 (AVX-512); ONEBIT_PICK(NAME,
   isa) the one for an ISA level. The arithmetic is the loop's, operation for operation, in every
   variant (no contraction, no reassociation: the compiler vectorises across i only). */
#ifdef ONEBIT_X86
#define ONEBIT_VARIANTS(NAME, ARGS, LOOP) \
  static void NAME##_c ARGS { LOOP } \
  ONEBIT_AVX512 static void NAME##_512 ARGS { LOOP } \
  __attribute__((target("avx2,fma"))) static void NAME##_256 ARGS { LOOP }
#define ONEBIT_PICK(NAME, isa) ((isa) >= 2 ? NAME##_512 : (isa) == 1 ? NAME##_256 : NAME##_c)
#else
#define ONEBIT_VARIANTS(NAME, ARGS, LOOP) static void NAME##_c ARGS { LOOP }
#define ONEBIT_PICK(NAME, isa) NAME##_c
#endif

/* Per tensor, SC float32 scalars; a step that reads a frozen variance v (at d[k]) has the stale
   denominator's floor, r and eps at SC_FLOOR, SC_FLOOR + 1, SC_FLOOR + 2, and computes d from v run
   by run (at most DEN_RUN elements into a buffer on the stack): d = max(sqrt(v), floor) * r + eps,
   each operation rounded (docs/ALGORITHMS.md 6.2; kernels/preconditioning.py's stale_denominator). */
#define SC 8
#define SC_FLOOR 5
#define DEN_RUN 1024
#define DEN_ARGS (float* restrict out, const float* restrict v, float floor, float r, float eps, int64_t n)
#define DEN_LOOP for (int64_t i = 0; i < n; i++) { float s = sqrtf(v[i]); s = s < floor ? floor : s; out[i] = s * r + eps; }
ONEBIT_VARIANTS(den_fill, DEN_ARGS, DEN_LOOP)

/* a bfloat16 run widened to float32 (exact): the passes that keep an error in bfloat16 read a run so */
#define WIDEN_ARGS (uint32_t* restrict o, const uint16_t* restrict e, int64_t n)
ONEBIT_VARIANTS(widen, WIDEN_ARGS, for (int64_t i = 0; i < n; i++) o[i] = (uint32_t)e[i] << 16;)
static inline void widen_run(int isa, float* out, const uint16_t* e, int64_t n) {
  ONEBIT_PICK(widen, isa)((uint32_t*)out, e, n);
}

/* a variance's element o: v float32 (vbf 0) or bfloat16 (vbf 1) */
static inline const void* var_at(const void* v, int vbf, int64_t o) {
  return vbf ? (const void*)((const uint16_t*)v + o) : (const void*)((const float*)v + o);
}

/* a table's variance address (bit 0: bfloat16): its dtype, and its element o */
static inline int var_bf(int64_t a) { return (int)(a & 1); }
static inline const void* var_of(int64_t a, int64_t o) { return var_at((const void*)(a & ~(int64_t)1), (int)(a & 1), o); }

/* out = the stale denominators of n elements of a variance v (float32, or bfloat16 where vbf: each run of
   DEN_RUN widened exactly on the stack first, then den_fill's operations, docs/ALGORITHMS.md 12.1) */
static inline void den_fill_any(int isa, float* out, const void* v, int vbf, float floor, float r, float eps,
                                int64_t n) {
  if (!vbf) {
    ONEBIT_PICK(den_fill, isa)(out, (const float*)v, floor, r, eps, n);
    return;
  }
  float w[DEN_RUN] __attribute__((aligned(64)));
  for (int64_t i = 0; i < n; i += DEN_RUN) {
    int64_t len = n - i < DEN_RUN ? n - i : DEN_RUN;
    ONEBIT_PICK(widen, isa)((uint32_t*)w, (const uint16_t*)v + i, len);
    ONEBIT_PICK(den_fill, isa)(out + i, w, floor, r, eps, len);
  }
}

/* the stale denominators of v[0, n), n <= DEN_RUN (bfloat16 where vbf), of the tensor whose scalars
   are sc, into out */
static inline void den_run(int isa, float* out, const void* v, int vbf, const float* sc, int64_t n) {
  den_fill_any(isa, out, v, vbf, sc[SC_FLOOR], sc[SC_FLOOR + 1], sc[SC_FLOOR + 2], n);
}

/* TOTAL = the float64 sum of what BODY adds into `s` on each thread's range [a, b) of [0, n) (whole
   units of UNIT elements, the last thread to n): the threads' sums kept apart and added in thread
   order after the region, so the total does not depend on how the threads were scheduled. */
#define ONEBIT_THREAD_SUM(TOTAL, n, UNIT, threads, BODY) \
  do { \
    enum { MAXT_ = 256 }; \
    double part_[MAXT_]; \
    int used_ = 1, nt_ = (threads) < MAXT_ ? (threads) : MAXT_; \
    _Pragma("omp parallel num_threads(nt_)") \
    { \
      int t_ = omp_get_thread_num(), T_ = omp_get_num_threads(); \
      int64_t a, b; \
      double s = 0.0; \
      thread_range(n, UNIT, t_, T_, &a, &b); \
      BODY; \
      part_[t_] = s; \
      if (t_ == 0) used_ = T_; \
    } \
    TOTAL = 0.0; \
    for (int t_ = 0; t_ < used_; t_++) TOTAL += part_[t_]; \
  } while (0)

/* The table walk: table_first moves the cursor *k past the tensors that end before a and returns it;
   table_part gives tensor kk's part [*lo, *hi) of flat elements [a, b) (empty where *hi <= *lo), 0
   once kk is past [a, b). `for (kk = table_first(..); table_part(.., kk, ..); kk++)` visits in
   order every tensor that meets [a, b). */
static inline int table_first(const int64_t* start, const int64_t* count, int K, int64_t a, int* k) {
  while (*k < K && start[*k] + count[*k] <= a) (*k)++;
  return *k;
}

static inline int table_part(const int64_t* start, const int64_t* count, int K, int64_t a, int64_t b, int kk,
                             int64_t* lo, int64_t* hi) {
  if (kk >= K || start[kk] >= b) return 0;
  int64_t end = start[kk] + count[kk];
  *lo = a > start[kk] ? a : start[kk];
  *hi = b < end ? b : end;
  return 1;
}

/* Thread t of T's part [a, a + len) of [0, n) for a per-tensor pass: runs of 16 elements. */
#define ONEBIT_PARALLEL(n, threads, BODY) \
  _Pragma("omp parallel num_threads(threads)") \
  { \
    int64_t a, b_; \
    thread_range(n, 16, omp_get_thread_num(), omp_get_num_threads(), &a, &b_); \
    int64_t len = b_ - a; \
    if (len > 0) { BODY; } \
  }

/* Error buffers in bfloat16 with stochastic rounding (docs/ALGORITHMS.md 12; kernels/rounding.py): element i
   of a buffer, updated with scale s, is stored as the top 16 bits of bits(e) + r_i, r_i the top 16 bits of
   key + i * 0x9E3779B9, key = fmix32(bits(s) ^ role); a NaN as its top 16 bits with the quiet bit
   set. Unsigned arithmetic wraps: the same bits as the torch and Triton versions. */
#define ROUND_GOLDEN 0x9E3779B9u
#define ROUND_WORKER 0x576F726Bu /* the roles (onebit.kernels.rounding.WORKER, SERVER) */
#define ROUND_SERVER 0x53657276u
static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
  return h;
}
static inline uint32_t round_key(float s, uint32_t role) {
  uint32_t b;
  memcpy(&b, &s, 4);
  return fmix32(b ^ role);
}
/* one element: x the float32's bits, i its index in the buffer */
static inline uint16_t round_bf16(uint32_t x, uint32_t key, uint32_t i) {
  uint32_t r = (key + i * ROUND_GOLDEN) >> 16;
  return (x & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((x >> 16) | 0x40u) : (uint16_t)((x + r) >> 16);
}
#ifdef ONEBIT_X86
/* The same in registers, for the passes that read and store a bfloat16 error inside their loops */
/* 16 bfloat16 errors widened (exact, as widen_run) */
ONEBIT_AVX512
static inline __m512 widen16(const uint16_t* e) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)e)), 16));
}

/* 16 float32 errors rounded into bfloat16 as round_bf16 does, element k's index base + k (its r: the top
   16 bits of key + index * ROUND_GOLDEN; vkey: key + base * ROUND_GOLDEN in every lane) */
ONEBIT_AVX512
static inline __m512i narrow16(__m512 x, __m512i vkey) {
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)ROUND_GOLDEN));
  __m512i xb = _mm512_castps_si512(x);
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(vkey, lanes), 16);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(xb, _mm512_set1_epi32(0x7FFFFFFF)),
                                          _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_blend_epi32(nan, _mm512_srli_epi32(_mm512_add_epi32(xb, r), 16),
                                 _mm512_or_si512(_mm512_srli_epi32(xb, 16), _mm512_set1_epi32(0x40)));
}

/* 8 bfloat16 errors widened (exact) */
__attribute__((target("avx2,fma")))
static inline __m256 widen8(const uint16_t* e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)e)), 16));
}

/* 8 float32 errors rounded into bfloat16 as round_bf16 does (narrow16's, 8 lanes), stored */
__attribute__((target("avx2,fma")))
static inline void narrow8(uint16_t* out, __m256 x, __m256i vkey) {
  const __m256i lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                           _mm256_set1_epi32((int)ROUND_GOLDEN));
  __m256i xb = _mm256_castps_si256(x);
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(vkey, lanes), 16);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(xb, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  __m256i res = _mm256_blendv_epi8(_mm256_srli_epi32(_mm256_add_epi32(xb, r), 16),
                                   _mm256_or_si256(_mm256_srli_epi32(xb, 16), _mm256_set1_epi32(0x40)), nan);
  _mm_storeu_si128((__m128i*)out, _mm_packus_epi32(_mm256_castsi256_si128(res), _mm256_extracti128_si256(res, 1)));
}

#endif


/* the codec's passes (codec.c), by ISA level: 2 AVX-512, 1 AVX2 + FMA, 0 portable C */
typedef void (*blocks_fn)(const float*, const float*, uint8_t*, double*, int64_t, int64_t);
typedef void (*decompress_fn)(const uint8_t*, const float*, int64_t, float*, float*, const float*, int64_t, int64_t,
                              int64_t);
static blocks_fn pick(int isa);
static decompress_fn pick_decompress(int isa);
static double sq_any(int isa, const float* x, int64_t n);

#endif
