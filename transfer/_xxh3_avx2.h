/* XXH3 (seed 0) compiled for AVX2, for the kernels in _kernels.c; included by it, nothing else.
 *
 * Why: the `xxhash` binding is built for SSE2, and the copy-and-verify loop hashes each 8 KiB piece right
 * after copying it, while it is in cache, where the AVX2 build runs ~1.7x faster (37 vs 21 GB/s measured
 * on the benchmark machine). Only where GCC can compile it for x86-64; used only when the CPU reports AVX2
 * (`xxh3_avx2` in _kernels.c) and after transfer/xxh3.py has checked it against the binding.
 *
 * Source: xxHash 0.8.2 (Y. Collet, BSD 2-Clause), vendored unmodified in third_party/xxhash/. */
#ifndef KVPOOL_XXH3_AVX2_H
#define KVPOOL_XXH3_AVX2_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVPOOL_XXH3_AVX2 1
/* GCC's intrinsics headers carry their own target options: included here, outside the AVX2 region, their
 * SSE2 functions stay callable from the rest of _kernels.c (inside it they would become AVX2-only). */
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include "third_party/xxhash/xxhash.h"

static uint64_t avx2_xxh3(const void *p, size_t n) { return XXH3_64bits(p, n); }
static void *avx2_create_state(void) { return XXH3_createState(); }
static int avx2_free_state(void *s) { return (int)XXH3_freeState((XXH3_state_t *)s); }
static int avx2_reset(void *s) { return (int)XXH3_64bits_reset((XXH3_state_t *)s); }
static int avx2_update(void *s, const void *p, size_t n) { return (int)XXH3_64bits_update((XXH3_state_t *)s, p, n); }
static uint64_t avx2_digest(const void *s) { return XXH3_64bits_digest((const XXH3_state_t *)s); }
#pragma GCC pop_options
#endif

#endif
