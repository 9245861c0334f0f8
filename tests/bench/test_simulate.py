"""The ETTR model of `moc simulate`: pure functions and the CLI on synthetic bench JSON
(the real runs of --validate are too slow for the suite)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moc.bench import simulate as sim
from moc.bench.simulate import Costs, best_interval, ettr, young_daly_interval


def costs(step: float = 1.0, ckpt: float = 2.0, restart: float = 8.0, restore: float = 2.0,
          name: str = "x") -> Costs:
    return Costs(name, step, ckpt, restart, restore, "storage")


def overhead_json(**overrides: dict) -> dict:
    strategies = {
        "none": {"stall_median_s": None, "mean_step_time_s": 1.0,
                 "mean_step_time_steady_s": 0.9, "restore_storage_s": None,
                 "restore_memory_s": None},
        "blocking": {"stall_median_s": 0.5, "mean_step_time_s": 1.2,
                     "mean_step_time_steady_s": 1.1, "restore_storage_s": 0.25,
                     "restore_memory_s": None},
        "moc": {"stall_median_s": 0.01, "mean_step_time_s": 1.05,
                "mean_step_time_steady_s": 0.92, "restore_storage_s": 0.3,
                "restore_memory_s": 0.2},
    }
    for name, fields in overrides.items():
        strategies.setdefault(name, {}).update(fields)
    return {"config": {"interval": 5, "steps": 40}, "limits": {}, "strategies": strategies}


def write(tmp_path: Path, result: dict) -> Path:
    path = tmp_path / "overhead.json"
    path.write_text(json.dumps(result))
    return path


def test_ettr_matches_a_hand_computed_case():
    # T = 1, C = 2, R = 8 + 2, λ = 1e-3, I = 8: W = 10, useful 8/10, failures waste
    # λ (R + W/2) = 1e-3 x 15 of the time.
    assert ettr(8, costs(), 1e-3) == pytest.approx(0.8 * (1 - 0.015))


def test_ettr_is_zero_when_failures_outpace_progress():
    assert ettr(8, costs(), 1 / 12) == 0.0
    assert best_interval(costs(), 1 / 10) is None  # λ R = 1: no interval helps


@pytest.mark.parametrize(("step", "ckpt", "restart", "rate"), [
    (1.0, 2.0, 10.0, 1e-3), (0.6, 0.7, 10.0, 9e-5), (0.6, 0.01, 30.0, 1e-2),
    (2.0, 0.0, 5.0, 1e-4), (0.1, 5.0, 1.0, 1e-6), (1.0, 1.0, 0.0, 0.3),
])
def test_best_interval_matches_a_brute_force_search(step, ckpt, restart, rate):
    c = costs(step, ckpt, restart, 0.0)
    best = best_interval(c, rate)
    top = 4 * max(10, math.ceil(young_daly_interval(c, rate)))
    brute = max(range(1, top), key=lambda i: ettr(i, c, rate))
    assert ettr(best, c, rate) == pytest.approx(ettr(brute, c, rate), rel=1e-12)


def test_best_interval_is_near_young_daly_when_failures_are_rare():
    c = costs(step=1.0, ckpt=1.0, restart=0.0, restore=0.0)
    best = best_interval(c, 1e-7)
    assert best == pytest.approx(young_daly_interval(c, 1e-7), rel=0.01)


def test_ettr_decreases_with_the_failure_rate():
    rates = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2]
    at_fixed = [ettr(20, costs(), r) for r in rates]
    at_best = [ettr(best_interval(costs(), r), costs(), r) for r in rates]
    assert at_fixed == sorted(at_fixed, reverse=True)
    assert at_best == sorted(at_best, reverse=True)


def test_costs_prefer_steady_means_and_floor_at_the_median_stall(tmp_path):
    result = overhead_json()
    path = write(tmp_path, result)
    got, basis = sim.costs_from_overhead(result, path, ["blocking", "moc"], restart_s=10.0,
                                         fault_kind="process")
    blocking, moc = got
    assert basis == "steady"
    assert blocking.step_s == moc.step_s == 0.9
    assert blocking.ckpt_s == pytest.approx((1.1 - 0.9) * 5)
    assert moc.ckpt_s == pytest.approx((0.92 - 0.9) * 5)
    # A process fault: moc restores from its snapshots in memory, blocking from storage.
    assert (moc.restore_from, moc.recovery_s) == ("memory", pytest.approx(10.2))
    assert (blocking.restore_from, blocking.recovery_s) == ("storage", pytest.approx(10.25))
    # Without steady means (older files) the overall means; the stall is the floor.
    for s in result["strategies"].values():
        s.pop("mean_step_time_steady_s")
    result["strategies"]["moc"]["stall_median_s"] = 0.4
    (blocking, moc), basis = sim.costs_from_overhead(result, path, ["blocking", "moc"],
                                                     restart_s=10.0, fault_kind="node")
    assert basis == "all steps"
    assert blocking.ckpt_s == pytest.approx((1.2 - 1.0) * 5)
    assert moc.ckpt_s == 0.4  # (1.05 - 1.0) x 5 = 0.25 is below the stall
    assert moc.restore_from == "storage" and moc.restore_s == 0.3  # a node fault


def test_step_time_override_scales_costs_only_when_asked(tmp_path):
    result = overhead_json()
    path = write(tmp_path, result)
    (kept,), _ = sim.costs_from_overhead(result, path, ["blocking"], restart_s=10.0,
                                         fault_kind="process", step_time=0.09)
    (scaled,), _ = sim.costs_from_overhead(result, path, ["blocking"], restart_s=10.0,
                                           fault_kind="process", step_time=0.09,
                                           scale_costs=True)
    assert kept.step_s == scaled.step_s == 0.09
    assert kept.ckpt_s == pytest.approx(1.0) and scaled.ckpt_s == pytest.approx(0.1)
    assert scaled.restart_s == 10.0 and scaled.restore_s == pytest.approx(0.025)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda r: r["strategies"]["moc"].update(mean_step_time_s=None),
     "strategy 'moc' has no 'mean_step_time_s' (missing or null)"),
    (lambda r: r["strategies"]["blocking"].pop("restore_storage_s"),
     "strategy 'blocking' has no 'restore_storage_s'"),
    (lambda r: r["strategies"].pop("none"), 'no "none" strategy'),
    (lambda r: r["config"].pop("interval"), "config.interval must be a positive integer"),
    (lambda r: r.pop("strategies"), 'with a "strategies" object'),
])
def test_missing_or_null_figures_are_a_clear_error(tmp_path, mutate, message):
    result = overhead_json()
    for s in result["strategies"].values():
        s.pop("mean_step_time_steady_s")
    mutate(result)
    with pytest.raises(ValueError, match="--overhead .*" + _re(message)):
        sim.main(["--overhead", str(write(tmp_path, result))])


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_missing_file_and_unknown_strategy_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file; write one with `moc bench overhead"):
        sim.main(["--overhead", str(tmp_path / "missing.json")])
    path = write(tmp_path, overhead_json())
    with pytest.raises(ValueError, match="no strategy 'dcp-async'; it has none, blocking, moc"):
        sim.main(["--overhead", str(path), "--strategies", "dcp-async"])
    with pytest.raises(ValueError, match="none takes no checkpoints"):
        sim.main(["--overhead", str(path), "--strategies", "none"])


def test_cli_prints_the_table_and_writes_json_and_png(tmp_path, capsys):
    path = write(tmp_path, overhead_json())
    out_json, out_png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert sim.main(["--", "--overhead", str(path), "--nodes", "100", "--mtbf-hours", "1000",
                     "--interval", "50", "--json", str(out_json), "--png", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "| strategy | T | C | R | best I | Young/Daly I | ETTR at best I | ETTR at I = 50 |" \
        in text
    assert "| blocking |" in text and "| moc |" in text and "| none |" not in text
    doc = json.loads(out_json.read_text())
    rate = 100 / (1000 * 3600)
    assert doc["inputs"]["failure_rate_per_s"] == pytest.approx(rate)
    moc = doc["strategies"]["moc"]
    c = Costs("moc", moc["step_s"], moc["ckpt_s"], moc["restart_s"], moc["restore_s"],
              moc["restore_from"])
    assert moc["best_interval"] == best_interval(c, rate)
    assert moc["ettr_at_interval"] == pytest.approx(ettr(50, c, rate))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lost_steps_count_completed_steps_since_the_newest_checkpoint():
    # The fault at step s kills before s runs: steps up to s - 1 are done.
    assert [sim.lost_steps(s, 10) for s in (35, 70, 11, 10, 1)] == [4, 9, 0, 9, 0]


def step(n: int, t: float, dt: float = 0.1) -> dict:
    return {"event": "step", "step": n, "time": t, "step_time_s": dt}


def test_restarts_and_span_are_read_from_the_event_times():
    events = [step(1, 1.0), step(2, 1.1), step(3, 1.2),
              {"event": "checkpoint", "step": 2, "time": 1.25, "stall_s": 0.0},
              {"event": "recovery", "step": 3, "resumed_from": 2, "source": "memory",
               "recovery_s": 0.05, "time": 9.0},
              step(3, 9.5), step(4, 9.6)]
    (r,) = sim.restarts(events)
    assert r["last_step"] == 3 and r["resumed_from"] == 2 and r["source"] == "memory"
    assert r["restart_s"] == pytest.approx(9.4 - 1.2)
    assert sim.span_s(events, 4) == pytest.approx(9.6 - 0.9)
    with pytest.raises(RuntimeError, match="did not reach step 5"):
        sim.span_s(events, 5)


def test_prediction_of_a_faulted_run_adds_checkpoints_restarts_and_lost_work():
    p = sim.predict_faulted_run(100, 10, 35, step_s=0.05, ckpt_s=0.2, restarts_s=[8.0, 9.0])
    assert p["faults"] == [35, 70] and p["lost_steps"] == [4, 9]
    wall = 100 * 0.05 + 10 * 0.2 + 17.0 + 13 * 0.05
    assert p["wall_s"] == pytest.approx(wall)
    assert p["ettr"] == pytest.approx(5.0 / wall)
    with pytest.raises(RuntimeError, match=r"expected 2 recoveries \(faults at \[35, 70\]\)"):
        sim.predict_faulted_run(100, 10, 35, 0.05, 0.2, [8.0])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"names": ["none"]}, "cannot validate 'none'"),
    ({"fault_every": 0}, "--validate-fault-every must be in 1..100, got 0"),
    ({"interval": 101}, "--validate-interval must be in 1..100, got 101"),
    ({"repeat": 0}, "--validate-repeat must be >= 1, got 0"),
])
def test_validate_rejects_bad_input_before_starting_any_run(kwargs, message):
    args = {"names": ["moc"], "steps": 100, "interval": 10, "fault_every": 35,
            "fault_kind": "process", **kwargs}
    with pytest.raises(ValueError, match=_re(message)):
        sim.validate(**args)


def test_validation_table_shows_prediction_against_measurement():
    predicted = sim.predict_faulted_run(100, 10, 35, 0.04, 0.02, [3.0, 3.5])
    v = {"steps": 100, "interval": 10, "fault_every": 35, "fault_kind": "process",
         "rounds": [{"blocking": {
             "step_s": 0.04, "ckpt_s": 0.02, "predicted": predicted,
             "restarts": [{"restart_s": 3.0, "restore_s": 0.01, "source": "storage"},
                          {"restart_s": 3.5, "restore_s": 0.01, "source": "storage"}],
             "measured": {"wall_s": predicted["wall_s"] * 1.1,
                          "ettr": predicted["ettr"] / 1.1, "lost_steps": [4, 9]},
             "median_step_s": {"a": 0.04, "b": 0.04, "c": 0.041}}}]}
    text = sim.validation_markdown(v)
    assert "| blocking | 0.0400 s | 0.0200 s | 3.00, 3.50 s | 0.010, 0.010 s (storage) " \
           "| [4, 9] / [4, 9] |" in text
    assert "| +10.0% |" in text


def test_bad_input_through_the_moc_command_is_a_one_line_error(tmp_path, capsys):
    from moc.cli import main as moc_main

    assert moc_main(["simulate", "--overhead", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moc simulate: error: --overhead ") and err.count("\n") == 1


# ---------------------------------------------------------------------------------------
# The peer tier


def peer(replica_gb: float = 10.0, net_gbps: float = 25.0, mtbf: float = 6335.0
         ) -> sim.PeerTier:
    return sim.PeerTier(replica_gb * 1e9, net_gbps * 1e9, mtbf)


def test_p_both_fail_matches_the_formula_and_a_monte_carlo():
    import random

    window_s, mtbf_h = 2 * 3600.0, 10.0
    p = 1 - math.exp(-window_s / (mtbf_h * 3600))
    assert sim.p_peer_lost(window_s, mtbf_h) == pytest.approx(p, rel=1e-12)
    assert sim.p_both_fail(window_s, mtbf_h) == pytest.approx(p * p, rel=1e-12)
    # Independent exponential failure times of a node and its peer, 4,000 pairs: the
    # fraction with both within the window. Binomial sd = sqrt(p^2 (1 - p^2) / n) ~ 0.0045
    # at p^2 ~ 0.033; 4 sd of tolerance.
    rng = random.Random(14)
    n = 4000
    both = sum(rng.expovariate(1 / mtbf_h) < 2.0 and rng.expovariate(1 / mtbf_h) < 2.0
               for _ in range(n))
    sd = math.sqrt(p * p * (1 - p * p) / n)
    assert abs(both / n - p * p) < 4 * sd


def test_peer_tier_beats_moc_without_peers_when_replication_fits():
    # Storage at 2 GB/s, the peer over a 25 GB/s network: pulling 10 GB from the peer
    # (0.4 s) plus the replica's lag (0.4 s) beats reading 30 GB from storage (15 s).
    for rate in (1e-5, 1e-4, 1e-3):
        for interval in (5, 50, 500):
            c = costs(step=2.0, ckpt=0.5, restart=60.0, restore=15.0)
            p = peer(10.0)
            assert p.lag(interval * c.step_s + c.ckpt_s) == 1
            assert sim.ettr_peers(interval, c, rate, p) >= ettr(interval, c, rate)
        best = sim.best_interval_peers(c, rate, p)
        assert sim.ettr_peers(best, c, rate, p) >= ettr(best_interval(c, rate), c, rate)


def test_best_interval_with_peers_matches_a_brute_force_search():
    c, p, rate = costs(step=1.0, ckpt=2.0, restart=30.0, restore=20.0), peer(50.0), 1e-4
    best = sim.best_interval_peers(c, rate, p)
    brute = max(range(1, 5000), key=lambda i: sim.ettr_peers(i, c, rate, p))
    assert sim.ettr_peers(best, c, rate, p) == pytest.approx(
        sim.ettr_peers(brute, c, rate, p), rel=1e-9)


def test_replication_longer_than_the_interval_lags_by_whole_intervals():
    p = peer(replica_gb=100.0, net_gbps=10.0)  # t_rep = 10 s
    assert p.replicate_s == pytest.approx(10.0)
    assert p.lag(20.0) == 1 and p.lost_work_s(20.0) == pytest.approx(10.0 + 10.0)
    # W = 4 s: a replica every 3 checkpoints, lost work 3 x 4 / 2 + 10, exposed 12 + 10 s.
    assert p.lag(4.0) == 3
    assert p.lost_work_s(4.0) == pytest.approx(16.0)
    assert p.window_s(4.0) == pytest.approx(22.0)
    assert p.net_share(4.0) == pytest.approx(10.0 / 12.0)
    # A slow network makes the peer tier worse than storage; the model says so.
    c = costs(step=1.0, ckpt=0.0, restart=10.0, restore=2.0)
    assert sim.ettr_peers(4, c, 1e-4, p) < ettr(4, c, 1e-4)


def test_model_size_splits_experts_from_the_rest():
    m = sim.ModelSize(**sim.DEEPSEEK_V3)
    # 671B - 37B = 248 experts' worth of the 256 routed: 634 x 256 / 248 = 654.5B.
    assert m.expert_params == pytest.approx(634e9 * 256 / 248)
    assert m.state_bytes() == pytest.approx(14 * 671e9)
    assert m.state_bytes(1) == pytest.approx(14 * (671e9 - m.expert_params * 255 / 256))
    with pytest.raises(ValueError, match=_re("--top-k must be in 1..255")):
        sim.ModelSize(671, 37, 256, 256)


def test_cli_peers_prints_the_scale_table_and_json(tmp_path, capsys):
    result = overhead_json(**{"dcp-async": {
        "stall_median_s": 0.03, "mean_step_time_s": 1.1, "mean_step_time_steady_s": 1.0,
        "restore_storage_s": 0.3, "restore_memory_s": None}})
    path, out = write(tmp_path, result), tmp_path / "peers.json"
    assert sim.main(["--overhead", str(path), "--peers", "--step-time", "2", "--scale-costs",
                     "--restart-s", "60", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| GPUs | nodes | a failure every | strategy | R | best I |" in text
    for gpus in (2048, 16384):
        for name in ("blocking", "dcp-async", "moc", "moc+peers"):
            assert f"| {gpus} | {gpus // 8} | " in text and f"| {name} |" in text
    rows = json.loads(out.read_text())["scale"]
    assert [(r["gpus"], r["strategy"]) for r in rows] == [
        (g, n) for g in (2048, 16384) for n in ("blocking", "dcp-async", "moc", "moc+peers")]
    peers = [r for r in rows if r["strategy"] == "moc+peers"]
    assert peers[0]["replica_bytes_per_node"] == pytest.approx(14 * 671e9 / 256)
    assert peers[0]["replicate_s"] == pytest.approx(14 * 671e9 / 256 / 25e9)
    moc = {r["gpus"]: r for r in rows if r["strategy"] == "moc"}
    assert all(r["ettr_best"] >= moc[r["gpus"]]["ettr_best"] for r in peers)


@pytest.mark.parametrize(("args", "message"), [
    (["--k-replica", "0"], "--k-replica must be in 1..256 or all, got 0"),
    (["--k-replica", "some"], "--k-replica must be a number of experts or all"),
    (["--gpus", "2050"], "--gpus: 2050 is not a multiple of --gpus-per-node 8"),
    (["--replica-jump", "256", "--gpus", "2048"], "sends node i's replica to itself"),
    (["--net-GBps", "0"], "--net-GBps must be > 0"),
    (["--strategies", "blocking"], "--peers: the peer replicas are moc's; include moc"),
])
def test_cli_peers_rejects_bad_input(tmp_path, args, message):
    path = write(tmp_path, overhead_json())
    with pytest.raises(ValueError, match=_re(message)):
        sim.main(["--overhead", str(path), "--peers", *args])


def test_module_entry_point_runs_the_peer_table(tmp_path):
    # `python -m moc.bench.simulate` goes through the `moc` command line (its one-line
    # errors); it used to hand on a second "--" and refuse every option.
    import subprocess
    import sys

    path = write(tmp_path, overhead_json())
    r = subprocess.run([sys.executable, "-m", "moc.bench.simulate", "--overhead", str(path),
                        "--peers", "--gpus", "1024"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| 1024 | 128 | " in r.stdout and "| moc+peers |" in r.stdout


def test_own_slot_count_mirrors_the_engine():
    from moc.checkpoint.twolevel.memory.slots import N_SLOTS

    assert sim.N_SLOTS_OWN == N_SLOTS


# ---------------------------------------------------------------------------------------
# Measured downtime (`recovery` events' downtime_s) and the recovery-modes table


def recovery(downtime: float | None, kind: str | None = "in-job", source: str = "peer"
             ) -> dict:
    event = {"event": "recovery", "step": 20, "resumed_from": 20, "source": source,
             "recovery_s": 0.05, "downtime_s": downtime, "replaced": [1], "pids": [1, 2]}
    if kind is not None:
        event["kind"] = kind
    return event


def write_metrics(tmp_path: Path, events: list[dict], torn: bool = False) -> Path:
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps(e) + "\n" for e in events)
    path.write_text(text + ('{"event": "step", "st' if torn else ""))
    return path


def test_downtime_of_events_is_the_median_of_the_recoveries_that_logged_one():
    events = [step(1, 1.0), {"event": "fault", "step": 20}, recovery(3.3),
              recovery(None), recovery(2.8, kind="restart"), recovery(2.9, kind=None)]
    d = sim.downtime_of_events(events, "in-job", "run.jsonl")
    assert (d.seconds, d.events, d.kinds) == (2.9, 3, ("in-job", "restart"))
    assert d.describe() == "median of 3 recovery events (in-job, restart) in run.jsonl"
    with pytest.raises(ValueError, match=_re("run.jsonl: no recovery event with a downtime_s")):
        sim.downtime_of_events([step(1, 1.0), recovery(None)], "x", "run.jsonl")


def test_downtime_from_a_metrics_file_ignores_a_torn_last_line(tmp_path):
    path = write_metrics(tmp_path, [step(1, 1.0), recovery(0.3), recovery(0.5),
                                    recovery(0.4)], torn=True)
    d = sim.downtime_from_metrics(path, "in-job-spare", "--downtime-from x")
    assert (d.label, d.seconds, d.events, d.source) == ("in-job-spare", 0.4, 3, str(path))


def test_parse_downtime_takes_seconds_or_a_metrics_file(tmp_path):
    assert sim.parse_downtime("in-job=2.9") == sim.Downtime("in-job", 2.9, "given")
    path = write_metrics(tmp_path, [recovery(5.5, kind="restart"), recovery(5.2, "restart")])
    d = sim.parse_downtime(f"restart={path}")
    assert (d.label, d.seconds, d.kinds) == ("restart", pytest.approx(5.35), ("restart",))


@pytest.mark.parametrize(("text", "message"), [
    ("in-job", "--downtimes: expected LABEL=SECONDS or LABEL=METRICS.jsonl"),
    ("=2.9", "--downtimes: expected LABEL=SECONDS"),
    ("in-job=-1", "--downtimes in-job=-1: the downtime must be >= 0 s"),
    ("in-job=nan", "--downtimes in-job=nan: the downtime must be >= 0 s"),
    ("in-job=missing.jsonl", "--downtimes in-job=missing.jsonl: no such file"),
])
def test_parse_downtime_rejects_bad_entries(text, message):
    with pytest.raises(ValueError, match=_re(message)):
        sim.parse_downtime(text)


def test_downtime_options_are_clear_errors(tmp_path, capsys):
    from moc.cli import main as moc_main

    path = write(tmp_path, overhead_json())
    no_downtime = write_metrics(tmp_path, [step(1, 1.0), recovery(None)])
    cases = [
        (["--downtime-s", "3", "--downtime-from", str(no_downtime)],
         "--downtime-s and --downtime-from both give the per-fault downtime; pass one"),
        (["--downtime-from", str(no_downtime)],
         f"--downtime-from {no_downtime}: no recovery event with a downtime_s"),
        (["--downtime-from", str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
        (["--downtime-s", "-2"], "--downtime-s must be >= 0, got -2.0"),
        (["--downtimes", "in-job=2.9"], "--downtimes gives the rows of --recovery-modes"),
        (["--recovery-modes"], "--recovery-modes compares measured downtimes"),
        (["--recovery-modes", "--peers", "--downtime-s", "1"], "pass one"),
        (["--recovery-modes", "--downtimes", "a=1", "a=2"], "each label once"),
        (["--recovery-modes", "--downtimes", "a=1", "--strategies", "blocking", "moc"],
         "--strategies names the one strategy"),
        (["--recovery-modes", "--downtimes", "a=1", "--job-mtbf-min", "0"],
         "--job-mtbf-min must be > 0, got 0.0"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=_re(message)):
            sim.main(["--overhead", str(path), *args])
        # Through the `moc` command: one line.
        assert moc_main(["simulate", "--overhead", str(path), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moc simulate: error: ") and err.count("\n") == 1, err


def test_a_given_downtime_is_every_strategys_r(tmp_path, capsys):
    path, out = write(tmp_path, overhead_json()), tmp_path / "sim.json"
    metrics = write_metrics(tmp_path, [recovery(2.0), recovery(3.0), recovery(4.0)])
    assert sim.main(["--overhead", str(path), "--downtime-from", str(metrics), "--json",
                     str(out)]) == 0
    assert "R = the measured downtime 3 s (median of 3 recovery events (in-job) in" \
        in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["inputs"]["downtime"]["seconds"] == 3.0
    for row in doc["strategies"].values():
        assert (row["recovery_s"], row["restore_from"]) == (3.0, "measured downtime")


def test_costs_take_the_benchs_downtime_of_the_source_the_restore_reads(tmp_path):
    result = overhead_json(moc={"downtime_memory_s": 4.5, "downtime_storage_s": None},
                           blocking={"downtime_storage_s": 5.25})
    path = write(tmp_path, result)

    def costs_of(fault_kind: str, measured: bool = True) -> dict[str, Costs]:
        got, _ = sim.costs_from_overhead(result, path, ["blocking", "moc"], restart_s=10.0,
                                         fault_kind=fault_kind, measured_downtime=measured)
        return {c.name: c for c in got}

    process = costs_of("process")
    assert (process["moc"].recovery_s, process["moc"].restore_from) == (
        4.5, "memory, measured downtime")
    assert process["blocking"].recovery_s == 5.25
    # A node fault reads storage: moc measured no fault's downtime from there.
    node = costs_of("node")
    assert (node["moc"].recovery_s, node["moc"].restore_from) == (10.3, "storage")
    assert node["blocking"].recovery_s == 5.25
    # Not asked for (an explicit --restart-s): restart + restore as before.
    assert costs_of("process", measured=False)["moc"].recovery_s == pytest.approx(10.2)


def test_cli_uses_the_benchs_downtime_unless_a_restart_time_is_given(tmp_path, capsys):
    path = write(tmp_path, overhead_json(moc={"downtime_memory_s": 4.5}))
    sim.main(["--overhead", str(path)])
    text = capsys.readouterr().out
    assert ("R = the downtime the bench measured for moc, restart 5 s + restore for the rest "
            "(--restart-s to assume one instead)") in text
    assert "| 4.50 s (memory, measured downtime) |" in text
    sim.main(["--overhead", str(path), "--restart-s", "5"])
    text = capsys.readouterr().out
    assert "restart 5 s + restore" in text and "measured downtime" not in text


def test_node_mtbf_inverts_the_failure_rate():
    for nodes in (1, 256, 2048):
        mtbf = sim.node_mtbf_hours(10.0, nodes)
        assert sim.failure_rate(nodes, mtbf) == pytest.approx(1 / 600)
    with pytest.raises(ValueError, match=_re("--job-mtbf-min must be > 0")):
        sim.node_mtbf_hours(-1.0, 4)


def test_deepseek_moe_16b_size():
    m = sim.ModelSize(**sim.DEEPSEEK_MOE_16B)
    # 16.4B - 2.8B = 58 of the 64 routed experts' worth: 13.6 x 64 / 58 = 15.0B.
    assert m.expert_params == pytest.approx(13.6e9 * 64 / 58)
    assert 1e9 < m.nonexpert_params < 2e9  # attention, embeddings, 2 shared experts
    assert m.state_bytes() == pytest.approx(14 * 16.4e9)


def modes_table(downtimes: list[float], **kwargs: object) -> list[dict]:
    modes = [sim.Downtime(f"d{i}", d, "given") for i, d in enumerate(downtimes)]
    args = {"gpus": [2048, 16384], "gpus_per_node": 8, "job_mtbf_min": 10.0,
            "net_GBps": 25.0, "storage_GBps": 2.0, "k_replica": None, **kwargs}
    return sim.recovery_modes_table(costs(step=2.0, ckpt=1.3, restart=99.0, restore=99.0,
                                          name="moc"),
                                    modes, sim.ModelSize(**sim.DEEPSEEK_MOE_16B), **args)


def test_recovery_modes_ettr_rises_as_the_downtime_falls():
    downtimes = [60.0, 5.3, 2.9, 0.4]
    rows = modes_table(downtimes)
    assert [(r["gpus"], r["recovery"]) for r in rows] == [
        (g, f"d{i}") for g in (2048, 16384) for i in range(4)]
    for gpus in (2048, 16384):
        ettrs = [r["ettr_best"] for r in rows if r["gpus"] == gpus]
        assert ettrs == sorted(ettrs) and len(set(ettrs)) == 4
    # The costs' own restart and restore (99 s) play no part: the mode's downtime does.
    assert all(r["recovery_s"] < d + 0.1 for r, d in zip(rows, downtimes * 2, strict=True))


def test_recovery_modes_row_is_the_peer_model_at_the_job_mtbf():
    (row,) = modes_table([2.9], gpus=[2048])
    nodes = 256
    assert (row["nodes"], row["failure_every_h"]) == (nodes, pytest.approx(10 / 60))
    state = 14 * 16.4e9
    peer = sim.PeerTier(state / nodes, 25e9, sim.node_mtbf_hours(10.0, nodes))
    c = Costs("x", 2.0, 1.3, 2.9, state / nodes / 2e9, "storage")
    assert row["recovery_s"] == pytest.approx(2.9 + state / nodes / 25e9)
    assert row["ettr_best"] == pytest.approx(
        sim.ettr_peers(row["best_interval"], c, 1 / 600, peer))
    assert row["best_interval"] == sim.best_interval_peers(c, 1 / 600, peer)
    assert (row["strategy"], row["moevement_ettr"]) == ("moc+peers", 0.94)


def test_cli_recovery_modes_prints_the_table_and_json(tmp_path, capsys):
    path, out = write(tmp_path, overhead_json()), tmp_path / "modes.json"
    metrics = write_metrics(tmp_path, [recovery(0.3), recovery(0.5)])
    assert sim.main(["--overhead", str(path), "--recovery-modes", "--downtimes",
                     "restart=5.3", "in-job=2.9", f"in-job-spare={metrics}",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| GPUs | nodes | recovery | downtime | R = downtime + peer pull | best I " \
           "| ETTR at best I | MoEvement (published) |" in text
    assert "| 2048 | 256 | restart, GPU cluster | 60.00 s (assumed) |" in text
    assert "| 16384 | 2048 | in-job-spare | 0.40 s (median of 2) |" in text
    assert "T = 2 s" in text and ">= 0.94 |" in text
    doc = json.loads(out.read_text())
    assert doc["inputs"]["step_time"] == 2.0 and doc["inputs"]["model"]["experts"] == 64
    assert [m["label"] for m in doc["inputs"]["modes"]] == [
        "restart, GPU cluster", "restart", "in-job", "in-job-spare"]
    rows = doc["recovery_modes"]
    assert [r["downtime_s"] for r in rows[:4]] == [60.0, 5.3, 2.9, 0.4]
    assert rows[0]["ettr_best"] < rows[1]["ettr_best"] < rows[3]["ettr_best"]
    # C is the bench's moc C (steady means: (0.92 - 0.9) x 5), not scaled without asking.
    assert doc["inputs"]["ckpt_s"] == pytest.approx(0.1)
