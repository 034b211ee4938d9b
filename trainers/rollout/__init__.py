"""Rollouts: who generates the step's samples and how the trainer's weights reach them.

The `Engine` protocol and its engines (`engines`: one server over HTTP; `colocated`: an engine in
this process), the client over a fleet of them (`client`, `fleet` behind sglang-router), the
sources a step's rollouts come from (`sources`: synchronous, asynchronous with bounded staleness,
replayed records), the weight-sync strategies (`weight_sync`), the servers' side of the loop
(`servers`), the per-token extras registry (`extras`, with what the `rollout` section derives:
`settings`), the rollout records (`records`) and what a sample is (`samples`). `backend.build_rollout`
composes them from a run's config. Imports `serving` (the wire schema, and the engines hosted in
this process), `models`, `runtime`, `config`; nothing above.
"""
