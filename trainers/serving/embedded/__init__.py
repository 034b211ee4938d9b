"""The embedded SGLang-protocol engine (`mis-jax serve`): `generation` (`GenerationEngine`: model,
sampler, scheduler thread, weights, pause/abort), `sampler` (the jitted KV-cache sampler),
`http_app` (the FastAPI routes) and `server` (command line, uvicorn, the `EmbeddedServer`
launcher). The wire schema it shares with the client is `trainers.serving.protocol`."""
