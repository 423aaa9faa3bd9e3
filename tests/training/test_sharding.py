"""Mesh shapes that cannot be built are refused by name. (Training on 8 devices == on 1, and the
parameters' partition: tests/training/test_distributed.py, beside the multi-process runs.)"""

import pytest

from kvjax.config import ConfigError, MeshConfig


def test_mesh_size_errors():
    from kvjax.training.sharding import make_mesh

    with pytest.raises(ConfigError, match="needs 4 devices but 1 are visible"):
        make_mesh(MeshConfig(data=2, fsdp=2), devices=["cpu0"])
    with pytest.raises(ConfigError, match="3 devices are not a multiple of 2"):
        make_mesh(MeshConfig(data=-1, tensor=2), devices=["a", "b", "c"])
    with pytest.raises(ConfigError, match="at most one axis set to -1"):
        MeshConfig(data=-1, fsdp=-1)
