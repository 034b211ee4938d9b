"""Adapters that put mis_jax's losses inside other RL frameworks.

Each submodule imports its framework and is installed with an extra of the same name
(``pip install 'mis_jax[tunix]'`` for :mod:`mis_jax.integrations.tunix`); importing
``mis_jax`` itself never imports any of them.
"""
