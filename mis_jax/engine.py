"""How the token passes run, for those who tune them: the pass options (chunking, scatter layouts), the
segment layout and mask statistics the passes share, the log-value bound, the LM-head layouts of
:func:`mis_jax.token_logprobs`, and the micro-batch reduction of every metric the library emits.

What is computed is :mod:`mis_jax`'s; how it is made fast is chosen here, by one static argument
(``pass_options=`` of :func:`mis_jax.policy_loss` and :func:`mis_jax.compute_mis_weights`).
"""

from mis_jax._engine import PassOptions, pass_options
from mis_jax._logprobs import LM_HEAD_LAYOUTS
from mis_jax._metrics import MICROBATCH_REDUCTIONS
from mis_jax._segments import LOG_BOUND, MaskStats, Segments

__all__ = [
  "LM_HEAD_LAYOUTS",
  "LOG_BOUND",
  "MICROBATCH_REDUCTIONS",
  "MaskStats",
  "PassOptions",
  "Segments",
  "pass_options",
]
