"""Policy-loss forms (contract §6.2) as registered choices: what a form is made of, and the built-in ones.

A form is one function ``fn(x: FormInputs, cfg) -> FormLoss``, its config (a frozen dataclass subclassing
:class:`PolicyLossConfig`, each field a :func:`mis_jax.config.config_key`: default, meaning and
constraints, checked on load) and a registration; ``LossConfig(policy_loss={"name": NAME, <its keys>})``
and the trainer's ``loss.policy_loss: {name: NAME, ...}`` then take it::

    @dataclasses.dataclass(frozen=True)
    class ScaledConfig(mis_jax.forms.PolicyLossConfig):
      scale: float = mis_jax.config.config_key(1.0, "the factor of -A·lp", gt=0)

    @mis_jax.forms.register_policy_loss("scaled_pg", ScaledConfig)
    def scaled_pg(x, cfg):
      return mis_jax.forms.FormLoss(x.weighted(-cfg.scale * x.adv * x.lp), jnp.zeros_like(x.lp), {})

:data:`POLICY_LOSSES` is the registry (``{name: PolicyLossForm}``); :data:`POLICY_LOSS_KEYS` its live view
``{name: own keys}``. A form without keys of its own may register without a config (an empty one is
made for it, ``POLICY_LOSSES[name].config``).
"""

from mis_jax._config import POLICY_LOSSES, PolicyLossConfig
from mis_jax._policy_losses import (
  CispoConfig,
  ClipCovConfig,
  DppoKlConfig,
  DppoTvConfig,
  DroConfig,
  FormInputs,
  FormLoss,
  GeoMeanConfig,
  GpgConfig,
  GspoConfig,
  KlCovConfig,
  PolicyLossForm,
  SapoConfig,
  VanillaConfig,
  register_policy_loss,
)

# {form: its own keys}, derived from the registry (a registration shows at once).
POLICY_LOSS_KEYS = POLICY_LOSSES.own_keys()

__all__ = [
  "POLICY_LOSSES",
  "POLICY_LOSS_KEYS",
  "CispoConfig",
  "ClipCovConfig",
  "DppoKlConfig",
  "DppoTvConfig",
  "DroConfig",
  "FormInputs",
  "FormLoss",
  "GeoMeanConfig",
  "GpgConfig",
  "GspoConfig",
  "KlCovConfig",
  "PolicyLossConfig",
  "PolicyLossForm",
  "SapoConfig",
  "VanillaConfig",
  "register_policy_loss",
]
