"""`moc bench overhead`'s table, picture and disk probes (the strategies' runs are the
benchmark itself, not a test)."""

from __future__ import annotations

import pytest
import torch

from moc.bench.overhead import (
    copy_cpu_bandwidth,
    disk_read_bandwidth,
    disk_write_bandwidth,
    markdown,
    plot,
    thread_memcpy_bandwidth,
)


def _figures(stall: float | None, mean: float, **more: float) -> dict:
    keys = ("stall_p90_s", "step_time_s", "step_time_ckpt_s", "bytes_per_ckpt", "imbalance",
            "persist_s", "persist_fraction_of_disk", "restore_storage_s", "restore_memory_s",
            "peak_host_mem_bytes", "snapshot_bytes")
    return {**dict.fromkeys(keys), "stall_median_s": stall, "mean_step_time_s": mean,
            "mean_step_time_steady_s": mean, **more}


def _result() -> dict:
    return {"config": {"preset": "bench", "nproc": 2, "interval": 5},
            "limits": {"memcpy_Bps": 2e10, "thread_memcpy_Bps": 1e10},
            "strategies": {"none": _figures(None, 1.0, cpu_per_step_s=1.5),
                           "blocking": _figures(0.5, 1.25, bytes_per_ckpt=4e8),
                           "moc": _figures(0.005, 1.05, peak_host_mem_bytes=3e8,
                                           snapshot_bytes=1e8, copy_Bps=4e9, copy_cpu_Bps=6e9,
                                           k_snapshot=16,
                                           snapshot_cpu_s=0.04, persist_cpu_s=0.05,
                                           cpu_per_step_s=1.6)}}


def test_table_gives_ratios_against_blocking_and_no_checkpoints():
    lines = markdown(_result()).splitlines()
    moc = next(line for line in lines if line.startswith("| moc |"))
    cells = [c.strip() for c in moc.strip("|").split("|")]
    assert cells[1] == "-"  # a result without checkpoint counts (older ones)
    assert cells[4] == "0.0100"  # stall vs blocking
    assert cells[7] == "0.952" and cells[8] == "0.952"  # throughput, all and steady
    assert cells[-1] == "300 MB = 3.00 snapshots"
    assert "| 400.0 MB |" in next(line for line in lines if line.startswith("| blocking |"))


def test_the_cost_table_gives_copy_bandwidth_against_memcpy_and_cpu_per_checkpoint():
    result = _result()
    result["strategies"]["tight"] = {**result["strategies"]["moc"], "k_snapshot": 7,
                                     "k_snapshot_reason": "the copy takes too long"}
    lines = markdown(result).splitlines()
    moc = [line for line in lines if line.startswith("| moc |")][-1]
    cells = [c.strip() for c in moc.strip("|").split("|")]
    # Against one thread's memcpy (a rank copies on one thread), wall and CPU.
    assert cells[1:] == ["16", "4.00 GB/s", "6.00 GB/s", "0.40 / 0.60", "0.0400 s",
                         "0.0500 s", "1.6000 s", "+0.1000 s"]
    assert "- tight: K_snapshot < N because the copy takes too long" in lines
    # A result written before the one-thread figure: against the all-threads memcpy.
    del result["limits"]["thread_memcpy_Bps"]
    moc = [line for line in markdown(result).splitlines() if line.startswith("| moc |")][-1]
    assert "| 0.20 / 0.30 |" in moc


def test_copy_cpu_bandwidth_is_the_copy_over_its_own_cpu_seconds():
    # 1 GB copied in 0.5 s of wall time, of which 0.25 s on a core: 4 GB/s of CPU time.
    event = {"copy_Bps": 2e9, "phases": {"snapshot": {"plan": [0.1, 0.1, 0],
                                                      "copy": [0.5, 0.25, 0]}}}
    assert copy_cpu_bandwidth(event) == pytest.approx(4e9)
    gpu = {"copy_Bps": 2e9, "phases": {"snapshot": {"copy": [0.3, 0.05, 0],
                                                    "checksum": [0.2, 0.2, 0]}}}
    assert copy_cpu_bandwidth(gpu) == pytest.approx(4e9)
    assert copy_cpu_bandwidth({"copy_Bps": None, "phases": {}}) is None
    assert copy_cpu_bandwidth({"step": 3}) is None  # a strategy without snapshots


