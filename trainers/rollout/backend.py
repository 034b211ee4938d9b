"""The rollout backend, composed once from the config apart from the learner (as tunix keeps its
cluster apart from its trainer): who generates, and how the trainer's weights reach them.

`build_rollout` is the one place the backend is chosen:

- records (`rollout.records.load_dir`): a `RecordedRollouts` source and no servers' side at all;
- servers over HTTP (`rollout.placement.mode: server`): a client of one `HttpEngine` per URL (process
  0's) and the weight sync `rollout.sync.via` names (`WEIGHT_SYNCS`): `DiskSync` (the sharded HF
  checkpoint, then the client's update sequence) or `HttpSync` (streamed in buckets); with
  `rollout.transport.router`, a `fleet.RouterClient` instead: generation through sglang-router, the
  pushes to each of the workers it lists (workers that join are probed for the weight directory, then
  get the served weights);
- colocated (`rollout.placement.mode: colocated`): a client of the engine in this process
  (`colocated.EmbeddedLocal`, or `SGLangJaxLocal` for `rollout.placement.engine: sglang-jax`) and
  `MemorySync` (the weights handed over in memory).

The servers' side (`servers.Servers`) is the same for the last two; the source generates from it
synchronously, or ahead in a thread with bounded staleness (`rollout.sync.max_staleness > 0`).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import mis_jax
from trainers.runtime import distributed
from trainers.rollout.colocated import EmbeddedLocal, SGLangJaxLocal, arithmetic
from trainers.rollout.fleet import router_client
from trainers.rollout.servers import NoServers, Sampling, Servers
from trainers.rollout.client import SGLangClient, http_client
from trainers.rollout.sources import AsyncServerRollouts, RecordedRollouts, RolloutSource, ServerRollouts
from trainers.rollout.weight_stream import HttpSync
from trainers.rollout.weight_sync import DiskSync, MemorySync
from trainers.runtime.errors import ServerError
from trainers.serving.embedded.server import EmbeddedServer
from trainers.serving.sglang_jax import launcher as sglang_jax

LOCAL_ENGINES = {"embedded": EmbeddedLocal, "sglang-jax": SGLangJaxLocal}  # by rollout.placement.engine
WEIGHT_SYNCS = {"disk": DiskSync, "http": HttpSync}  # servers over HTTP, by rollout.sync.via


class Rollouts(NamedTuple):
  """What the loop generates from: the servers' side (`NoServers` when the rollouts are replayed
  from records) and the rollout source."""

  servers: Servers | NoServers
  source: RolloutSource


def build_rollout(
  cfg,
  *,
  urls: list[str],
  start_dir: str,
  model_config,
  sampling: Sampling,
  mesh,
  prompts: Callable[[int], list],
  episodes=None,
) -> Rollouts:
  """The backend of `cfg.rollout` (see the module doc). `urls`: the SGLang servers (none for
  records or colocated rollouts); `prompts(batch)`: the prompts of a rollout batch; `episodes`: an
  agent task's `(Episodes, make_env)` (its prompts start multi-turn trajectories), or None."""
  r = cfg.rollout
  if r.records.load_dir:
    return Rollouts(NoServers(r.records.load_dir), RecordedRollouts(r.records.load_dir, sampling.extras))
  if r.placement.mode == "colocated":
    if urls or r.transport.router:
      raise mis_jax.ConfigError(
        f"rollout.placement.mode colocated generates in the trainer: no server URL is used, "
        f"got {', '.join(urls or [r.transport.router])}"
      )
    engine = LOCAL_ENGINES[r.placement.engine].start(cfg, start_dir=start_dir, model_config=model_config, mesh=mesh)
    # No HTTP body to bound: the step's prompts go in one call, so the engine batches all of their
    # rows (up to its `max_batch_size` per compiled call) instead of running racing requests apart.
    client = SGLangClient(
      [engine],
      max_concurrency=r.transport.max_concurrency,
      prompts_per_request=r.prompts_per_step,
      cache_salt=r.sync.cache_salt,
    )
    weight_sync = MemorySync(client, engine, r)
  else:
    t = r.transport
    if t.router and urls:
      raise mis_jax.ConfigError(
        f"rollout.transport.router {t.router}: the workers are the router's own list; "
        f"give no server URL beside it (got {', '.join(urls)})"
      )
    make = (
      functools.partial(router_client, t.router, poll_s=t.router_poll_s)
      if t.router
      else functools.partial(http_client, urls)
    )
    client = (
      make(
        timeout_s=t.timeout_s,
        max_retries=t.max_retries,
        backoff_s=t.backoff_s,
        max_concurrency=t.max_concurrency,
        prompts_per_request=t.prompts_per_request,
        cache_salt=r.sync.cache_salt,
      )
      if distributed.is_primary()
      else None
    )  # only process 0 talks to the servers
    weight_sync = WEIGHT_SYNCS[r.sync.via].build(cfg, client, model_config)
    if t.router and client is not None and isinstance(weight_sync, DiskSync):
      client.admission_check = weight_sync.sees_weights  # a worker joining mid-run is probed as the fleet before step 1
  servers = Servers(
    cfg,
    client=client,
    weight_sync=weight_sync,
    start_dir=start_dir,
    model_config=model_config,
    sampling=sampling,
    episodes=episodes,
  )
  rejected = r.transport.max_rejected_fraction
  source = (
    AsyncServerRollouts(servers, prompts, rejected, r.sync.max_staleness, r.transport.timeout_s)
    if r.sync.max_staleness > 0
    else ServerRollouts(servers, prompts, rejected)
  )
  return Rollouts(servers, source)


def start_server(cfg, weights_dir: str, *, is_moe: bool):
  """The server a run without `--sglang-url` starts: `mis-jax serve`, or sglang-jax from its venv
  (`rollout.placement.engine`), serving the starting weights as version "0"."""
  r = cfg.rollout.placement
  if r.engine == "sglang-jax":
    try:
      server = sglang_jax.SGLangJaxServer(
        weights_dir,
        dtype=r.server_dtype,
        weight_version="0",
        enable_return_routed_experts=is_moe,
        extra=("--random-seed", str(cfg.seed)),
      )
    except sglang_jax.EngineUnavailable as e:
      raise mis_jax.ConfigError(f"rollout.placement.engine sglang-jax: {e}") from None
    except (RuntimeError, TimeoutError) as e:
      raise ServerError(f"sglang-jax did not start: {e}") from None
    print(f"sglang-jax {sglang_jax.VERSION} server on {server.url} ({r.server_dtype})")
    return server
  server = EmbeddedServer(
    weights_dir,
    dtype=r.server_dtype,
    seed=cfg.seed,
    quantize=r.server_quantize,
    layer_loop=cfg.model.layer_loop,
    arithmetic=arithmetic(cfg),
    extra_args=("--enable-return-routed-experts", "--weight-version", "0"),
  )
  print(f"embedded SGLang-protocol server on {server.url} ({r.server_dtype}{', exact' if r.exact else ''})")
  return server
