"""The rollout engines: `embedded/` (our SGLang-protocol server, `mis-jax serve`) and `sglang_jax/`
(sglang-jax's server with the routes it lacks), and `protocol` (the wire schema shared with the
trainer's client, `trainers.rollout.client`)."""
