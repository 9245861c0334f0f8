/* Copy with non-temporal (streaming) stores: the snapshot's copy into shared memory; and
   the XXH3 checksums of the snapshot's tensors, many buffers in one call.

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
   streams (x86-64, SSE2) or falls back to memcpy (elsewhere).

   hash_many, copy_many, copy_hash_many: the same over lists of buffers, the GIL released
   ONCE for the whole list. Why one call: a call that releases the GIL has to win it back
   when it returns, and beside a busy Python thread (training) that waits up to the
   interpreter's switch interval (5 ms) each time: 600 one-MiB checksums by the xxhash
   package took 57 ms alone and 3.16 s beside a Python thread. Here the views are taken
   first, the GIL is released, `threads` native threads take buffers off a shared
   counter (largest first: one tensor can be a hundred times another), and the GIL is
   taken back once. The digests are XXH3-64 with seed 0 (xxh3.h), bit for bit the
   xxhash package's xxh3_64_intdigest: the checkpoint format's checksums. XXH3_KERNEL
   names the long-input kernel this CPU runs; XXH3_KERNELS all those it can. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "xxh3.h"

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

/* ---- many buffers in one call ---- */

/* The fused copy's piece: hashed from the source, which brings it into cache, then
   streamed from cache to the slot, so the source is read from memory once. 512 KiB, as
   the Python fallback's moc.checkpoint.twolevel.memory.native.COPY_CHUNK (measured there): it stays
   in a core's L2 between the two passes. A multiple of XXH3's 1024-byte block, so each
   piece but the last is whole blocks and the hash needs no buffered state. (On a 2-core
   EPYC VM, 4 KiB pieces, whose reads and streaming writes overlap more, measured 15 GB/s
   against 12 for 512 KiB: worth measuring on the training machines.) */
#define COPY_HASH_CHUNK (512 * 1024)

typedef enum { OP_HASH, OP_COPY, OP_COPY_HASH } batch_op;

typedef struct {
    const char *src;
    char *dst;        /* NULL for OP_HASH */
    size_t len;
    Py_ssize_t index; /* the buffer's position in the caller's list: its digest's */
} batch_job;

typedef struct {
    batch_op op;
    const xxh3_kernel *kernel;
    const batch_job *jobs; /* largest first */
    size_t njobs;
    atomic_size_t next;    /* the next job to take: whichever thread is free takes it */
    uint64_t *digests;     /* by batch_job.index; each written by one thread only */
} batch;

/* XXH3-64 of src[0:len], with src streamed into dst a piece at a time after the piece's
   blocks are hashed: xxh3_64's long loop cut at COPY_HASH_CHUNK. */
static uint64_t copy_hash(char *dst, const char *src, size_t len, const xxh3_kernel *kernel)
{
    const uint8_t *in = (const uint8_t *)src;
    if (len <= XXH3_MIDSIZE_MAX) {
        uint64_t h = xxh3_64(in, len, kernel);
        if (len)
            stream_copy(dst, src, len);
        return h;
    }
    uint64_t acc[8], h = 0;
    xxh3_long_init(acc);
    size_t blocks_left = xxh3_long_blocks(len);
    for (size_t at = 0; at < len; at += COPY_HASH_CHUNK) {
        size_t n = len - at < COPY_HASH_CHUNK ? len - at : COPY_HASH_CHUNK;
        /* Every piece but the last is 512 whole blocks, all before the last block; the
           last piece holds the last block, which xxh3_long_finish hashes. */
        size_t blocks = n / XXH3_BLOCK_LEN < blocks_left ? n / XXH3_BLOCK_LEN : blocks_left;
        kernel->blocks(acc, in + at, blocks);
        blocks_left -= blocks;
        if (at + n == len)
            h = xxh3_long_finish(acc, in, len, kernel);
        stream_copy(dst + at, src + at, n);
    }
    return h;
}

/* One thread's share of a batch: jobs off the shared counter until none is left.
   Runs without the GIL. */
