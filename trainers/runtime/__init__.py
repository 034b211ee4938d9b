"""The processes a run spans and how it stops: `distributed` (several processes, process 0's work
made every process's), `parallel` (the mesh, partition rules and shardings), `errors` (how a run
stops, the engine errors), `preemption` (SIGTERM / SIGINT). Imports `models` and `config` only.
"""
