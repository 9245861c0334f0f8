"""moc's C extension (moc/checkpoint/twolevel/memory/streamcopy.c, xxh3.h): hash_many,
copy_many and copy_hash_many. The digests are the checkpoint format's checksums, so each
must equal the xxhash package's xxh3_64_intdigest bit for bit: for every XXH3 size class
(0, 1-3, 4-8, 9-16, 17-128, 129-240, over 240 in stripes and blocks), around the stripe,
block and 512 KiB copy-chunk boundaries, at every start offset, for every kernel this CPU
runs and any number of threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

streamcopy = pytest.importorskip("moc.checkpoint.twolevel.memory.streamcopy")

KERNELS = streamcopy.XXH3_KERNELS
THREADS = [1, 2, 3, 4]
KIB, MIB = 1 << 10, 1 << 20
CHUNK = 512 * KIB
"""The fused copy's piece (COPY_HASH_CHUNK in streamcopy.c)."""

BOUNDARY_SIZES = sorted({n + d for n in [*range(64, 8193, 64), *range(KIB, 9 * KIB, KIB)]
                         for d in (-1, 0, 1)})
"""Lengths at and next to every 64-byte stripe up to 8 KiB and every 1024-byte block up
to 8 blocks: where the long loop's last block and last stripe change shape."""
CHUNK_SIZES = sorted({k * CHUNK + d for k in (1, 2, 3) for d in (-65, -64, -1, 0, 1, 63, 64, 65)})
"""Lengths next to the fused copy's 512 KiB pieces, a last piece shorter than the last
stripe (which then reaches back into the piece before) among them."""
RANDOM_SIZES = [int(n) for n in np.random.default_rng(7).integers(241, 8 * MIB, 4)]
DATA = np.random.default_rng(0).bytes(8 * MIB + 16)
"""The bytes every test slices its inputs from."""


def _views(sizes: list[int], offset: int = 0) -> list[memoryview]:
    return [memoryview(DATA)[offset:offset + n] for n in sizes]


def _expected(buffers: list) -> list[int]:
    return [xxhash.xxh3_64_intdigest(bytes(memoryview(b).cast("B"))) for b in buffers]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_hash_many_equals_xxhash_for_every_length_up_to_two_blocks(kernel: str,
                                                                   threads: int) -> None:
    buffers = _views(list(range(2101)))
    assert streamcopy.hash_many(buffers, threads, kernel=kernel) == _expected(buffers)


@pytest.mark.parametrize("kernel", KERNELS)
def test_hash_many_equals_xxhash_around_stripe_block_and_chunk_boundaries(kernel: str) -> None:
    buffers = _views(BOUNDARY_SIZES + CHUNK_SIZES + RANDOM_SIZES)
    assert streamcopy.hash_many(buffers, 2, kernel=kernel) == _expected(buffers)


@pytest.mark.parametrize("offset", range(8))
@pytest.mark.parametrize("kernel", KERNELS)
def test_hash_many_equals_xxhash_at_every_start_offset(kernel: str, offset: int) -> None:
    buffers = _views([*range(0, 300), 1000, 1024, 1025, 4097, CHUNK + 1, MIB + 3], offset)
    assert streamcopy.hash_many(buffers, kernel=kernel) == _expected(buffers)


def test_hash_many_reads_numpy_arrays_and_tensor_views_of_every_dtype() -> None:
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((37, 11)).astype(dtype)
              for dtype in (np.float64, np.float32, np.float16)]
    arrays += [rng.integers(-100, 100, (3, 5, 7)).astype(dtype)
               for dtype in (np.int64, np.int32, np.int16, np.int8, np.uint8)]
    arrays.append(np.frombuffer(DATA[:4096], dtype=np.uint8))  # read-only is fine
    tensors = [torch.randn(300, 7), torch.randn(64, 65, dtype=torch.float64),
               torch.randn(1000).half(), torch.arange(5000), torch.zeros(0),
               torch.rand(999) > 0.5]
    views = [t.numpy() for t in tensors]
    views.append(torch.randn(513, 3).bfloat16().view(torch.int16).numpy())
    buffers = arrays + views
    assert streamcopy.hash_many(buffers, 3) == [xxhash.xxh3_64_intdigest(a.tobytes())
                                               for a in buffers]


