"""The same train step on 1 device and on 8 simulated CPU devices (data x fsdp x tensor = 2 x 2 x 2)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvjax.config import ConfigError, MeshConfig
from tests.training.conftest import SMALL_CORPUS

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import jax
    from jax.sharding import PartitionSpec as P
    from kvjax.config import load_config
    from kvjax.training.trainer import Trainer

    overrides = sys.argv[1:]
    out = {}
    for name, mesh, devices in [("one", [], jax.devices()[:1]),
                                ("eight", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], jax.devices())]:
        trainer = Trainer(load_config("gqa", overrides + mesh), tempfile.mkdtemp(), devices=devices, progress=False)
        specs = {str(jax.tree_util.keystr(p)): str(x.sharding.spec) for p, x in
                 jax.tree_util.tree_leaves_with_path(trainer.state.params)}
        out[name] = {"losses": [r["loss"] for r in trainer.run()], "specs": specs,
                     "n_devices": len(trainer.state.params["embed"]["embedding"].sharding.device_set)}
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_eight_device_step_equals_one_device():
    overrides = [
        "model.n_layers=2",
        f"data.corpus={SMALL_CORPUS}",
        "data.seq_len=32",
        "data.val_fraction=0.3",
        "data.eval_windows=8",
        "train.batch_size=4",
        "train.steps=3",
        "train.warmup_steps=1",
        "train.eval_every=100",
        "train.checkpoint_every=100",
    ]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *overrides], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["one"]["n_devices"] == 1 and out["eight"]["n_devices"] == 8
    specs = out["eight"]["specs"]
    q = next(s for p, s in specs.items() if "blocks" in p and "'q'" in p)
    down = next(s for p, s in specs.items() if "'down'" in p)
    assert q == "P('fsdp', 'tensor')" and down == "P('tensor', 'fsdp')"
    assert len(out["one"]["losses"]) == 3
    for a, b in zip(out["one"]["losses"], out["eight"]["losses"]):
        assert abs(a - b) <= 1e-5


def test_mesh_size_errors():
    from kvjax.training.sharding import make_mesh

    with pytest.raises(ConfigError, match="needs 4 devices but 1 are visible"):
        make_mesh(MeshConfig(data=2, fsdp=2), devices=["cpu0"])
    with pytest.raises(ConfigError, match="3 devices are not a multiple of 2"):
        make_mesh(MeshConfig(data=-1, tensor=2), devices=["a", "b", "c"])
    with pytest.raises(ConfigError, match="at most one axis set to -1"):
        MeshConfig(data=-1, fsdp=-1)
