/* kvpool transfer kernels: copy-and-verify of blocks and batch xxh3, with the GIL released.
 *
 * Why C: a Python loop over 64 KiB blocks calls the hash once per block, and every call takes the GIL
 * back; two copying threads then spend their time handing the GIL to each other (measured here: two
 * threads no faster than one at 64 KiB blocks). One call per batch runs the whole loop without it.
 *
 * The hash is passed in: the caller gives the addresses of XXH3's functions, either those exported by the
 * `xxhash` binding's extension module or the AVX2 build of the same code here (`xxh3_avx2`, from
 * _xxh3_avx2.h), which transfer/xxh3.py uses only after checking it returns the binding's values.
 * Source: xxHash's XXH3 (Y. Collet, https://github.com/Cyan4973/xxHash), seed 0.
 *
 * Built by setup.py as an optional extension: without a C compiler kvpool uses its numpy paths.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_xxh3_avx2.h"

typedef uint64_t (*xxh3_fn)(const void *, size_t);
typedef void *(*create_state_fn)(void);
typedef int (*free_state_fn)(void *);
typedef int (*reset_fn)(void *);
typedef int (*update_fn)(void *, const void *, size_t);
typedef uint64_t (*digest_fn)(const void *);

/* Copy in pieces below glibc's `rep movsb` threshold (2 KiB by default): `rep movsb` from a shmem
 * mapping's 4 KiB pages measured 4x slower here than the vector loop glibc uses for smaller sizes. */
#define COPY_PIECE 1024
/* Copy this much, then hash it while it is still in the core's cache (a multiple of XXH3's 1 KiB block). */
#define CHUNK (8 * 1024)

/* A job moving more than this copies through a cache-resident bounce buffer: source -> buffer (hashed
 * there) -> destination with non-temporal stores, so the destination's lines are not read first (for
 * ownership) and the copy moves two bytes of memory traffic per byte, as glibc's memcpy does above its
 * non-temporal threshold (~3/4 of the L3 share; measured here: +25 % at 1 MiB blocks). Smaller jobs copy
 * straight into the destination, which stays in cache for its user. */
#define STREAM_MIN_BYTES (8u << 20)

#if defined(__SSE2__)
#include <emmintrin.h>
static void stream_copy(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}
#define STREAM_FENCE() _mm_sfence()
#else
#define stream_copy memcpy
#define STREAM_FENCE() ((void)0)
#endif

static void copy_pieces(char *dst, const char *src, size_t n) {
    while (n >= COPY_PIECE) {
        memcpy(dst, src, COPY_PIECE);
        dst += COPY_PIECE;
        src += COPY_PIECE;
        n -= COPY_PIECE;
    }
    if (n)
        memcpy(dst, src, n);
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t nbytes, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len != nbytes) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, view->len, nbytes);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
}

/* A C-contiguous (and writable, when asked) buffer of each item of `seq`, held until release_all: the
 * bytes stay put while the GIL is released. NULL with ValueError (or TypeError, MemoryError) set. */
static Py_buffer *acquire_all(PyObject *seq, int writable, Py_ssize_t *n_out) {
    PyObject *fast = PySequence_Fast(seq, "a sequence of buffers expected");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyObject_GetBuffer(items[k], &views[k], flags) < 0) {
            release_all(views, k);
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "buffer %zd: block buffers must be C-contiguous%s", k,
                         writable ? " and writable" : "");
            return NULL;
        }
    }
    Py_DECREF(fast); /* each held buffer keeps its exporter alive */
    *n_out = n;
    return views;
}

/* acquire_all of the read-only `bufs_o`, and `out_o` as a writable array of one `itemsize` item per buffer
 * (`what` names it in errors). NULL with an exception set, nothing held; else release both when done. */
static Py_buffer *acquire_with_out(PyObject *bufs_o, PyObject *out_o, Py_buffer *out, size_t itemsize,
                                   const char *what, Py_ssize_t *n_out) {
    Py_buffer *bufs = acquire_all(bufs_o, 0, n_out);
    if (bufs == NULL)
        return NULL;
    if (get_buffer(out_o, out, 1, *n_out * (Py_ssize_t)itemsize, what) < 0) {
        release_all(bufs, *n_out);
        return NULL;
    }
    return bufs;
}

