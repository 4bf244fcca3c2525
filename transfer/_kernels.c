/* kvpool transfer kernels: copy-and-verify of blocks and batch xxh3, with the GIL released.
 *
 * Why C: a Python loop over 64 KiB blocks calls the hash once per block, and every call takes the GIL
 * back; two copying threads then spend their time handing the GIL to each other (measured here: two
 * threads no faster than one at 64 KiB blocks). One call per batch runs the whole loop without it.
 *
 * The hash itself is not here: the caller passes the addresses of xxHash's XXH3 functions exported by
 * the `xxhash` binding's extension module (transfer/xxh3.py), so both sides of a transfer use the one
 * implementation. Source: xxHash's XXH3 (Y. Collet, https://github.com/Cyan4973/xxHash), seed 0.
 *
 * Built by setup.py as an optional extension: without a C compiler kvpool uses its numpy paths.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

/* copy_verify(fns, src_base, src_nbytes, n, table, got, stop) -> int
 *
 * fns: (XXH3_createState, XXH3_freeState, XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest)
 * addresses. table: n x 3 int64 (source offset, destination address, nbytes). For each block in order,
 * unless the byte `stop[0]` is non-zero: copy nbytes from src_base + offset to the destination in CHUNK
 * pieces, hashing each piece while it is in cache (see STREAM_MIN_BYTES); got[k] = the
 * xxh3 of the copy (the caller compares it with what the store holds). Returns the number of blocks
 * done (< n when stopped). Raises
 * ValueError for an entry outside [0, src_nbytes) or mis-sized buffers, MemoryError without a state. */
static PyObject *copy_verify(PyObject *self, PyObject *args) {
    PyObject *fns, *table_o, *got_o, *stop_o;
    unsigned long long src_base;
    Py_ssize_t src_nbytes, n;
    if (!PyArg_ParseTuple(args, "OKnnOOO", &fns, &src_base, &src_nbytes, &n, &table_o, &got_o, &stop_o))
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
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    Py_buffer table, got, stop;
    if (get_buffer(table_o, &table, 0, n * 3 * (Py_ssize_t)sizeof(int64_t), "table") < 0)
        return NULL;
    if (get_buffer(got_o, &got, 1, n * (Py_ssize_t)sizeof(uint64_t), "got") < 0) {
        PyBuffer_Release(&table);
        return NULL;
    }
    if (get_buffer(stop_o, &stop, 0, 1, "stop") < 0) {
        PyBuffer_Release(&table);
        PyBuffer_Release(&got);
        return NULL;
    }
    const int64_t *t = (const int64_t *)table.buf;
    size_t total = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t off = t[3 * k], nbytes = t[3 * k + 2];
        total += (size_t)(nbytes > 0 ? nbytes : 0);
        if (off < 0 || nbytes < 0 || off > src_nbytes - nbytes || t[3 * k + 1] == 0) {
            PyBuffer_Release(&table);
            PyBuffer_Release(&got);
            PyBuffer_Release(&stop);
            return PyErr_Format(PyExc_ValueError, "entry %zd: offset %lld + %lld bytes outside the segment",
                                k, (long long)off, (long long)nbytes);
        }
    }
    void *state = ((create_state_fn)addr[0])();
    if (state == NULL) {
        PyBuffer_Release(&table);
        PyBuffer_Release(&got);
        PyBuffer_Release(&stop);
        return PyErr_NoMemory();
    }
    reset_fn reset = (reset_fn)addr[2];
    update_fn update = (update_fn)addr[3];
    digest_fn digest = (digest_fn)addr[4];
    uint64_t *out = (uint64_t *)got.buf;
    const volatile unsigned char *stopped = (const volatile unsigned char *)stop.buf;
    const char *src = (const char *)(uintptr_t)src_base;
    Py_ssize_t done = 0;
    int stream = total > STREAM_MIN_BYTES;
    Py_BEGIN_ALLOW_THREADS
    char bounce[CHUNK] __attribute__((aligned(64)));
    for (; done < n && !*stopped; done++) {
        const char *s = src + t[3 * done];
        char *d = (char *)(uintptr_t)t[3 * done + 1];
        size_t left = (size_t)t[3 * done + 2];
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
    Py_END_ALLOW_THREADS
    ((free_state_fn)addr[1])(state);
    PyBuffer_Release(&table);
    PyBuffer_Release(&got);
    PyBuffer_Release(&stop);
    return PyLong_FromSsize_t(done);
}

/* hash_many(XXH3_64bits address, table, got) -> None
 *
 * table: n x 2 int64 (address, nbytes); got[k] = XXH3_64bits of block k (n uint64). The caller keeps
 * the buffers alive. Raises ValueError for mis-sized buffers or a negative size. */
static PyObject *hash_many(PyObject *self, PyObject *args) {
    PyObject *fn_o, *table_o, *got_o;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnOO", &fn_o, &n, &table_o, &got_o))
        return NULL;
    xxh3_fn fn = (xxh3_fn)PyLong_AsVoidPtr(fn_o);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a null function address");
        return NULL;
    }
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    Py_buffer table, got;
    if (get_buffer(table_o, &table, 0, n * 2 * (Py_ssize_t)sizeof(int64_t), "table") < 0)
        return NULL;
    if (get_buffer(got_o, &got, 1, n * (Py_ssize_t)sizeof(uint64_t), "got") < 0) {
        PyBuffer_Release(&table);
        return NULL;
    }
    const int64_t *t = (const int64_t *)table.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (t[2 * k + 1] < 0 || (t[2 * k] == 0 && t[2 * k + 1] > 0)) {
            PyBuffer_Release(&table);
            PyBuffer_Release(&got);
            return PyErr_Format(PyExc_ValueError, "entry %zd: bad address or size", k);
        }
    }
    uint64_t *out = (uint64_t *)got.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++)
        out[k] = fn((const void *)(uintptr_t)t[2 * k], (size_t)t[2 * k + 1]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&table);
    PyBuffer_Release(&got);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_verify", copy_verify, METH_VARARGS, "Copy blocks out of a mapped segment and xxh3 each copy."},
    {"hash_many", hash_many, METH_VARARGS, "XXH3_64bits of many blocks in one call."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
