"""The snapshot slots in shared memory: complete exactly when their header exists."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch
import xxhash

from moc.checkpoint import liveness
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.liveness import ProcessId
from moc.checkpoint.phases import Phases
from moc.checkpoint.twolevel.memory import native, places, slots
from moc.checkpoint.twolevel.memory.jobdir import OWNER, claim_job, job_dir, remove_stale_jobs
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
from moc.checkpoint.twolevel.snapshot.capture import HostCopy, capture, seal, write_snapshot
from tests.fs import fill, tmpfs
from tests.procs import UNSHARE_PIDS, can_unshare_pids, dead_pid


def _state() -> dict[str, torch.Tensor]:
    base = torch.randn(4, 3)
    return {"a": base[1], "b": torch.randn(5).bfloat16(), "step": torch.tensor(7.0),
            "mask": torch.tensor([True, False]), "ids": torch.arange(3)}


def test_snapshot_round_trips_every_dtype_and_reuses_its_mapping():
    store = SnapshotStore("job", rank=0)
    state = _state()
    write_snapshot(store, 0, 10, state, {"extra": 1})
    first = store._maps[0]
    headers = store.headers()
    assert list(headers) == [0] and headers[0].step == 10 and headers[0].meta == {"extra": 1}
    got = SnapshotStore("job", rank=0).read(0, headers[0])  # a restarted process
    for k, t in state.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    write_snapshot(store, 0, 20, state, {})
    assert store._maps[0] is first  # warm: no new allocation


def test_the_first_copy_reserves_every_free_slot_but_leaves_a_snapshot_alone():
    old = SnapshotStore("job", rank=0)
    write_snapshot(old, 2, 5, {"x": torch.arange(3)}, {})  # a recovery source of another size
    old_bytes = old.bin_path(2).read_bytes()
    store = SnapshotStore("job", rank=0)
    write_snapshot(store, 0, 10, _state(), {})
    size = store.bin_path(0).stat().st_size
    assert store.bin_path(1).stat().st_size == size  # reserved up front, not when needed
    assert store.bin_path(2).read_bytes() == old_bytes and 2 in store.headers()
    assert 1 not in store.headers()  # reserved is not complete


def test_a_slot_is_not_a_snapshot_until_its_header_is_written(monkeypatch):
    store = SnapshotStore("job", rank=0)
    write_snapshot(store, 1, 10, _state(), {})
    assert 1 in store.headers()
    # While slot 1 is overwritten its header is gone: a crash mid-copy leaves no snapshot.

    def crash_mid_copy(dsts, srcs, threads=1):  # the first tensor copied, then killed
        native.copy_all(dsts[:1], srcs[:1])
        raise RuntimeError("killed")

    monkeypatch.setattr(native, "copy_and_digest", crash_mid_copy)
    with pytest.raises(RuntimeError, match="killed"):
        write_snapshot(store, 1, 20, _state(), {})
    monkeypatch.undo()
    assert 1 not in store.headers()


def test_a_captured_snapshot_is_no_snapshot_until_it_is_sealed():
    """Captured (every byte landed) is not sealed: until the header is published the
    slot is no recovery source, and the sealed snapshot of another slot stays the
    newest. The seal then takes the checksums the copy did not."""
    store = SnapshotStore("job", rank=0)
    write_snapshot(store, 0, 10, _state(), {})
    state = {"w": torch.randn(300), "b": torch.randn(7).bfloat16()}
    got = capture(store, HostCopy(fused=False), 1, 20, state)
    assert got.digests is None and got.nbytes == 300 * 4 + 7 * 2
    assert {s: h.step for s, h in store.headers().items()} == {0: 10}
    header = seal(store, got, {"m": 1})
    assert {s: h.step for s, h in store.headers().items()} == {0: 10, 1: 20}
    for key, t in state.items():
        want = xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).numpy().tobytes())
        assert header.entries[key].crc == want, key


def test_a_flipped_byte_in_memory_is_detected():
    store = SnapshotStore("job", rank=0)
    header = write_snapshot(store, 0, 10, {"w": torch.ones(64)}, {})
    raw = bytearray(store.bin_path(0).read_bytes())
    raw[5] ^= 0xFF
    store.bin_path(0).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch for 'w'"):
        SnapshotStore("job", rank=0).read(0, header)


def test_stale_jobs_of_dead_owners_are_removed_but_not_ours_or_live_ones():
    for job, pid in (("dead", 2**22 + 12345), ("alive", os.getpid()), ("ours", 2**22 + 1)):
        job_dir(job).mkdir(parents=True)
        (job_dir(job) / "owner.pid").write_text(str(pid))
    removed = remove_stale_jobs(keep="ours")
    assert [p.name for p in removed] == ["moc-dead"]
    assert job_dir("alive").exists() and job_dir("ours").exists()


def _own(job: str, **fields) -> None:
    """Plant an owner record, as another process would have written it."""
    job_dir(job).mkdir(parents=True)
    (job_dir(job) / OWNER).write_text(json.dumps(
        {**ProcessId.of(os.getpid()).to_json(), **fields}))


def test_an_owner_is_gone_only_when_that_can_be_proven():
    dead, me = dead_pid(), ProcessId.of(os.getpid())
    _own("dead", pid=dead)
    _own("reused", started=me.started - 1)  # this pid, but another process started it
    _own("rebooted", pid=dead, boot_id="00000000-0000-0000-0000-000000000000")
    _own("alive")
    _own("container", pid=dead, pid_ns="pid:[1]")  # its pids are not visible here
    _own("older-moc", pid=dead, boot_id=None, pid_ns=None, started=None)
    removed = remove_stale_jobs(keep="ours")
    assert sorted(p.name for p in removed) == ["moc-dead", "moc-rebooted", "moc-reused"]
    assert {p.name for p in job_dir("x").parent.iterdir()} == {
        "moc-alive", "moc-container", "moc-older-moc"}


def test_our_pid_in_another_namespace_is_not_our_job():
    """A container's owner record can carry this process's pid number: it is still
    another process's job."""
    _own("theirs", pid=os.getpid(), pid_ns="pid:[1]")
    with pytest.raises(CheckpointError, match="another PID namespace"):
        claim_job("theirs")
    _own("ours")  # the same pid in this namespace: this process, a second engine
    claim_job("ours")