def test_hash_many_of_no_buffers_is_an_empty_list() -> None:
    assert streamcopy.hash_many([]) == []
    assert streamcopy.hash_many((), 4) == []
    assert streamcopy.copy_hash_many([], [], 4) == []
    assert streamcopy.copy_many([], [], 4) is None


def test_hash_many_takes_more_threads_than_buffers_and_any_sequence() -> None:
    buffers = (b"a", bytearray(b"bc"), memoryview(DATA)[:5000])
    assert streamcopy.hash_many(buffers, threads=64) == _expected(list(buffers))


def test_default_kernel_is_the_last_and_fastest_this_cpu_runs() -> None:
    assert streamcopy.XXH3_KERNEL == KERNELS[-1]
    assert KERNELS[0] == "scalar"
    if streamcopy.NONTEMPORAL:  # an x86-64 build: SSE2 is part of x86-64 itself
        assert "sse2" in KERNELS
    buffers = _views([5000])
    assert streamcopy.hash_many(buffers) == streamcopy.hash_many(buffers, kernel=None)


def _copy_pairs(sizes: list[int], src_offset: int, dst_offset: int
                ) -> tuple[list[memoryview], list[memoryview], list[bytearray]]:
    """Sources sliced from DATA, and destinations at dst_offset into fresh bytearrays
    (their backing arrays returned as well, to check nothing outside dst is written)."""
    backing = [bytearray(n + dst_offset + 8) for n in sizes]
    dsts = [memoryview(b)[dst_offset:dst_offset + n] for b, n in zip(backing, sizes, strict=True)]
    return dsts, _views(sizes, src_offset), backing


def _assert_copied(dsts: list[memoryview], srcs: list[memoryview],
                   backing: list[bytearray], dst_offset: int) -> None:
    for dst, src, b in zip(dsts, srcs, backing, strict=True):
        assert dst == src
        assert not any(b[:dst_offset]) and not any(b[dst_offset + len(src):])


COPY_SIZES = [*range(0, 300), *BOUNDARY_SIZES[::7], *CHUNK_SIZES, RANDOM_SIZES[0]]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize(("src_offset", "dst_offset"), [(0, 0), (3, 0), (0, 5), (7, 1)])
def test_copy_many_copies_every_pair_byte_for_byte(src_offset: int, dst_offset: int,
                                                   threads: int) -> None:
    dsts, srcs, backing = _copy_pairs(COPY_SIZES, src_offset, dst_offset)
    assert streamcopy.copy_many(dsts, srcs, threads) is None
    _assert_copied(dsts, srcs, backing, dst_offset)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_copy_hash_many_copies_and_returns_the_digest_of_each_source(kernel: str,
                                                                    threads: int) -> None:
    dsts, srcs, backing = _copy_pairs(COPY_SIZES, 0, 0)
    assert streamcopy.copy_hash_many(dsts, srcs, threads, kernel=kernel) == _expected(srcs)
    _assert_copied(dsts, srcs, backing, 0)


@pytest.mark.parametrize(("src_offset", "dst_offset"),
                         [(s, d) for s in range(8) for d in (0, 3)])
def test_copy_hash_many_at_every_start_offset(src_offset: int, dst_offset: int) -> None:
    sizes = [*range(0, 260, 7), 1025, 4097, CHUNK - 1, CHUNK + 1, 2 * CHUNK + 65]
    dsts, srcs, backing = _copy_pairs(sizes, src_offset, dst_offset)
    assert streamcopy.copy_hash_many(dsts, srcs, 2) == _expected(srcs)
    _assert_copied(dsts, srcs, backing, dst_offset)


