"""The DCP baselines load only when chosen: `import moc` and a moc engine never import
`moc.baselines.dcp`, nor DCP's async API (DefaultStager: torch >= 2.9)."""

from __future__ import annotations

import json
import subprocess
import sys

from moc.baselines.dcp import DCP_MODES as BASELINE_MODES
from moc.train.config import DCP_MODES

_BUILD_A_MOC_ENGINE = """
import json, sys
import moc
after_import = sorted(m for m in sys.modules
                      if m.startswith(("moc.baselines", "torch.distributed.checkpoint")))
from moc.parallel import ParallelGroups, ShardedAdamW
from moc.train.config import TrainConfig
from moc.train.engines import initial_model, make_engine
cfg = TrainConfig.from_preset("tiny", ckpt_dir=sys.argv[1], ckpt_mode="moc")
groups = ParallelGroups.single(cfg.model.n_experts)
model = initial_model(cfg, groups, "cpu")
engine = make_engine(cfg, model, ShardedAdamW(model, groups, lr=cfg.lr), groups)
kind = type(engine).__name__
engine.close()
print(json.dumps({"import": after_import, "engine": kind,
                  "loaded": sorted(m for m in sys.modules
                                   if m.startswith("moc.baselines.dcp")
                                   or m == "torch.distributed.checkpoint.staging")}))
"""


def test_import_moc_and_a_moc_engine_load_no_dcp_baseline(tmp_path, monkeypatch):
    monkeypatch.setenv("MOC_SHM_ROOT", str(tmp_path / "shm"))  # the engine's snapshots
    out = subprocess.run([sys.executable, "-c", _BUILD_A_MOC_ENGINE, str(tmp_path / "ckpt")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["engine"] == "TwoLevelCheckpointer"
    assert got["import"] == [] and got["loaded"] == []


def test_the_trainer_and_the_baseline_name_the_same_dcp_modes():
    assert DCP_MODES == BASELINE_MODES
