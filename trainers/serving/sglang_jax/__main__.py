"""`python -m trainers.serving.sglang_jax --prepare [--tunix] [--trainer]` (see `launcher.main`)."""

import sys

from trainers.serving.sglang_jax import launcher

if __name__ == "__main__":
  sys.exit(launcher.main())