def test_an_owner_that_exited_unreaped_is_gone():
    """A zombie (exited, its parent has not waited for it yet) keeps its pid and start
    time but runs nothing: its record is stale."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        record = ProcessId.of(child.pid)
        for _ in range(200):
            if liveness.is_zombie(child.pid):
                break
            time.sleep(0.05)
        assert liveness.is_zombie(child.pid)
        assert record.gone(this_machine=True) is True
    finally:
        child.wait()
    assert record.gone(this_machine=True) is True  # reaped: the pid is absent
    assert ProcessId.of(os.getpid()).gone(this_machine=True) is False


HOLD_JOB = """
import sys, time
from moc.checkpoint.twolevel.memory.jobdir import claim_job
claim_job(sys.argv[1])
print("claimed", flush=True)
time.sleep(120)
"""

CLAIM = """
import sys
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.twolevel.memory.jobdir import claim_job, remove_stale_jobs
print("removed", [p.name for p in remove_stale_jobs(keep=sys.argv[1])])
try:
    claim_job(sys.argv[1])
except CheckpointError as e:
    print("refused:", e)
else:
    print("claimed")
"""


def _claim(job: str, *prefix: str) -> list[str]:
    r = subprocess.run([*prefix, sys.executable, "-c", CLAIM, job], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


@pytest.mark.parametrize("where", [
    "this-namespace",
    pytest.param("another-pid-namespace", marks=pytest.mark.skipif(
        not can_unshare_pids(), reason="needs unshare(1) with user namespaces")),
])
def test_a_live_jobs_memory_is_neither_removed_nor_claimed_by_another_job(where):
    """The attacks: a second job given the same job id, and a job in a container that
    shares /dev/shm (`--ipc=host`) but not the PID namespace, where the live owner's pid
    does not exist. Before, the first overwrote the owner and shared the slots; the
    second removed the live job's directory as stale at its start."""
    prefix = UNSHARE_PIDS if where != "this-namespace" else ()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_JOB, "live"], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "claimed"
        owner = (job_dir("live") / OWNER).read_text()
        out = _claim("live", *prefix)
        assert out[0] == "removed []"
        assert out[1].startswith("refused: the shared memory of job 'live'")
        assert f"pid {holder.pid}" in out[1] or where != "this-namespace"
        assert ("another PID namespace" in out[1]) == (where != "this-namespace")
        assert (job_dir("live") / OWNER).read_text() == owner
        assert _claim("other", *prefix) == ["removed []", "claimed"]
        assert job_dir("live").is_dir()
    finally:
        holder.kill()
        holder.wait()
    if where == "this-namespace":  # its owner gone: a restart of that job claims it
        assert _claim("live") == ["removed ['moc-other']", "claimed"]


