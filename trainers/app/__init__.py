"""The composition root: `load` (flags and YAML → a checked `TrainConfig`), `checks` (every check
across keys, files, the mesh and the task), `trainer` (the run built from them: the learner, the
rollout backend and the side jobs — records, weight sync, checkpoints, metrics — and the loop).
Everything below receives its collaborators from here; the commands (`trainers.commands`) call it.
"""
