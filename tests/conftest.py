"""Suite-wide JAX settings, as equinox does: implicit rank promotion raises, implicit dtype
promotion is strict, and 8 simulated CPU devices exist so multi-device tests need no
environment tricks."""

import os


import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

from hypothesis import settings  # noqa: E402

# Property tests run on bucketed shapes (few compilations); keep them quick on 2 cores.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
