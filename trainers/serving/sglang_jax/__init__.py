"""sglang-jax as the rollout engine: `launcher` (its venv, the subprocess, `SGLangJaxServer`; run
`python -m trainers.serving.sglang_jax --prepare [--tunix] [--trainer]`) and `routes` (the SGLang
routes sglang-jax lacks; it runs inside sglang-jax's own venv as `python -P routes.py`, so it imports
only the standard library and what sglang-jax installs). This file imports nothing, so importing
`routes` in that venv loads no other trainer code."""
