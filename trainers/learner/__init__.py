"""The learner: what a step computes. `plan` (the passes a step makes, decided once from the
config), `step` (the jitted passes and the update on the mesh), `batch` (samples packed into
micro-batched rows), `memory_plan` (`remat` / `attention` `auto`). Names no agent, engine or server.
"""
