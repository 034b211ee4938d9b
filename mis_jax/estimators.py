"""Advantage estimators (contract §6.1) as registered choices: what an estimator is made of, and the
built-in ones.

An estimator is one function ``fn(x: EstimatorInputs, cfg) -> [N]`` (the rewards, their
:class:`GroupStats`, the response lengths), its config (a frozen dataclass subclassing
:class:`AdvantageConfig`, omitted without keys) and :func:`register_advantage_estimator`;
``mis_jax.compute_advantages(..., estimator={"name": NAME, <its keys>})`` then takes it.

:data:`ESTIMATORS` is the registry (``{name: Estimator}``), :data:`SEQUENCE_ESTIMATORS` its
per-sequence ones (:func:`mis_jax.compute_advantages`; ``optimal_token_baseline`` is per token) and
:data:`NEEDS_LENGTHS` those that read the response lengths: live views of it.
"""

from mis_jax._advantages import (
  ESTIMATORS,
  NEEDS_LENGTHS,
  SEQUENCE_ESTIMATORS,
  AdvantageConfig,
  Estimator,
  EstimatorInputs,
  GdpoConfig,
  GroupStats,
  GrpoPasskConfig,
  OptimalTokenBaselineConfig,
  register_advantage_estimator,
)

__all__ = [
  "ESTIMATORS",
  "NEEDS_LENGTHS",
  "SEQUENCE_ESTIMATORS",
  "AdvantageConfig",
  "Estimator",
  "EstimatorInputs",
  "GdpoConfig",
  "GroupStats",
  "GrpoPasskConfig",
  "OptimalTokenBaselineConfig",
  "register_advantage_estimator",
]
