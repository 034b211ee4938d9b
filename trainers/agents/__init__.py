"""Multi-turn, tool-using rollouts (agents): environments and tools as small named parts, and the
episode driver that turns a batch of prompts into token-in-token-out trajectories.

- `env`: what an environment and a tool are (`Environment`, `Tool`, `Observation`, `Turn`), and
  `call_tool` (a tool that raises or runs past its time limit becomes an error observation);
- `episodes`: `Episodes`, the driver: every turn of every live trajectory goes to the engines in
  one batched `/generate` (context as `input_ids`), the environments step concurrently in a
  bounded pool, and each trajectory comes back as one `Sample` whose response holds the model's
  and the environment's tokens, told apart by the `turn` per-token extra (0: environment).
"""
