"""Real lowering of a kernel for TPU (Mosaic) and GPU (Triton) from this CPU host."""

import jax
import pytest

TARGETS = pytest.mark.parametrize(
    "platform, backend, marker", [("tpu", "tpu", "tpu_custom_call"), ("cuda", "triton", "__gpu$xla.gpu.triton")]
)


def assert_lowers(fn, shapes_and_dtypes, platform: str, marker: str, kernels: tuple[str, ...] = ()) -> None:
    """`fn` traced on abstract arrays and lowered for `platform` holds the kernel's custom call (and
    the named kernels)."""
    specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes_and_dtypes]
    text = jax.jit(fn).trace(*specs).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
    for name in kernels:
        assert name in text, f"{name} is not in the lowered module"
