"""Device mesh and parameter / batch shardings.

Axes: `data` and `fsdp` split the batch; `tensor` splits attention heads and the MLP hidden dimension;
`fsdp` also splits each parameter along its largest remaining dimension (ZeRO-3 style): the layout rule
is `kvjax.sharding.param_spec`, shared with generation. A dimension is split only when the axis size
divides it. Over several processes (`training.distributed`) the mesh spans
every process's devices, the batch axes across processes and `tensor` within one.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.config import ConfigError, MeshConfig
from kvjax.sharding import param_spec
from kvjax.training.distributed import from_host

AXES = ("data", "fsdp", "tensor")
BATCH = PartitionSpec(("data", "fsdp"))


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ConfigError(f"mesh {dict(zip(AXES, sizes))}: {len(devices)} devices are not a multiple of {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ConfigError(
            f"mesh {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} devices but {len(devices)} are visible"
        )
    if jax.process_count() > 1 and jax.local_device_count() % sizes[2]:
        raise ConfigError(
            f"mesh.tensor={sizes[2]} must divide the {jax.local_device_count()} devices of one process: tensor "
            "parallelism stays within a host (its collectives run every layer)"
        )
    return Mesh(np.asarray(devices).reshape(sizes), AXES)


def shard_params(params, mesh: Mesh):
    """Place every array of a parameter pytree (alike on every process) on the mesh by `param_spec`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: from_host(x, NamedSharding(mesh, param_spec(path, x.shape, mesh))), params
    )


def batch_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """How a batch of `rows` lies on the mesh (split over data x fsdp, which must divide it)."""
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if rows % n:
        per = f" ({jax.process_count()} processes)" if jax.process_count() > 1 else ""
        raise ConfigError(f"train.batch_size={rows} must be a multiple of mesh data x fsdp = {n}{per}")
    return NamedSharding(mesh, BATCH)