def test_thread_memcpy_measures_something():
    assert thread_memcpy_bandwidth(8 << 20) > 0


def test_picture_is_a_png(tmp_path):
    plot(_result(), tmp_path / "o.png")
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"


def test_disk_probes_measure_something_and_clean_up(tmp_path):
    assert disk_write_bandwidth(tmp_path, 16 << 20) > 0
    assert disk_read_bandwidth(tmp_path, 16 << 20) > 0
    assert list(tmp_path.iterdir()) == []


def test_publish_prints_the_tables_and_writes_what_was_asked(tmp_path, capsys):
    import json

    from moc.bench.plots import publish

    drawn = []
    publish("moc bench overhead", [("config", "bench")], markdown(_result()), _result(),
            tmp_path / "r.json", tmp_path / "r.png", drawn.append)
    out = capsys.readouterr().out
    assert out.startswith("moc bench overhead") and "| moc |" in out
    assert json.loads((tmp_path / "r.json").read_text())["config"]["preset"] == "bench"
    assert drawn == [tmp_path / "r.png"]
    publish("t", [("a", "b")], "", {}, None, None, drawn.append)  # nothing asked
    assert drawn == [tmp_path / "r.png"]


def test_across_nodes_the_table_gains_the_peer_tier_and_moc_peers_needs_nodes():
    import pytest

    from moc.bench.overhead import main

    result = _result()
    result["strategies"]["moc-peers"] = _figures(
        0.006, 1.06, replica_bytes_per_rank=2.5e7, replica_s=0.4, restore_peer_s=0.2)
    lines = markdown(result).splitlines()
    assert lines[0].endswith("replica/ckpt/rank | replica time | restore peer |")
    peers = next(line for line in lines if line.startswith("| moc-peers |"))
    assert peers.endswith("| 25.0 MB | 0.4000 s | 0.2000 s |")
    moc = next(line for line in lines if line.startswith("| moc |"))
    assert moc.endswith("| - | - | - |")  # measured without replicas: none to show
    assert "replica" not in markdown(_result())  # one node: no peer columns
    with pytest.raises(SystemExit):
        main(["--strategies", "moc-peers"])  # one node has no peer to replicate to


def test_paired_blocks_split_a_run_into_steps_with_and_without_checkpoints():
    from moc.bench.overhead import paired_steps
    from moc.train.config import TrainConfig

    cfg = TrainConfig(ckpt_interval=1, ckpt_blocks=3)
    assert [s for s in range(1, 13) if cfg.checkpoints_at(s)] == [3, 4, 5, 9, 10, 11]
    cfg = TrainConfig(ckpt_interval=2, ckpt_blocks=4)  # the interval still applies
    assert [s for s in range(1, 17) if cfg.checkpoints_at(s)] == [4, 6, 12, 14]
    assert [s for s in range(1, 7) if TrainConfig(ckpt_interval=2).checkpoints_at(s)] == [
        2, 4, 6]
    # Each block's first step carries the previous block's regime; the warm-up is cut.
    times = {s: float(s) for s in range(1, 13)}
    on, off = paired_steps(times, 3, after=2)
    assert on == [4.0, 5.0, 10.0, 11.0] and off == [7.0, 8.0]
    with pytest.raises(ValueError, match="--ckpt-blocks must be >= 0"):
        TrainConfig(ckpt_blocks=-1)


