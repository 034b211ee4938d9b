"""Qwen2/Qwen3 policy model in Flax NNX with Hugging Face checkpoint I/O."""

from trainers.models.config import PRESETS, ModelConfig
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
from trainers.models.qwen import LayerCache, Qwen, teacher_forced_logprobs

__all__ = [
    "PRESETS", "ModelConfig", "Qwen", "LayerCache", "teacher_forced_logprobs",
    "abstract_model", "checkpoint_dir_problem", "hf_state_dict", "init_checkpoint", "load_hf_checkpoint", "load_hf_params", "read_hf_tensors",
    "save_hf_checkpoint", "state_from_hf_tensors", "DTYPES",
]
