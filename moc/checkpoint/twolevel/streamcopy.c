/* Copy with non-temporal (streaming) stores: the snapshot's copy into shared memory.

   Why: an ordinary store first reads the destination's cache line (read for ownership),
   so copying N bytes costs 3N of memory traffic, and the copied bytes evict training's
   working set from the cache. A streaming store writes the line without reading it and
   without keeping it: 2N of traffic, nothing evicted. Nothing reads a snapshot until a
   persist or a recovery, so keeping it in cache buys nothing. glibc's memcpy streams
   only copies larger than a threshold sized from the cache (192 MB on the machines moc
   is measured on), never the snapshot's 512 KiB chunks; the threshold is a
   process-wide tunable read at start-up, which a library may not set for its user.

   copy(dst, src): dst and src are C-contiguous buffers of the same length, dst
   writable; the GIL is released for the copy. NONTEMPORAL says whether this build
   streams (x86-64, SSE2) or falls back to memcpy (elsewhere). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define MOC_NONTEMPORAL 1

static void stream_copy(char *dst, const char *src, size_t n)
{
    /* A streaming store needs a 16-byte aligned destination; the head up to it and the
       tail under 64 bytes go by memcpy. */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
    /* Streaming stores are weakly ordered: fence them before anyone is told the copy
       is done (the slot's header is written after this returns). */
    _mm_sfence();
}
#else
#define MOC_NONTEMPORAL 0

static void stream_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}
#endif

static PyObject *copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    PyObject *result = NULL;
    if (!PyBuffer_IsContiguous(&dst, 'C') || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_ValueError, "copy: dst and src must be C-contiguous buffers");
    } else if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: dst is %zd bytes but src is %zd; expected equal "
                     "lengths", dst.len, src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        stream_copy((char *)dst.buf, (const char *)src.buf, (size_t)src.len);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src): copy the bytes of src into dst (same length, C-contiguous) with "
     "streaming stores where NONTEMPORAL, memcpy elsewhere; the GIL is released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "streamcopy",
    "Non-temporal copies for the snapshot path (see the source's opening comment).",
    -1, methods,
};

PyMODINIT_FUNC PyInit_streamcopy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "NONTEMPORAL", MOC_NONTEMPORAL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