def test_paired_throughput_gets_its_own_column_when_measured():
    result = _result()
    result["strategies"]["moc"].update(paired_on_s=1.0, paired_off_s=0.96,
                                       paired_throughput=0.96, paired_steps=40)
    result["strategies"]["none"].update(paired_on_s=1.0, paired_off_s=1.0, paired_steps=40)
    lines = markdown(result).splitlines()
    assert "| throughput | steady | paired | bytes/ckpt |" in lines[0]
    assert lines[1].count("---:") == 16
    cells = [c.strip() for c in next(line for line in lines
                                     if line.startswith("| moc |")).strip("|").split("|")]
    assert cells[7:10] == ["0.952", "0.952", "0.960"]
    none = next(line for line in lines if line.startswith("| none |"))
    assert [c.strip() for c in none.strip("|").split("|")][9] == "-"
    assert "paired" not in markdown(_result()).splitlines()[0]


@pytest.mark.parametrize("args", [["--paired", "1"], ["--paired", "-3"],
                                  ["--paired", "5", "--interval", "5"]])
def test_paired_blocks_must_hold_checkpoints_after_their_first_step(args, capsys):
    from moc.bench.overhead import main

    with pytest.raises(SystemExit):
        main(["--strategies", "none", *args])
    assert "--paired" in capsys.readouterr().err


def test_recovery_figures_keep_restore_and_downtime_per_source():
    from moc.bench.overhead import recovery_figures

    assert recovery_figures([]) == {
        "restore_memory_s": None, "restore_storage_s": None, "restore_peer_s": None,
        "downtime_memory_s": None, "downtime_storage_s": None, "downtime_peer_s": None,
        "recovery_kind": None}
    got = recovery_figures([
        {"source": "memory", "recovery_s": 0.2, "downtime_s": 4.9, "kind": "restart"},
        {"source": "mixed", "recovery_s": 0.3, "downtime_s": 5.5, "kind": "restart"},
        # Written before the downtime was logged: no downtime, the restore still counts.
        {"source": "storage", "recovery_s": 0.4}])
    assert (got["restore_memory_s"], got["downtime_memory_s"]) == (0.2, 4.9)
    assert (got["restore_storage_s"], got["downtime_storage_s"]) == (0.4, None)
    assert got["restore_peer_s"] is None and got["recovery_kind"] == "restart"


def test_the_table_shows_the_downtime_only_when_measured():
    result = _result()
    assert "downtime" not in markdown(result)  # older results: no column
    result["strategies"]["moc"].update(downtime_memory_s=4.9, recovery_kind="in-job")
    lines = markdown(result).splitlines()
    assert lines[0].endswith("| ckpt host memory | downtime |")
    assert lines[1].count("---:") == 16
    moc = next(line for line in lines if line.startswith("| moc |"))
    assert moc.endswith("| 300 MB = 3.00 snapshots | 4.90 s (memory, in-job) |")
    blocking = next(line for line in lines if line.startswith("| blocking |"))
    assert blocking.endswith("| - |")


def _counted(result: dict, due: int = 8, **written: int) -> dict:
    """`result` with checkpoint counts: `due` per strategy, `written` as given (else
    all of them); `none` takes none."""
    for name, r in result["strategies"].items():
        r.update(checkpoints=0 if name == "none" else written.get(name, due),
                 checkpoints_due=None if name == "none" else due, checkpoints_failed=0,
                 persist_skipped=0, checkpoint_error=None)
    return result


def _row(markdown_text: str, name: str, which: int = 0) -> list[str]:
    rows = [line for line in markdown_text.splitlines() if line.startswith(f"| {name} |")]
    return [c.strip() for c in rows[which].strip("|").split("|")]


def test_each_row_shows_its_checkpoint_count_and_equal_counts_keep_the_ratios():
    text = markdown(_counted(_result()))
    assert "| strategy | checkpoints | stall median |" in text.splitlines()[0]
    moc = _row(text, "moc")
    assert moc[1] == "8/8" and moc[4] == "0.0100" and moc[7:9] == ["0.952", "0.952"]
    assert _row(text, "moc", 1)[-1] == "+0.1000 s"  # the cost table's CPU against none
    assert _row(text, "none")[1] == "-"


