"""`mis-jax serve`: an HF checkpoint over SGLang's native HTTP API (`trainers.serving.embedded.server`,
or sglang-jax with `--engine sglang-jax`)."""

from __future__ import annotations

from trainers.serving.embedded import server


def main(argv: list[str] | None = None) -> int:
  return server.main(argv)
