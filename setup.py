"""The one compiled part of moc: the snapshot's streaming copy and its XXH3 checksums
(moc/checkpoint/twolevel/memory/streamcopy.c, xxh3.h). Optional: where it cannot be built (no C
compiler), the install goes on and the snapshot copies with numpy and checksums with the
xxhash package (`moc.checkpoint.twolevel.memory.native.BATCHED`)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("moc.checkpoint.twolevel.memory.streamcopy",
                             sources=["moc/checkpoint/twolevel/memory/streamcopy.c"],
                             depends=["moc/checkpoint/twolevel/memory/xxh3.h"],
                             # -O3: the XXH3 kernels' stripe loops unrolled, accumulators
                             # kept in registers. -pthread: hash_many's native threads.
                             extra_compile_args=["-O3", "-pthread"],
                             extra_link_args=["-pthread"], optional=True)])