static void *batch_run(void *arg)
{
    batch *b = (batch *)arg;
    for (;;) {
        size_t i = atomic_fetch_add_explicit(&b->next, 1, memory_order_relaxed);
        if (i >= b->njobs)
            return NULL;
        const batch_job *job = &b->jobs[i];
        switch (b->op) {
        case OP_HASH:
            b->digests[job->index] = xxh3_64(job->src, job->len, b->kernel);
            break;
        case OP_COPY:
            if (job->len)
                stream_copy(job->dst, job->src, job->len);
            break;
        case OP_COPY_HASH:
            b->digests[job->index] = copy_hash(job->dst, job->src, job->len, b->kernel);
            break;
        }
    }
}

/* Runs a batch on `threads` threads: the calling thread and threads - 1 new ones, or
   fewer where the system makes no more (the caller then takes what is left; nothing
   fails for want of a thread). Blocks until every job is done; the joins publish the
   helpers' digests to the caller. Called without the GIL.

   Scheduling: threads made by pthread_create with default attributes inherit the
   creating thread's scheduling policy and priority (PTHREAD_INHERIT_SCHED; on Linux its
   nice value too). moc calls this from its snapshot thread, which runs SCHED_IDLE on
   Linux so that the copy and the checksums yield the CPU to training: the helpers must
   run SCHED_IDLE as well, and do, by inheriting it. Do not give them attributes. */
static void batch_run_threads(batch *b, pthread_t *helpers, size_t threads)
{
    size_t started = 0;
    while (started + 1 < threads && pthread_create(&helpers[started], NULL, batch_run, b) == 0)
        started++;
    batch_run(b);
    for (size_t t = 0; t < started; t++)
        pthread_join(helpers[t], NULL);
}

static int by_size_largest_first(const void *a, const void *b)
{
    size_t x = ((const batch_job *)a)->len, y = ((const batch_job *)b)->len;
    return (x < y) - (x > y);
}

/* The XXH3 kernels this CPU runs, the default (fastest) last: set at import. */
static const xxh3_kernel *kernels[3];
static size_t nkernels;

static void find_kernels(void)
{
    nkernels = 0;
    kernels[nkernels++] = &xxh3_kernel_scalar;
#if MOC_XXH3_X86
    kernels[nkernels++] = &xxh3_kernel_sse2;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        kernels[nkernels++] = &xxh3_kernel_avx2;
#endif
}

static const xxh3_kernel *kernel_named(const char *func, const char *name)
{
    if (name == NULL)
        return kernels[nkernels - 1];
    for (size_t k = 0; k < nkernels; k++)
        if (strcmp(kernels[k]->name, name) == 0)
            return kernels[k];
    PyErr_Format(PyExc_ValueError, "%s: kernel '%s' does not run on this CPU (or is unknown); "
                 "expected one of XXH3_KERNELS, or None for XXH3_KERNEL", func, name);
    return NULL;
}

/* The current exception, taken off (cleared): for a message that quotes it. */
static PyObject *take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* A list argument as a tuple: its items cannot change under us while the views are
   taken (taking a view can run Python code). */
static PyObject *as_tuple(const char *func, const char *name, PyObject *arg)
{
    if (PyObject_CheckBuffer(arg)) {
        PyErr_Format(PyExc_TypeError, "%s: %s is one buffer (of type %.100s); expected a list "
                     "of buffers (wrap one buffer in a list)", func, name, Py_TYPE(arg)->tp_name);
        return NULL;
    }
    PyObject *items = PySequence_Tuple(arg);
    if (items == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s is of type %.100s; expected a list or tuple of "
                     "buffers", func, name, Py_TYPE(arg)->tp_name);
    }
    return items;
}

/* A C-contiguous view of name[i] (writable when `writable`), or -1 with an exception
   that names the item and says what was expected; nothing is held on failure. */
