"""The pure parts of two-level checkpointing across nodes: which ranks share a node and
where replicas go (`twolevel.memory.nodes`), the storage records of one commit across nodes
(`twolevel.persist.commit`), K_replica and the recovery source's name."""

from __future__ import annotations

import threading

import pytest

from moc.checkpoint.store.manifest import Entry
from moc.checkpoint.store.storage import open_storage
from moc.checkpoint.twolevel.memory.nodes import NodeLayout
from moc.checkpoint.twolevel.persist.commit import (
    BEGIN,
    Abandoned,
    clear_records,
    gather_parts,
    part_name,
    wait_begun,
    write_begin,
    write_part,
)
from moc.checkpoint.twolevel.recovery.memory import overall_source
from moc.checkpoint.twolevel.snapshot.sizing import parse_k_replica


def test_ranks_are_cut_into_nodes_and_replicas_go_jump_nodes_on():
    nodes = NodeLayout(world_size=6, per_node=2)
    assert nodes.n_nodes == 3
    assert [nodes.node(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [nodes.leader(n) for n in range(3)] == [0, 2, 4]
    assert [r for r in range(6) if nodes.is_leader(r)] == [0, 2, 4]
    assert [nodes.replica_dst(r, 1) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [nodes.replica_dst(r, 2) for r in range(6)] == [4, 5, 0, 1, 2, 3]
    for jump in (1, 2):  # replica_src inverts replica_dst, and never stays on the node
        for r in range(6):
            assert nodes.replica_src(nodes.replica_dst(r, jump), jump) == r
            assert nodes.node(nodes.replica_dst(r, jump)) != nodes.node(r)


def test_a_layout_that_keeps_replicas_at_home_or_uneven_nodes_is_refused():
    with pytest.raises(ValueError, match="replica jump 2 sends every node's replica to"):
        NodeLayout(4, 2).check_jump(2)
    NodeLayout(2, 2).check_jump(1)  # one node: no replicas are sent, nothing to refuse
    with pytest.raises(ValueError, match="every node must run the same number of ranks"):
        NodeLayout(5, 2)


def test_k_replica_accepts_all_an_integer_or_none():
    assert parse_k_replica(None, 8) == parse_k_replica("all", 8) == "all"
    assert parse_k_replica(8, 8) == parse_k_replica(20, 8) == "all"
    assert parse_k_replica(2, 8) == 2
    assert parse_k_replica("none", 8) == parse_k_replica(0, 8) == 0
    for bad in (-1, True, "two", 1.5):
        with pytest.raises(ValueError, match="k_replica must be"):
            parse_k_replica(bad, 8)


def test_the_recovery_source_names_the_farthest_tier_any_rank_needed():
    assert overall_source(["memory", "memory"]) == "memory"
    assert overall_source(["memory", "peer"]) == "peer"
    assert overall_source(["peer", "peer"]) == "peer"
    assert overall_source(["memory", "storage"]) == "mixed"
    assert overall_source(["peer", "storage"]) == "mixed"
    assert overall_source(["storage", "storage"]) == "storage"


def _entry(step: int, name: str) -> Entry:
    return Entry(step, name, "F32", (2, 3), 1234)


def test_node_0_gathers_every_part_of_this_job_and_clears_the_records(tmp_path):
    root = open_storage(tmp_path / "ckpt")
    root.begin(5)
    write_begin(root, 5, "job-a")
    wait_begun(root, 5, "job-a", 1.0, lambda: False)  # begun: returns at once
    # A part of an earlier job (another nonce) in the same directory is not this job's.
    write_part(root, 5, 1, "job-old", entries={"k": _entry(1, "rank-00002.safetensors")})
    with pytest.raises(RuntimeError, match=r"waited 0 s for the parts of nodes \[1\]"):
        gather_parts(root, 5, range(1, 2), "job-a", 0.2, lambda: False)
    write_part(root, 5, 1, "job-a", entries={"k": _entry(5, "rank-00002.safetensors")},
               files={"rank-00002.safetensors": 100}, held=["k", "j"],
               bytes_per_rank={2: 100, 3: 0})
    (part,) = gather_parts(root, 5, range(1, 2), "job-a", 1.0, lambda: False)
    assert part.entries == {"k": _entry(5, "rank-00002.safetensors")}
    assert part.files == {"rank-00002.safetensors": 100}
    assert part.held == ["k", "j"] and part.bytes_per_rank == {2: 100, 3: 0}
    clear_records(root, 5, range(1, 2))
    assert not (root.tmp_dir(5) / BEGIN).exists()
    assert not (root.tmp_dir(5) / part_name(1)).exists()


def test_a_failed_part_ends_node_0s_wait_with_that_nodes_error(tmp_path):
    root = open_storage(tmp_path / "ckpt")
    root.begin(7)
    write_part(root, 7, 2, "n", error="OSError: disk full")
    with pytest.raises(RuntimeError, match="node 2's persist of step 7 failed: OSError"):
        gather_parts(root, 7, range(1, 3), "n", 5.0, lambda: False)


def test_a_leader_never_overwrites_a_part_its_dead_process_had_written(tmp_path):
    root = open_storage(tmp_path / "ckpt")
    root.begin(3)
    write_part(root, 3, 1, "n", entries={"k": _entry(3, "f")})
    write_part(root, 3, 1, "n", error="the persist process exited", keep_existing=True)
    (part,) = gather_parts(root, 3, range(1, 2), "n", 1.0, lambda: False)
    assert part.error is None and "k" in part.entries
    # Node 0 never began step 4: nobody waits for its part, and none is written.
    write_part(root, 4, 1, "n", error="gone", keep_existing=True)
    assert not root.tmp_dir(4).exists()


def test_waits_end_when_the_persist_is_abandoned(tmp_path):
    root = open_storage(tmp_path / "ckpt")
    root.begin(9)
    abandoned = threading.Event()
    threading.Timer(0.1, abandoned.set).start()
    # Abandoned, not the RuntimeError of the 60 s timeout.
    with pytest.raises(Abandoned, match="node 0 to begin step 9"):
        wait_begun(root, 9, "n", 60.0, abandoned.is_set)
    with pytest.raises(Abandoned):
        gather_parts(root, 9, range(1, 2), "n", 60.0, abandoned.is_set)