def test_copy_hash_many_into_numpy_and_tensor_views() -> None:
    srcs = [torch.randn(1000, 300), torch.arange(70000), torch.randn(33).half()]
    dsts = [torch.empty_like(t) for t in srcs]
    digests = streamcopy.copy_hash_many([d.numpy() for d in dsts], [s.numpy() for s in srcs])
    assert digests == [xxhash.xxh3_64_intdigest(s.numpy().tobytes()) for s in srcs]
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_views_are_released_after_success_and_after_an_error() -> None:
    # A bytearray cannot be resized while a view of it is held: each resize below would
    # raise BufferError if the call had kept one.
    dst, src = bytearray(10), bytearray(b"0123456789")
    streamcopy.copy_hash_many([dst], [src])
    dst.extend(b"x")
    src.extend(b"y")
    with pytest.raises(ValueError, match=r"dsts\[1\]"):
        streamcopy.copy_many([dst, bytearray(1)], [src, b"ab"])
    dst.extend(b"x")
    src.extend(b"y")
    with pytest.raises(TypeError, match=r"buffers\[1\]"):
        streamcopy.hash_many([src, None])
    src.extend(b"y")


NON_CONTIGUOUS = np.zeros((4, 4), dtype=np.float32)[:, ::2]


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: streamcopy.hash_many([b"a"], 0), ValueError,
     r"hash_many: threads is 0; expected at least 1"),
    (lambda: streamcopy.copy_hash_many([], [], -2), ValueError,
     r"copy_hash_many: threads is -2; expected at least 1"),
    (lambda: streamcopy.hash_many([b"a"], kernel="neon"), ValueError,
     r"hash_many: kernel 'neon' does not run on this CPU .*expected one of XXH3_KERNELS"),
    (lambda: streamcopy.hash_many(b"abc"), TypeError,
     r"hash_many: buffers is one buffer \(of type bytes\); expected a list of buffers"),
    (lambda: streamcopy.hash_many(5), TypeError,
     r"hash_many: buffers is of type int; expected a list or tuple of buffers"),
    (lambda: streamcopy.hash_many([b"a", b"b", 3]), TypeError,
     r"hash_many: buffers\[2\] gives no buffer \(of type int: .*\); expected bytes"),
    (lambda: streamcopy.hash_many([b"a", NON_CONTIGUOUS]), ValueError,
     r"hash_many: buffers\[1\] is not C-contiguous; expected a C-contiguous buffer"),
    (lambda: streamcopy.hash_many([torch.zeros(3, 4).T.numpy()]), ValueError,
     r"hash_many: buffers\[0\] is not C-contiguous"),
    (lambda: streamcopy.copy_many([bytearray(1)], [b"a", b"b"]), ValueError,
     r"copy_many: 1 dsts but 2 srcs; expected one dst per src"),
    (lambda: streamcopy.copy_hash_many([bytearray(1), bytearray(3)], [b"a", b"bb"]),
     ValueError,
     r"copy_hash_many: dsts\[1\] is 3 bytes but srcs\[1\] is 2; expected equal lengths"),
    (lambda: streamcopy.copy_many([bytearray(1), b"bb"], [b"a", b"bb"]), TypeError,
     r"copy_many: dsts\[1\] is read-only \(of type bytes\); expected a writable buffer"),
    (lambda: streamcopy.copy_hash_many([np.frombuffer(b"ab", np.uint8)], [b"ab"]), TypeError,
     r"copy_hash_many: dsts\[0\] is read-only \(of type numpy.ndarray\)"),
    (lambda: streamcopy.copy_many([memoryview(bytearray(8))[::2]], [b"abcd"]), ValueError,
     r"copy_many: dsts\[0\] is not C-contiguous"),
    (lambda: streamcopy.copy_hash_many([bytearray(4)], [NON_CONTIGUOUS[0]]), ValueError,
     r"copy_hash_many: srcs\[0\] is not C-contiguous"),
    (lambda: streamcopy.copy_many([bytearray(1), None], [b"a", b"b"]), TypeError,
     r"copy_many: dsts\[1\] gives no buffer \(of type NoneType"),
])
def test_bad_arguments_raise_an_error_that_names_the_item_and_what_was_expected(
        call, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        call()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=3000), max_size=12), st.sampled_from(THREADS),
       st.sampled_from(KERNELS))
def test_any_list_of_byte_strings_hashes_and_copies_as_xxhash_does(
        items: list[bytes], threads: int, kernel: str) -> None:
    expected = [xxhash.xxh3_64_intdigest(b) for b in items]
    assert streamcopy.hash_many(items, threads, kernel=kernel) == expected
    dsts = [bytearray(len(b)) for b in items]
    assert streamcopy.copy_hash_many(dsts, items, threads, kernel=kernel) == expected
    assert dsts == items