/* copy_verify(fns, src_base, src_nbytes, offsets, dsts, got, stop) -> int
 *
 * fns: (XXH3_createState, XXH3_freeState, XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest)
 * addresses. dsts: n writable C-contiguous buffers; offsets: n int64 (where each block starts in the
 * source). For each block in order, unless the byte `stop[0]` is non-zero: copy len(dsts[k]) bytes
 * from src_base + offsets[k] in CHUNK pieces, hashing each piece while it is in cache (see
 * STREAM_MIN_BYTES); got[k] (n uint64) = the xxh3 of the copy (the caller compares it with what the
 * store holds). Returns the number of blocks done (< n when stopped). Raises ValueError for a block
 * outside [0, src_nbytes) (before any copy), a buffer that is not what it should be or mis-sized
 * arrays; MemoryError without a hash state. */
static PyObject *copy_verify(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fns, *offsets_o, *dsts_o, *got_o, *stop_o;
    unsigned long long src_base;
    Py_ssize_t src_nbytes, n;
    if (!PyArg_ParseTuple(args, "OKnOOOO", &fns, &src_base, &src_nbytes, &offsets_o, &dsts_o, &got_o, &stop_o))
        return NULL;
    void *addr[5];
    if (!PyTuple_Check(fns) || PyTuple_GET_SIZE(fns) != 5) {
        PyErr_SetString(PyExc_TypeError, "fns: a tuple of 5 function addresses");
        return NULL;
    }
    for (int i = 0; i < 5; i++) {
        addr[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fns, i));
        if (addr[i] == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "fns: a null function address");
            return NULL;
        }
    }
    Py_buffer *dsts = acquire_all(dsts_o, 1, &n);
    if (dsts == NULL)
        return NULL;
    Py_buffer offsets, got, stop;
    if (get_buffer(offsets_o, &offsets, 0, n * (Py_ssize_t)sizeof(int64_t), "offsets") < 0) {
        release_all(dsts, n);
        return NULL;
    }
    if (get_buffer(got_o, &got, 1, n * (Py_ssize_t)sizeof(uint64_t), "got") < 0) {
        PyBuffer_Release(&offsets);
        release_all(dsts, n);
        return NULL;
    }
    if (get_buffer(stop_o, &stop, 0, 1, "stop") < 0) {
        PyBuffer_Release(&offsets);
        PyBuffer_Release(&got);
        release_all(dsts, n);
        return NULL;
    }
    const int64_t *off = (const int64_t *)offsets.buf;
    size_t total = 0;
    Py_ssize_t bad = -1;
    for (Py_ssize_t k = 0; k < n && bad < 0; k++) {
        total += (size_t)dsts[k].len;
        if (off[k] < 0 || off[k] > src_nbytes - dsts[k].len)
            bad = k;
    }
    void *state = bad < 0 ? ((create_state_fn)addr[0])() : NULL;
    Py_ssize_t done = 0;
    if (state != NULL) {
        reset_fn reset = (reset_fn)addr[2];
        update_fn update = (update_fn)addr[3];
        digest_fn digest = (digest_fn)addr[4];
        uint64_t *out = (uint64_t *)got.buf;
        const volatile unsigned char *stopped = (const volatile unsigned char *)stop.buf;
        const char *src = (const char *)(uintptr_t)src_base;
        int stream = total > STREAM_MIN_BYTES;
        Py_BEGIN_ALLOW_THREADS
        char bounce[CHUNK] __attribute__((aligned(64)));
        for (; done < n && !*stopped; done++) {
            const char *s = src + off[done];
            char *d = (char *)dsts[done].buf;
            size_t left = (size_t)dsts[done].len;
            reset(state);
            while (left) {
                size_t piece = left < CHUNK ? left : CHUNK;
                if (stream) { /* the bytes hashed are the bytes stored: both come from the buffer */
                    copy_pieces(bounce, s, piece);
                    update(state, bounce, piece);
                    stream_copy(d, bounce, piece);
                } else {
                    copy_pieces(d, s, piece);
                    update(state, d, piece);
                }
                d += piece;
                s += piece;
                left -= piece;
            }
            out[done] = digest(state);
        }
        if (stream)
            STREAM_FENCE(); /* the streamed stores are visible before the caller learns they are done */
        /* the copy's loads complete before anything the caller does next, e.g. an optimistic reader's
           second look at the slot's generation (transfer/slot_state.py) */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        Py_END_ALLOW_THREADS
        ((free_state_fn)addr[1])(state);
    }
    long long bad_off = bad >= 0 ? (long long)off[bad] : 0;
    Py_ssize_t bad_len = bad >= 0 ? dsts[bad].len : 0;
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&got);
    PyBuffer_Release(&stop);
    release_all(dsts, n);
    if (bad >= 0)
        return PyErr_Format(PyExc_ValueError, "block %zd: offset %lld + %zd bytes outside the segment", bad,
                            bad_off, bad_len);
    if (state == NULL)
        return PyErr_NoMemory();
    return PyLong_FromSsize_t(done);
}

