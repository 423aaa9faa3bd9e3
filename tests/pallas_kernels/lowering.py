"""Real lowering of a kernel for TPU (Mosaic) and GPU (Triton) from this CPU host."""

import jax
import pytest

TARGETS = pytest.mark.parametrize("platform, backend, marker", [("tpu", "tpu", "tpu_custom_call"),
                                                                ("cuda", "triton", "__gpu$xla.gpu.triton")])


def assert_lowers(fn, shapes_and_dtypes, platform: str, marker: str) -> None:
    """`fn` traced on abstract arrays and lowered for `platform` holds the kernel's custom call."""
    specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes_and_dtypes]
    assert marker in jax.jit(fn).trace(*specs).lower(lowering_platforms=(platform,)).as_text()
