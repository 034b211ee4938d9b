"""Suite-wide JAX settings, as equinox does: implicit rank promotion raises, implicit dtype
promotion is strict for the library's tests, and 8 simulated CPU devices exist so
multi-device tests need no environment tricks."""

import os
import pathlib

import jax  # noqa: E402
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

from hypothesis import settings  # noqa: E402

# Property tests run on bucketed shapes (few compilations); keep them quick on 2 cores.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_TRAINER_TESTS = pathlib.Path(__file__).parent / "trainers"


@pytest.fixture(autouse=True, scope="module")
def _strict_dtype_promotion(request):
  """``jax_numpy_dtype_promotion="strict"`` while the library's tests run (mis_jax promotes
  nothing implicitly); the trainer's tests (tests/trainers) keep JAX's standard promotion."""
  if pathlib.Path(request.path).is_relative_to(_TRAINER_TESTS):
    yield
    return
  with jax.numpy_dtype_promotion("strict"):
    yield