/* hash_many(XXH3_64bits address, buffers, got) -> None
 *
 * got[k] (n uint64) = XXH3_64bits of the bytes of buffers[k] (n C-contiguous buffers, held while the GIL
 * is released). Raises ValueError for a non-contiguous buffer or a mis-sized `got`. */
static PyObject *hash_many(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fn_o, *bufs_o, *got_o;
    if (!PyArg_ParseTuple(args, "OOO", &fn_o, &bufs_o, &got_o))
        return NULL;
    xxh3_fn fn = (xxh3_fn)PyLong_AsVoidPtr(fn_o);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a null function address");
        return NULL;
    }
    Py_ssize_t n;
    Py_buffer got;
    Py_buffer *bufs = acquire_with_out(bufs_o, got_o, &got, sizeof(uint64_t), "got", &n);
    if (bufs == NULL)
        return NULL;
    uint64_t *out = (uint64_t *)got.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++)
        out[k] = fn(bufs[k].buf, (size_t)bufs[k].len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&got);
    release_all(bufs, n);
    Py_RETURN_NONE;
}

/* addresses(buffers, out) -> None
 *
 * out[k] (n int64) = the address of the first byte of buffers[k] (C-contiguous, read-only allowed). The
 * address stays valid only while the caller holds the buffer. Raises ValueError as hash_many does. */
static PyObject *addresses(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *bufs_o, *out_o;
    if (!PyArg_ParseTuple(args, "OO", &bufs_o, &out_o))
        return NULL;
    Py_ssize_t n;
    Py_buffer out;
    Py_buffer *bufs = acquire_with_out(bufs_o, out_o, &out, sizeof(int64_t), "out", &n);
    if (bufs == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++)
        ((int64_t *)out.buf)[k] = (int64_t)(uintptr_t)bufs[k].buf;
    PyBuffer_Release(&out);
    release_all(bufs, n);
    Py_RETURN_NONE;
}

/* xxh3_avx2() -> (XXH3_64bits, createState, freeState, reset, update, digest) addresses of the AVX2 build
 * (the order of transfer/xxh3.py's _STREAM_FNS after the first), or None where it was not compiled or the
 * CPU does not report AVX2. */
static PyObject *xxh3_avx2(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
#ifdef KVPOOL_XXH3_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        return Py_BuildValue("(NNNNNN)", PyLong_FromVoidPtr((void *)avx2_xxh3),
                             PyLong_FromVoidPtr((void *)avx2_create_state), PyLong_FromVoidPtr((void *)avx2_free_state),
                             PyLong_FromVoidPtr((void *)avx2_reset), PyLong_FromVoidPtr((void *)avx2_update),
                             PyLong_FromVoidPtr((void *)avx2_digest));
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"addresses", addresses, METH_VARARGS, "The address of each buffer's first byte."},
    {"copy_verify", copy_verify, METH_VARARGS, "Copy blocks out of a mapped segment and xxh3 each copy."},
    {"hash_many", hash_many, METH_VARARGS, "XXH3_64bits of many blocks in one call."},
    {"xxh3_avx2", xxh3_avx2, METH_NOARGS, "Addresses of XXH3 built for AVX2, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
