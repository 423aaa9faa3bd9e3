"""Real lowering of a kernel for TPU (Mosaic) and GPU (Triton) from this CPU host, and the backend the
kernel tests run on."""

import os

import jax
import pytest

# The backend the kernel tests compute on: interpret mode (CPU, the default), or `triton` / `tpu` to run the
# same cases compiled on a GPU or TPU host (`KVJAX_TEST_PALLAS_BACKEND=triton pytest tests/pallas_kernels`).
BACKEND = os.environ.get("KVJAX_TEST_PALLAS_BACKEND", "interpret")

TARGETS = pytest.mark.parametrize(
    "platform, backend, marker", [("tpu", "tpu", "tpu_custom_call"), ("cuda", "triton", "__gpu$xla.gpu.triton")]
)


def assert_lowers(
    fn, shapes_and_dtypes, platform: str, marker: str, kernels: tuple[str, ...] = (), out_shape=None
) -> None:
    """`fn` traced on abstract arrays and lowered for `platform` holds the kernel's custom call (and
    the named kernels), and returns `out_shape` when given."""
    specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes_and_dtypes]
    traced = jax.jit(fn).trace(*specs)
    if out_shape is not None:
        assert traced.out_info.shape == out_shape
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
    for name in kernels:
        assert name in text, f"{name} is not in the lowered module"