def test_a_full_shared_memory_is_a_clear_error_not_a_crash(monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.posix_fallocate", no_space)
    with pytest.raises(CheckpointError, match=r"cannot reserve .* shared memory"):
        write_snapshot(SnapshotStore("job", 0), 0, 1, {"w": torch.ones(1000)}, {})


# -- who may write the job's directory (docs/THREAT_MODEL.md) --------------------------


def test_a_new_job_directory_and_its_files_are_this_users_alone():
    claim_job("mine")
    write_snapshot(SnapshotStore("mine", 0), 0, 1, {"w": torch.ones(3)}, {})
    jdir = job_dir("mine")
    assert stat.S_IMODE(jdir.stat().st_mode) == 0o700
    assert stat.S_IMODE((jdir / "rank-00000").stat().st_mode) == 0o700
    for f in (OWNER, "rank-00000/slot-0.bin", "rank-00000/slot-0.json"):
        assert stat.S_IMODE((jdir / f).stat().st_mode) == 0o600, f


def _plant(how: str, tmp_path) -> None:
    jdir = job_dir("planted")
    jdir.parent.mkdir(parents=True, exist_ok=True)
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        jdir.symlink_to(tmp_path / "elsewhere")
        return
    jdir.mkdir()
    if how == "writable":
        jdir.chmod(0o777)
    elif how == "foreign":
        os.chown(jdir, 65534, 65534)  # nobody
        jdir.chmod(0o700)


@pytest.mark.parametrize(("how", "problem"), [
    ("writable", r"is writable by group or others \(mode 777\)"),
    ("symlink", r"is a symbolic link"),
    pytest.param("foreign", r"is owned by uid 65534, not by this user", marks=pytest.mark.skipif(
        os.getuid() != 0, reason="planting another user's directory needs root")),
])
def test_a_planted_job_directory_is_refused_by_every_process_that_uses_it(tmp_path, how,
                                                                          problem):
    _plant(how, tmp_path)
    pattern = rf"refusing the snapshot directory .*moc-planted: it {problem}.*rm -rf"
    with pytest.raises(CheckpointError, match=pattern):
        claim_job("planted")  # rank 0
    with pytest.raises(CheckpointError, match=pattern):
        write_snapshot(SnapshotStore("planted", 1), 0, 1, {"w": torch.ones(3)}, {})  # a writer
    (job_dir("planted") / "rank-00001").mkdir(exist_ok=True)
    with pytest.raises(CheckpointError, match=pattern):
        SnapshotStore("planted", 1).headers()  # a reader (restore, the persist process)


def test_a_world_writable_shm_root_without_the_sticky_bit_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "loose"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("MOC_SHM_ROOT", str(root))
    with pytest.raises(CheckpointError, match=r"shared-memory root .*loose: anyone may write"):
        claim_job("job")
    root.chmod(0o1777)  # as /dev/shm: sticky
    claim_job("job")


# -- issue 15: checksums while copying, phases, readers that keep their mappings


COPIES = [pytest.param(HostCopy(fused=True), id="fused"),
          pytest.param(HostCopy(fused=False), id="copy-then-seal"),
          pytest.param(HostCopy(threads=3), id="fused-3-threads")]


@pytest.mark.parametrize("python", [False, True], ids=["native", "python"])
@pytest.mark.parametrize("copier", COPIES)
def test_the_checksum_of_a_snapshot_is_the_xxh3_of_each_tensor(monkeypatch, copier, python):
    """Tensors over several copy chunks, a non-contiguous one, an empty one, bfloat16:
    each entry's digest is the XXH3-64 of exactly its bytes, as xxhash computes it in
    one call (a digest continued wrongly across chunks, or over the wrong bytes,
    fails), whether the copy takes it on the way or the seal after, natively or in
    Python (a build without the C extension)."""
    if python:
        monkeypatch.setattr(native, "BATCHED", False)
        monkeypatch.setattr(native, "COPY_CHUNK", 64)
    state = {"big": torch.randn(300_000), "t": torch.randn(30, 20).t(),
             "empty": torch.empty(0), "odd": torch.arange(37, dtype=torch.int16),
             "half": torch.randn(1001).bfloat16()}
    store = SnapshotStore("job", rank=0)
    phases = Phases()
    got = capture(store, copier, 0, 3, state, phases=phases)
    header = seal(store, got, {}, phases=phases)
    for key, t in state.items():
        want = xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).numpy().tobytes())
        assert header.entries[key].crc == want, key
    read = store.read(0, header)  # verify=True checks the same digests
    assert all(torch.equal(read[k], t) for k, t in state.items())
    assert {"reserve", "copy", "checksum", "header"} <= set(phases.wall)
    assert phases.cpu["copy"] > 0


