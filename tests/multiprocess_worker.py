"""One process of the 2-process x 4-CPU-device run (jax.distributed, gloo collectives).

Usage: python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON
Computes the sharded loss, metrics and Flax parameter gradients of every algorithm on one
global 8-device mesh and (process 0) writes them to OUT_JSON.
"""

import json
import os
import sys

# The repository first (tests/mis_jax, a folder of tests, must not shadow the package), then the
# tests' helpers and the library's tests (test_sharding).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE, os.path.join(_HERE, "mis_jax")]

import jax  # noqa: E402

pid, nproc, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.config.update("jax_num_cpu_devices", 8 // nproc)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
  coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=120
)

import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

import mis_jax  # noqa: E402
import test_sharding as ts  # noqa: E402  (the same batch, model and configs as the 1-process test)

assert jax.device_count() == 8 and jax.local_device_count() == 8 // nproc
mesh = jax.make_mesh((4, 2), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
spec = mis_jax.batch_partition_spec("data", "seq")
sharding = NamedSharding(mesh, spec)


def global_array(x):
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


batch = jax.tree_util.tree_map(global_array, ts.BATCH)
tokens, targets = global_array(ts.TOKENS), global_array(ts.TARGETS)
fns = [mis_jax.sharded_policy_loss(mesh, c, data_axis="data", seq_axis="seq") for c in ts.CONFIGS]
with jax.set_mesh(mesh):
  results = jax.jit(lambda p, b, x, y: ts.all_algorithms(fns, p, b, x, y))(ts.PARAMS, batch, tokens, targets)

local = lambda a: np.asarray(a.addressable_data(0)).tolist()
payload = [
  {
    "loss": local(loss),
    "metrics": {k: local(v) for k, v in metrics.items()},
    "grad": [local(g) for g in jax.tree_util.tree_leaves(grad)],
  }
  for loss, metrics, grad in results
]
if pid == 0:
  with open(out, "w") as f:
    json.dump(payload, f)
jax.distributed.shutdown()
