"""How parameters and generation's arrays lie over a device mesh: attention heads and the MLP's hidden
units over `tensor` (Megatron's split: q/k/v/gate/up by output column, o/down by input row), each weight's
largest other dimension over `fsdp` (ZeRO-3, training), a batch's rows over `data`. A dimension is split
only when the axis divides it; an axis a mesh lacks counts as size 1. Caches follow by propagation: the
K/V a split `k` projection writes are split by head, so a cache's KV heads lie over `tensor` too."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.errors import ConfigError

# Which dimension of a kernel is the heads / hidden one that `tensor` splits, by projection name.
TENSOR_DIM = {"q": 1, "k": 1, "v": 1, "gate": 1, "up": 1, "o": 0, "down": 0}


def axis(mesh, name: str) -> int:
    """The size of a mesh axis, 1 when the mesh has none of that name."""
    return dict(mesh.shape).get(name, 1)


def param_spec(path: tuple, shape: tuple[int, ...], mesh) -> PartitionSpec:
    """The partition of one parameter of a pytree, from its path (its module names) and shape."""
    return named_spec([str(p.key) for p in path if hasattr(p, "key")], shape, mesh)  # skips `.value`


def named_spec(names: list[str], shape: tuple[int, ...], mesh) -> PartitionSpec:
    """The partition of the parameter at module path `names` (`["blocks", "3", "mixer", "q", "kernel"]`)."""
    spec: list = [None] * len(shape)
    owner = names[-2] if len(names) >= 2 else ""
    sizes = dict(mesh.shape)
    if names[-1] == "kernel" and owner in TENSOR_DIM and "tensor" in sizes:
        if shape[TENSOR_DIM[owner]] % sizes["tensor"] == 0:
            spec[TENSOR_DIM[owner]] = "tensor"
    free = [i for i in range(len(shape)) if spec[i] is None and shape[i] % sizes.get("fsdp", 1) == 0]
    if "fsdp" in sizes and free and len(shape) >= 2:
        spec[max(free, key=lambda i: shape[i])] = "fsdp"
    return PartitionSpec(*spec)


def generation_mesh(tensor: int, data: int = 1, devices: list | None = None) -> Mesh:
    """A mesh of `data` x `tensor` of the visible devices for generation and serving: rows over `data`,
    heads over `tensor`."""
    devices = jax.devices() if devices is None else devices
    if tensor < 1 or data < 1 or tensor * data > len(devices):
        raise ConfigError(f"mesh data={data} x tensor={tensor} needs that many devices; {len(devices)} are visible")
    return Mesh(np.asarray(devices[: data * tensor]).reshape(data, tensor), ("data", "tensor"))


def check_mesh(mesh: Mesh, model_config) -> None:
    """A generation mesh has axes among data, fsdp and tensor, and its tensor axis divides the KV heads
    (else each device would hold every head's cache)."""
    if not set(mesh.axis_names) <= {"data", "fsdp", "tensor"}:
        raise ConfigError(f"mesh axes {mesh.axis_names} must be among ('data', 'fsdp', 'tensor')")
    heads, tensor = model_config.attention.n_kv_heads, axis(mesh, "tensor")
    if heads % tensor:
        raise ConfigError(f"mesh tensor={tensor} must divide model.attention.n_kv_heads={heads}")


def place_params(params, mesh: Mesh):
    """Every array of a parameter pytree of this process laid out over `mesh` by `param_spec`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, param_spec(path, x.shape, mesh))), params
    )


def place_model(model: nnx.Module, mesh: Mesh) -> None:
    """Lay a model's parameters out over `mesh` in place (`param_spec`): every Generator made from it after
    computes over the mesh."""
    nnx.update(model, place_params(nnx.state(model), mesh))