@pytest.mark.parametrize("tag", [None, "crc32c", "crc32"])
def test_a_header_of_another_checksum_is_no_snapshot(tag):
    """A slot an older moc left in memory (CRC32Cs, or zlib CRC32s with no
    "checksum" tag) is not a recovery source: this one cannot verify it."""
    store = SnapshotStore("job", rank=0)
    write_snapshot(store, 0, 3, {"x": torch.arange(4)}, {})
    d = json.loads(store.header_path(0).read_text())
    assert d["checksum"] == "xxh3"
    if tag is None:
        del d["checksum"]
    else:
        d["checksum"] = tag
    store.header_path(0).write_text(json.dumps(d))
    assert store.headers() == {} and store.header(0) is None


def test_a_flipped_byte_in_a_slot_fails_its_digest():
    """verify=True reads every byte again: one flipped bit of one tensor is refused."""
    store = SnapshotStore("job", rank=0)
    state = {"x": torch.randn(5000), "y": torch.randn(7)}
    header = write_snapshot(store, 0, 3, state, {})
    buf = store._map(0, store.bin_path(0).stat().st_size)
    buf[header.entries["x"].offset + 4093] ^= 0x10
    with pytest.raises(CheckpointError, match="checksum mismatch for 'x'"):
        store.read(0, header)
    assert torch.equal(store.read(0, header, keys=["y"])["y"], state["y"])  # the rest is fine


def test_a_reader_maps_a_replaced_slot_file_afresh():
    """The persist process keeps its mappings; a slot file replaced meanwhile (same
    size, new file) must be read from the new file, not from the old mapping."""
    writer, reader = SnapshotStore("job", rank=0), SnapshotStore("job", rank=0)
    first = write_snapshot(writer, 0, 1, {"x": torch.zeros(256)}, {})
    assert torch.equal(reader.read(0, first)["x"], torch.zeros(256))
    writer.release()
    writer.bin_path(0).unlink()
    again = write_snapshot(SnapshotStore("job", rank=0), 0, 2, {"x": torch.ones(256)}, {})
    assert torch.equal(reader.read(0, again)["x"], torch.ones(256))


@pytest.mark.skipif(not native.BATCHED, reason="no C extension in this build")
def test_the_native_copies_write_exactly_the_bytes_the_python_copy_writes(monkeypatch):
    """Streaming stores need a 16-byte aligned destination, so the copy splits each
    tensor into a head, 64-byte blocks and a tail: offsets 8 bytes off alignment and
    sizes around every boundary must come out byte for byte as the Python fallback's,
    with the same digests, and write nothing outside them."""
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 7, 15, 16, 17, 63, 64, 65, 127, 1000, 4097, 10_001, (512 << 10) + 3]
    state = {f"t{n}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
             for n in sizes}
    offsets, size = places.slot_layout(state)
    assert any(off % 16 == 8 for off in offsets.values())  # a head to copy, not only blocks
    out = {}
    for batched in (True, False):
        monkeypatch.setattr(native, "BATCHED", batched)
        buf = torch.full((size + 64,), 0xA5, dtype=torch.uint8)  # 64 guard bytes after
        dsts = [buf[offsets[k]:offsets[k] + t.numel()].numpy() for k, t in state.items()]
        out[batched] = (buf, native.copy_and_digest(dsts, [t.numpy() for t in state.values()]))
    (fast, fast_digests), (slow, slow_digests) = out[True], out[False]
    assert torch.equal(fast, slow)
    assert fast_digests == slow_digests
    assert torch.all(fast[size:] == 0xA5)
    for key, t in state.items():
        assert torch.equal(fast[offsets[key]:offsets[key] + t.numel()], t), key