static int get_view(const char *func, const char *name, Py_ssize_t i, PyObject *obj,
                    Py_buffer *view, int writable)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        /* What exporters raise for "no buffer" or "not that kind of buffer" (numpy: a
           ValueError for a read-only array asked to be writable). */
        if (!PyErr_ExceptionMatches(PyExc_TypeError)
            && !PyErr_ExceptionMatches(PyExc_BufferError)
            && !PyErr_ExceptionMatches(PyExc_ValueError))
            return -1; /* MemoryError and the like: as they are */
        PyObject *cause = take_exception();
        if (writable && PyObject_GetBuffer(obj, view, PyBUF_STRIDES) == 0) {
            PyBuffer_Release(view);
            PyErr_Format(PyExc_TypeError, "%s: %s[%zd] is read-only (of type %.100s); expected "
                         "a writable buffer (a bytearray, a writable numpy array, "
                         "tensor.numpy())", func, name, i, Py_TYPE(obj)->tp_name);
        } else {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s: %s[%zd] gives no buffer (of type %.100s: %S); "
                         "expected bytes, a memoryview, a numpy array or tensor.numpy()",
                         func, name, i, Py_TYPE(obj)->tp_name, cause ? cause : Py_None);
        }
        Py_XDECREF(cause);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: %s[%zd] is not C-contiguous; expected a "
                     "C-contiguous buffer (np.ascontiguousarray, tensor.contiguous())",
                     func, name, i);
        return -1;
    }
    return 0;
}

/* hash_many, copy_many and copy_hash_many: take every view (dsts_arg NULL for
   hash_many), release the GIL once for the whole batch, give the views back. The
   digests as a list of ints for the hashing ops, None for copy_many. */
static PyObject *run_many(const char *func, batch_op op, PyObject *dsts_arg,
                          PyObject *srcs_arg, Py_ssize_t threads, const char *kernel_name)
{
    const char *src_name = dsts_arg ? "srcs" : "buffers";
    const xxh3_kernel *kernel = kernel_named(func, kernel_name);
    if (kernel == NULL)
        return NULL;
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s: threads is %zd; expected at least 1", func, threads);
        return NULL;
    }
    PyObject *srcs = NULL, *dsts = NULL, *result = NULL;
    Py_buffer *src_views = NULL, *dst_views = NULL;
    batch_job *jobs = NULL;
    uint64_t *digests = NULL;
    pthread_t *helpers = NULL;
    Py_ssize_t n = 0, held = 0; /* pairs whose views are held */

    if ((srcs = as_tuple(func, src_name, srcs_arg)) == NULL)
        goto done;
    n = PyTuple_GET_SIZE(srcs);
    if (dsts_arg) {
        if ((dsts = as_tuple(func, "dsts", dsts_arg)) == NULL)
            goto done;
        if (PyTuple_GET_SIZE(dsts) != n) {
            PyErr_Format(PyExc_ValueError, "%s: %zd dsts but %zd srcs; expected one dst per "
                         "src", func, PyTuple_GET_SIZE(dsts), n);
            goto done;
        }
    }
    size_t count = n > 0 ? (size_t)n : 1;
    if (threads > n)
        threads = n;
    src_views = PyMem_Calloc(count, sizeof *src_views);
    dst_views = PyMem_Calloc(count, sizeof *dst_views);
    jobs = PyMem_Calloc(count, sizeof *jobs);
    digests = PyMem_Calloc(count, sizeof *digests);
    helpers = PyMem_Calloc(threads > 1 ? (size_t)threads - 1 : 1, sizeof *helpers);
    if (!src_views || !dst_views || !jobs || !digests || !helpers) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (get_view(func, src_name, i, PyTuple_GET_ITEM(srcs, i), &src_views[i], 0) < 0)
            goto done;
        if (dsts && get_view(func, "dsts", i, PyTuple_GET_ITEM(dsts, i), &dst_views[i], 1) < 0) {
            PyBuffer_Release(&src_views[i]);
            goto done;
        }
        if (dsts && dst_views[i].len != src_views[i].len) {
            PyErr_Format(PyExc_ValueError, "%s: dsts[%zd] is %zd bytes but srcs[%zd] is %zd; "
                         "expected equal lengths", func, i, dst_views[i].len, i,
                         src_views[i].len);
            PyBuffer_Release(&src_views[i]);
            PyBuffer_Release(&dst_views[i]);
            goto done;
        }
        held = i + 1;
        jobs[i].src = (const char *)src_views[i].buf;
        jobs[i].dst = dsts ? (char *)dst_views[i].buf : NULL;
        jobs[i].len = (size_t)src_views[i].len;
        jobs[i].index = i;
    }
    qsort(jobs, (size_t)n, sizeof *jobs, by_size_largest_first);

    batch b = {op, kernel, jobs, (size_t)n, 0, digests};
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS /* once, for the whole batch: blocks until it is done */
        batch_run_threads(&b, helpers, (size_t)threads);
        Py_END_ALLOW_THREADS
    }

    if (op == OP_COPY) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    if ((result = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyLong_FromUnsignedLongLong((unsigned long long)digests[i]);
        if (d == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, d);
    }

done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&src_views[i]);
        if (dsts)
            PyBuffer_Release(&dst_views[i]);
    }
    PyMem_Free(src_views);
    PyMem_Free(dst_views);
    PyMem_Free(jobs);
    PyMem_Free(digests);
    PyMem_Free(helpers);
    Py_XDECREF(srcs);
    Py_XDECREF(dsts);
    return result;
}