def test_a_strategy_with_fewer_checkpoints_gets_no_ratio_and_the_table_says_why():
    result = _counted(_result(), **{"moc": 1})
    result["strategies"]["moc"].update(checkpoints_failed=7,
                                       checkpoint_error="staging step 10 failed: boom")
    text = markdown(result)
    moc = _row(text, "moc")
    assert moc[1] == "1/8, 7 failed"
    assert moc[4] == "-" and moc[7:9] == ["-", "-"]  # vs blocking, throughput, steady
    assert moc[2] == "0.0050 s"  # its own figures stay
    assert _row(text, "moc", 1)[-1] == "-"  # no CPU cost against none either
    assert _row(text, "blocking")[4] == "1.0000" and _row(text, "blocking")[7] == "0.800"
    assert ("- moc: it wrote 1 of the 8 checkpoints due, so no throughput against none; "
            "blocking wrote 8, so no stall ratio; 7 failed, the first with: staging step "
            "10 failed: boom") in text.splitlines()


def test_skipped_persists_are_counted_and_noted_without_hiding_the_ratio():
    result = _counted(_result())
    result["strategies"]["moc"]["persist_skipped"] = 2
    text = markdown(result)
    assert _row(text, "moc")[1] == "8/8, 2 persist skipped"
    assert _row(text, "moc")[4] == "0.0100"
    assert any(line.startswith("- moc: 2 of its 8 checkpoints skipped the persist")
               for line in text.splitlines())


def test_rounds_keep_the_worst_checkpoint_count():
    from moc.bench.overhead import _median_of

    rounds = [{"checkpoints": 8, "checkpoints_failed": 0, "stall_median_s": 1.0,
               "checkpoint_error": None},
              {"checkpoints": 7, "checkpoints_failed": 1, "stall_median_s": 3.0,
               "checkpoint_error": "disk full"},
              {"checkpoints": 8, "checkpoints_failed": 0, "stall_median_s": 2.0,
               "checkpoint_error": None}]
    assert _median_of(rounds) == {"checkpoints": 7, "checkpoints_failed": 1,
                                  "stall_median_s": 2.0, "checkpoint_error": "disk full"}


def test_the_fault_falls_on_the_last_rank_rank_0_when_alone():
    from moc.bench.overhead import fault_rank

    assert [fault_rank(w) for w in (1, 2, 4)] == [0, 1, 3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: a machine without CUDA")
def test_without_cuda_the_gpu_limits_are_na_and_cuda_is_never_touched():
    from moc.bench.overhead import NO_GPU, gpu_limits, gpu_rows

    limits = gpu_limits()
    assert limits == {"d2h_pinned_Bps": None, "d2h_pageable_Bps": None}
    assert not torch.cuda.is_initialized()
    strategies = _result()["strategies"]  # moc reported a copy: still no share
    assert gpu_rows(limits, strategies, "cpu") == [("D2H copy", NO_GPU),
                                                   ("snapshot copy / pinned D2H", NO_GPU)]


def test_the_snapshot_copy_is_given_as_a_share_of_the_pinned_bandwidth():
    from moc.bench.overhead import gpu_rows

    limits = {"d2h_pinned_Bps": 50e9, "d2h_pageable_Bps": 12.5e9}
    strategies = _result()["strategies"]  # moc: copy_Bps 4e9
    assert gpu_rows(limits, strategies, "cuda") == [
        ("D2H copy", "50.0 GB/s pinned, 12.5 GB/s pageable"),
        ("snapshot copy / pinned D2H", "moc 0.08 (4.0 GB/s)")]
    # Trained on the CPU of a GPU machine: the copy was host to host, no share.
    assert gpu_rows(limits, strategies, "cpu")[1] == (
        "snapshot copy / pinned D2H", "n/a (the runs trained on the CPU)")
    assert gpu_rows(limits, {"none": {}}, "cuda")[1][1].startswith("- (no strategy")


def test_one_process_runs_are_accepted_and_zero_is_refused(capsys):
    from moc.bench.overhead import main

    with pytest.raises(SystemExit):
        main(["--nproc", "0"])
    assert "--nproc must be >= 1" in capsys.readouterr().err