@pytest.mark.skipif(not native.STREAMING, reason="no streaming copy in this build")
def test_the_streaming_copy_refuses_buffers_it_cannot_copy_exactly():
    """Lengths that differ, a read-only destination, a strided buffer: each is refused
    with what was expected, never copied in part."""
    from moc.checkpoint.twolevel.memory import streamcopy
    dst, src = bytearray(10), bytes(range(10))
    with pytest.raises(ValueError, match="dst is 9 bytes but src is 10"):
        streamcopy.copy(memoryview(dst)[:9], src)
    with pytest.raises(TypeError):
        streamcopy.copy(src, bytes(10))
    with pytest.raises((ValueError, BufferError, TypeError)):
        streamcopy.copy(memoryview(dst)[::2], src[:5])
    assert dst == bytearray(10)
    streamcopy.copy(dst, src)
    assert dst == bytearray(src)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64")
                    or not (shutil.which("cc") or shutil.which("gcc")),
                    reason="the streaming copy is built on x86-64 with a C compiler")
def test_the_streaming_copy_is_built_where_it_can_be():
    """setup.py builds the extension as optional, so a failed build would silently fall
    back to numpy's copy: where a compiler is there, the build must have worked."""
    assert native.STREAMING and native.BATCHED, (
        "moc.checkpoint.twolevel.memory.streamcopy did not build: run "
                             "`pip install -e .` and read its compiler errors")


# -- issue 29: a shared memory that fills up (items 7 and 16) -------------------------------


def _sparse(store: SnapshotStore) -> list[str]:
    """Slot files longer than the memory they hold: a store into one kills the writer
    with SIGBUS when the file system is full."""
    return [p.name for p in map(store.bin_path, range(store.n_slots))
            if p.exists() and p.stat().st_blocks * 512 < p.stat().st_size]


@pytest.mark.integration
def test_a_failed_reservation_leaves_no_sparse_slot_and_a_later_one_with_room_works(
        tmp_path, monkeypatch):
    """A real 1 MB tmpfs: the slot being written fits, the second spare one does not.
    Before, the failed posix_fallocate left that slot's file sized but holding nothing,
    and the next process mapped it as reserved (SIGBUS in the next test)."""
    state = {"w": torch.ones(100_000)}  # 400 kB: a slot of 0.47 MB
    with tmpfs(tmp_path / "small", "1m") as root:
        monkeypatch.setenv("MOC_SHM_ROOT", str(root))
        store = SnapshotStore("job", 0)
        with pytest.raises(CheckpointError, match=r"cannot reserve [0-9.]+ MB .*No space left.*"
                                                  r"MOC_SHM_ROOT at a larger tmpfs"):
            write_snapshot(store, 0, 1, state, {})
        assert _sparse(store) == []
        assert store.headers() == {}
        store.release()
        subprocess.run(["mount", "-o", "remount,size=4m", str(root)], check=True)
        again = SnapshotStore("job", 0)  # a restarted process, now with room
        header = write_snapshot(again, 0, 2, state, {})
        assert torch.equal(again.read(0, header)["w"], state["w"])
        assert _sparse(again) == [] and all(again.bin_path(s).exists() for s in range(3))


WRITE_SNAPSHOT = """
import sys, torch
from moc.checkpoint.errors import CheckpointError
from moc.checkpoint.twolevel.memory import native
from moc.checkpoint.twolevel.snapshot.capture import HostCopy, capture, seal, write_snapshot
from moc.checkpoint.twolevel.memory.slots import SnapshotStore
try:
    write_snapshot(SnapshotStore("job", 0), 0, 1, {"w": torch.ones(int(sys.argv[1]))}, {})
except CheckpointError as e:
    print("refused:", e)
else:
    print("written")
"""