static PyObject *hash_many(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"buffers", "threads", "kernel", NULL};
    PyObject *buffers;
    Py_ssize_t threads = 1;
    const char *kernel = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|n$z:hash_many", keywords, &buffers,
                                     &threads, &kernel))
        return NULL;
    return run_many("hash_many", OP_HASH, NULL, buffers, threads, kernel);
}

static PyObject *copy_many(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"dsts", "srcs", "threads", NULL};
    PyObject *dsts, *srcs;
    Py_ssize_t threads = 1;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|n:copy_many", keywords, &dsts, &srcs,
                                     &threads))
        return NULL;
    return run_many("copy_many", OP_COPY, dsts, srcs, threads, NULL);
}

static PyObject *copy_hash_many(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"dsts", "srcs", "threads", "kernel", NULL};
    PyObject *dsts, *srcs;
    Py_ssize_t threads = 1;
    const char *kernel = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|n$z:copy_hash_many", keywords, &dsts,
                                     &srcs, &threads, &kernel))
        return NULL;
    return run_many("copy_hash_many", OP_COPY_HASH, dsts, srcs, threads, kernel);
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src): copy the bytes of src into dst (same length, C-contiguous) with "
     "streaming stores where NONTEMPORAL, memcpy elsewhere; the GIL is released."},
    {"hash_many", (PyCFunction)(void (*)(void))hash_many, METH_VARARGS | METH_KEYWORDS,
     "hash_many(buffers, threads=1, *, kernel=None) -> list[int]: the XXH3-64 (seed 0) of "
     "each C-contiguous buffer, equal to xxhash.xxh3_64_intdigest, on up to `threads` native "
     "threads (largest buffers first) with the GIL released once. kernel: one of "
     "XXH3_KERNELS (None: XXH3_KERNEL), for tests."},
    {"copy_many", (PyCFunction)(void (*)(void))copy_many, METH_VARARGS | METH_KEYWORDS,
     "copy_many(dsts, srcs, threads=1): copy(dsts[i], srcs[i]) for every i, on up to "
     "`threads` native threads with the GIL released once."},
    {"copy_hash_many", (PyCFunction)(void (*)(void))copy_hash_many,
     METH_VARARGS | METH_KEYWORDS,
     "copy_hash_many(dsts, srcs, threads=1, *, kernel=None) -> list[int]: copy_many that "
     "also returns hash_many(srcs), in one pass over each source: 512 KiB at a time, hashed "
     "from the source, then streamed to dst."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "streamcopy",
    "Non-temporal copies and XXH3 checksums for the snapshot path (see the source's "
    "opening comment).",
    -1, methods,
};

PyMODINIT_FUNC PyInit_streamcopy(void)
{
    find_kernels();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *names = PyTuple_New((Py_ssize_t)nkernels);
    if (names == NULL)
        goto fail;
    for (size_t k = 0; k < nkernels; k++) {
        PyObject *name = PyUnicode_FromString(kernels[k]->name);
        if (name == NULL) {
            Py_DECREF(names);
            goto fail;
        }
        PyTuple_SET_ITEM(names, (Py_ssize_t)k, name);
    }
    if (PyModule_AddObject(m, "XXH3_KERNELS", names) < 0) {
        Py_DECREF(names);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "NONTEMPORAL", MOC_NONTEMPORAL) < 0
        || PyModule_AddStringConstant(m, "XXH3_KERNEL", kernels[nkernels - 1]->name) < 0)
        goto fail;
    return m;

fail:
    Py_DECREF(m);
    return NULL;
}
