"""What this machine gives a weight sync, measured in the run that compares against it.

- `file_floor(nbytes)`: seconds to write `nbytes` to a fresh file (from memory, through the page
  cache, no fsync: what a push to a local filesystem costs at best) and read them back into a
  fresh buffer — "the same bytes to a file and back", the floor of a sync through a file;
- `ProcessTreeMemory`: the resident memory of a process and all of its children, sampled every
  `interval_s` (the peak of their sum), and each process's own high-water mark (`VmHWM`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time

import numpy as np
import psutil


def file_floor(nbytes: int, *, directory: str | None = None, repeats: int = 3) -> dict:
  """`{"write_s", "read_s", "total_s"}`, medians of `repeats` rounds of writing `nbytes` of random
  data to a new file in `directory` and reading them back."""
  data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
  rounds = []
  for _ in range(repeats):
    fd, path = tempfile.mkstemp(dir=directory, prefix="floor-")
    try:
      t0 = time.perf_counter()
      with os.fdopen(fd, "wb") as f:
        f.write(memoryview(data))
      t1 = time.perf_counter()
      out = np.empty(nbytes, np.uint8)
      with open(path, "rb", buffering=0) as f:
        view = memoryview(out)
        while view.nbytes:
          view = view[f.readinto(view) :]
      t2 = time.perf_counter()
    finally:
      os.remove(path)
    assert np.array_equal(out[:4096], data[:4096])
    rounds.append((t1 - t0, t2 - t1))
    del out
  write, read = statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
  return {"bytes": nbytes, "write_s": write, "read_s": read, "total_s": statistics.median(sum(r) for r in rounds)}


class ProcessTreeMemory:
  """Samples the resident memory of process `pid` and its descendants in a thread (`start`,
  `stop`): `peak_bytes`, the largest sum seen, when (`peak_at_s`, from `start`) and what each
  process held then; `hwm`, each process's `VmHWM` (its own peak, read while it lives)."""

  def __init__(self, pid: int, *, interval_s: float = 0.02):
    self.root, self.interval_s = psutil.Process(pid), interval_s
    self.peak_bytes, self.peak_at_s, self.at_peak = 0, 0.0, {}
    self.hwm: dict[int, tuple[int, str]] = {}
    self.trace: list[tuple[float, int]] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def start(self) -> "ProcessTreeMemory":
    self._t0 = time.perf_counter()
    self._thread.start()
    return self

  def _sample(self) -> None:
    try:
      procs = [self.root, *self.root.children(recursive=True)]
    except psutil.NoSuchProcess:
      return
    now, total = {}, 0
    for p in procs:
      try:
        rss = p.memory_info().rss
        with open(f"/proc/{p.pid}/status") as f:
          hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
        name = " ".join(p.cmdline()[1:4])
      except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, StopIteration):
        continue
      now[p.pid] = (rss, name)
      total += rss
      self.hwm[p.pid] = (max(hwm, self.hwm.get(p.pid, (0, ""))[0]), name)
    t = time.perf_counter() - self._t0
    self.trace.append((round(t, 3), total))
    if total > self.peak_bytes:
      self.peak_bytes, self.peak_at_s, self.at_peak = total, t, {n: r for r, n in now.values()}

  def _run(self) -> None:
    while not self._stop.is_set():
      self._sample()
      self._stop.wait(self.interval_s)

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()

  def summary(self) -> dict:
    return {
      "peak_gb": self.peak_bytes / 1e9,
      "peak_at_s": self.peak_at_s,
      "at_peak_gb": {n: r / 1e9 for n, r in self.at_peak.items()},
      "hwm_gb": {n: h / 1e9 for h, n in self.hwm.values()},
      "sum_of_hwm_gb": sum(h for h, _ in self.hwm.values()) / 1e9,
    }