@pytest.mark.integration
def test_a_slot_file_that_holds_no_memory_is_reserved_before_it_is_written(tmp_path):
    """Slot files of the right length holding no pages (what a failed reservation left
    before, or a writer killed between sizing and reserving), on a full tmpfs: a new
    writer must fail with a clear error, where it died of SIGBUS (exit -7)."""
    n = 100_000
    with tmpfs(tmp_path / "shm", "2m") as root:
        env = {**os.environ, "PYTHONPATH": os.getcwd(), "MOC_SHM_ROOT": str(root)}
        store = SnapshotStore("job", 0)
        store._secure(create=True)
        for slot in range(store.n_slots):
            with open(store.bin_path(slot), "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.truncate(slots.slot_capacity(4 * n))  # sized, nothing reserved
        assert len(_sparse(store)) == store.n_slots
        fill(root)
        r = subprocess.run([sys.executable, "-c", WRITE_SNAPSHOT, str(n)], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
        assert r.stdout.startswith("refused: cannot reserve 0.5 MB for a snapshot in ")
        assert "No space left on device" in r.stdout
        assert "slot-0.bin" not in _sparse(store)  # the one it tried: emptied, not left so
        (root / "filler").unlink()  # room again: the next writer reserves and writes
        r = subprocess.run([sys.executable, "-c", WRITE_SNAPSHOT, str(n)], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.stdout.strip() == "written", r.stderr[-2000:]
        assert _sparse(store) == []


@pytest.mark.integration
def test_a_full_shared_memory_at_the_claim_is_one_clear_line_and_leaves_nothing(
        tmp_path, monkeypatch):
    """/dev/shm full before the job starts: before, claim_job raised a raw OSError and
    left an empty job directory (with owner.json.tmp) behind."""
    with tmpfs(tmp_path / "shm", "1m") as root:
        monkeypatch.setenv("MOC_SHM_ROOT", str(root))
        claim_job("restarted")  # a job that restarts later, with a snapshot to keep
        write_snapshot(SnapshotStore("restarted", 0), 0, 5, {"w": torch.ones(3)}, {})
        fill(root)
        with pytest.raises(CheckpointError) as e:
            claim_job("new")
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"cannot claim the shared memory of job 'new' in {root}: "
                                  "No space left on device; free some")
        assert "MOC_SHM_ROOT at a larger tmpfs" in message
        assert not job_dir("new").exists()
        assert sorted(p.name for p in root.iterdir()) == ["filler", "moc-restarted"]
        with pytest.raises(CheckpointError, match="cannot claim the shared memory of job"):
            claim_job("restarted")
        assert 0 in SnapshotStore("restarted", 0).headers()  # the snapshot is kept
        assert not list(job_dir("restarted").glob("*.tmp"))


class _Cudart:
    """CUDA's host registration as a CPU machine can observe it: which mappings were
    pinned (by address and length) and unpinned. The one stand-in of this file: there is
    no CUDA runtime here, and what is checked is which memory moc asks it to pin."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        assert ptr not in self.pinned, "pinned twice"
        self.pinned[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.pinned[ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch) -> _Cudart:
    runtime = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return runtime


def test_a_slot_read_by_a_restore_is_pinned_before_the_next_capture_into_it(cudart):
    """A restore from memory maps a slot to read it (unpinned: it only reads); the next
    capture into that slot must go into pinned memory, or every device-to-host copy
    into it from then on is pageable (13 against 55 GB/s on an H200), silently."""
    gpu = torch.device("cuda", 0)
    state = _state()
    before = SnapshotStore("job", rank=0, pin=gpu)
    write_snapshot(before, 0, 10, state, {})
    write_snapshot(before, 1, 20, state, {})
    before.release()
    assert not cudart.pinned
    store = SnapshotStore("job", rank=0, pin=gpu)  # the restarted process
    headers = store.headers()
    store.read(1, headers[1])  # the restore reads the newest snapshot
    assert not cudart.pinned
    size = places.slot_layout(state)[1]
    store.prepare(size)  # the engine's, after the first optimizer step
    for slot in range(slots.N_SLOTS):  # every slot mapped, and every one pinned
        buf = store._maps[slot]
        assert cudart.pinned.get(buf.data_ptr()) == buf.numel(), slot
    assert store.pinned is True
    assert [h.step for h in store.headers().values()] == [10, 20]  # pinning wrote nothing
    for slot in (1, 0, 2):  # the captures that follow, the restored slot first
        write_snapshot(store, slot, 30 + slot, state, {})
        buf = store._maps[slot]
        assert cudart.pinned.get(buf.data_ptr()) == buf.numel(), slot
    assert store.pinned is True
    store.release()
    assert not cudart.pinned


def test_a_reader_mapping_is_pinned_when_a_capture_takes_it_without_a_prepare(cudart):
    """The same without the engine's preparation: the capture itself pins it."""
    gpu = torch.device("cuda", 0)
    before = SnapshotStore("job", rank=0, pin=gpu)
    write_snapshot(before, 0, 10, _state(), {})
    before.release()
    store = SnapshotStore("job", rank=0, pin=gpu)
    store.read(0, store.headers()[0])
    write_snapshot(store, 0, 20, _state(), {})
    buf = store._maps[0]
    assert cudart.pinned.get(buf.data_ptr()) == buf.numel()
    assert store.pinned is True
