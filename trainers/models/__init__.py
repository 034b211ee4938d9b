"""Decoder-only policy models in Flax NNX with Hugging Face checkpoint I/O.

Architectures register themselves (`registry.py`): `qwen.py` (Qwen2, Qwen3), `llama.py`
(Llama 2/3.x) and `qwen_moe.py` (Qwen3-MoE, its experts in `moe.py`), all on the shared
decoder of `decoder.py`. A new architecture is one module and
one import below.
"""

from trainers.models import llama, qwen, qwen_moe  # noqa: F401 - registers the architectures
from trainers.models.config import DecoderFeatures, ModelConfig, RopeScaling
from trainers.models.decoder import CausalLM, LayerCache, Routing, teacher_forced_logprobs
from trainers.models.hf_io import (
  DTYPES,
  abstract_model,
  checkpoint_dir_problem,
  hf_state_dict,
  init_checkpoint,
  load_hf_checkpoint,
  load_hf_params,
  read_hf_tensors,
  save_hf_checkpoint,
  state_from_hf_tensors,
)
from trainers.models.presets import PRESETS
from trainers.models.registry import Family, family, model_types

__all__ = [
  "PRESETS",
  "ModelConfig",
  "RopeScaling",
  "DecoderFeatures",
  "CausalLM",
  "LayerCache",
  "Routing",
  "teacher_forced_logprobs",
  "Family",
  "family",
  "model_types",
  "abstract_model",
  "checkpoint_dir_problem",
  "hf_state_dict",
  "init_checkpoint",
  "load_hf_checkpoint",
  "load_hf_params",
  "read_hf_tensors",
  "save_hf_checkpoint",
  "state_from_hf_tensors",
  "DTYPES",
]
