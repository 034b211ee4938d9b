"""Writes the committed GSM8K-format sample ``data/gsm8k_sample`` (nothing is downloaded).

    python -m trainers.tasks.gsm8k_sample --out data/gsm8k_sample

- ``train.parquet``: small one-step word problems (generated here, deterministic) in the layout
  verl's ``examples/data_preprocess/gsm8k.py`` writes: ``data_source``, ``prompt`` (one user
  message: the question + verl's "think step by step" instruction), ``ability``,
  ``reward_model`` ``{style: rule, ground_truth}``, ``extra_info`` ``{split, index, answer,
  question}`` with GSM8K's ``answer`` (a solution ending in ``#### N``).
- ``tokenizer/``: a 64-token character-level Hugging Face tokenizer (lower-cased text, ChatML
  special tokens ``<|im_start|>`` / ``<|im_end|>``, EOS ``<|endoftext|>``) with a Qwen-style chat
  template that reads ``enable_thinking`` — it fits the tiny presets' 64-token vocabulary, so
  ``configs/gsm8k_example.yaml`` trains a tiny model end to end on a CPU.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k.py
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!'\"#$%:-+*/=()<>{}\\"
CHAT_TEMPLATE = (
  "{%- for message in messages %}"
  "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
  "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
  "{%- endif %}"
)

NAMES = (("Ann", "she"), ("Ben", "he"), ("Maya", "she"), ("Omar", "he"), ("Lena", "she"), ("Raj", "he"))
ITEMS = ("apples", "pens", "books", "stickers", "marbles", "cards")


def problems(count: int = 32, seed: int = 0) -> list[tuple[str, str, int]]:
  """``(question, GSM8K answer, result)`` triples: one-step additions, subtractions,
  multiplications and divisions with small numbers."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(count):
    (name, pronoun), items = NAMES[rng.integers(len(NAMES))], ITEMS[rng.integers(len(ITEMS))]
    a, b = int(rng.integers(2, 10)), int(rng.integers(2, 10))
    kind = i % 4
    if kind == 0:
      c = a + b
      q = f"{name} has {a} {items}. {pronoun.capitalize()} buys {b} more. How many {items} does {name} have now?"
      sol = f"{name} has {a} + {b} = <<{a}+{b}={c}>>{c} {items} now."
    elif kind == 1:
      a, b = max(a, b) + 1, min(a, b)
      c = a - b
      q = f"{name} had {a} {items} and gave {b} of them to a friend. How many {items} does {name} have left?"
      sol = f"{name} has {a} - {b} = <<{a}-{b}={c}>>{c} {items} left."
    elif kind == 2:
      c = a * b
      q = f"{name} buys {a} boxes with {b} {items} in each box. How many {items} does {name} buy?"
      sol = f"{name} buys {a} * {b} = <<{a}*{b}={c}>>{c} {items}."
    else:
      c = a
      q = f"{name} puts {a * b} {items} into {b} equal groups. How many {items} are in each group?"
      sol = f"Each group has {a * b} / {b} = <<{a * b}/{b}={c}>>{c} {items}."
    out.append((q, f"{sol}\n#### {c}", c))
  return out


def verl_rows(split: str = "train", **kwargs) -> list[dict]:
  """The problems as verl's GSM8K preprocessing writes them."""
  return [
    {
      "data_source": "openai/gsm8k",
      "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
      "ability": "math",
      "reward_model": {"style": "rule", "ground_truth": str(c)},
      "extra_info": {"split": split, "index": i, "answer": answer, "question": q},
    }
    for i, (q, answer, c) in enumerate(problems(**kwargs))
  ]


def build_tokenizer():
  """The sample's character-level tokenizer (a `transformers` fast tokenizer, built in-process)."""
  from tokenizers import Tokenizer, decoders, models, normalizers
  from transformers import PreTrainedTokenizerFast

  vocab = {t: i for i, t in enumerate(SPECIAL + tuple(CHARS))}
  # BPE with no merges over a character vocabulary: every character is one token.
  core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
  core.normalizer = normalizers.Lowercase()
  core.decoder = decoders.Fuse()
  tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=core,
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    unk_token="<unk>",
    additional_special_tokens=["<|im_start|>", "<|im_end|>"],
  )
  tokenizer.chat_template = CHAT_TEMPLATE
  return tokenizer


def write_sample(out: str) -> None:
  import pyarrow as pa
  import pyarrow.parquet as pq

  os.makedirs(out, exist_ok=True)
  pq.write_table(pa.Table.from_pylist(verl_rows()), os.path.join(out, "train.parquet"))
  build_tokenizer().save_pretrained(os.path.join(out, "tokenizer"))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="data/gsm8k_sample")
  args = parser.parse_args(argv)
  write_sample(args.out)
  print(f"wrote {args.out}/train.parquet ({len(verl_rows())} rows) and {args.out}/tokenizer")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
