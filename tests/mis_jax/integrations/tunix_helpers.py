"""What the tunix integration tests share (a plain module: importing a test module would run its
module-level setup a second time)."""

import numpy as np


def perturb_rollout_logprobs(cluster, scale, seed=0):
  """The engine reports log-probs off by N(0, scale²) per token: a train–inference mismatch."""
  generate = cluster.rollout.generate
  rng = np.random.default_rng(seed)

  def perturbed(*args, **kwargs):
    out = generate(*args, **kwargs)
    out.logprobs = [np.asarray(lp) + rng.normal(0.0, scale, np.shape(lp)).astype(np.float32) for lp in out.logprobs]
    return out

  cluster.rollout.generate = perturbed


def logged(cluster, name):
  """The history of the actor's training metric `name`."""
  return cluster.actor_trainer.metrics_logger.get_metric_history("actor", name, "train")
