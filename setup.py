"""The one compiled part of moc: the snapshot's streaming copy (moc/checkpoint/twolevel/
streamcopy.c). Optional: where it cannot be built (no C compiler), the install goes on and
the snapshot copies with numpy (`moc.checkpoint.twolevel.slots.STREAMING`)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("moc.checkpoint.twolevel.streamcopy",
                             sources=["moc/checkpoint/twolevel/streamcopy.c"],
                             extra_compile_args=["-O2"], optional=True)])
