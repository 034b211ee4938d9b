"""The `dataset` task: chat-template prompts equal `transformers`' own rendering (tokenizers built
in-process, no downloads); verl and TRL layouts in JSONL and Parquet load to the same prompts;
bad files, rows and columns are errors naming them, before any server starts (exit 2 from the
CLI); the committed GSM8K sample is what its script writes; the example config trains end to
end on the embedded server."""

import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainers import cli
from trainers.tasks import DatasetTask, Prompt, chat, gsm8k_sample
from trainers.tasks.dataset import PROMPT_KEYS

VOCAB = 64  # the tiny presets' vocabulary

LLAMA_TEMPLATE = (  # a Llama-3-style template: a default system turn, <|eot_id|> ends a turn
  "{{- '<|begin_of_text|>' }}"
  "{%- if messages[0]['role'] != 'system' %}"
  "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nbe brief<|eot_id|>' }}{%- endif %}"
  "{%- for m in messages %}"
  "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
  """The GSM8K sample's character-level BPE tokenizer with a ChatML template, built here."""
  path = str(tmp_path_factory.mktemp("chatml-tokenizer"))
  gsm8k_sample.build_tokenizer().save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  """A word-level tokenizer with a Llama-3-style template, built here."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "[UNK]"]
  words = "system user assistant be brief what is two plus ?".split()
  core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(special + words)}, unk_token="[UNK]"))
  core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok = PreTrainedTokenizerFast(
    tokenizer_object=core,
    eos_token="<|end_of_text|>",
    bos_token="<|begin_of_text|>",
    unk_token="[UNK]",
    additional_special_tokens=special[2:5],
  )
  tok.chat_template = LLAMA_TEMPLATE
  path = str(tmp_path_factory.mktemp("llama-tokenizer"))
  tok.save_pretrained(path)
  return path


def _hf(path):
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def test_chat_prompts_are_transformers_own_rendering(tmp_path, chatml_dir, llama_dir):
  hf = _hf(chatml_dir)
  question = "Ann has 3 pens. She buys 4 more. How many pens does she have?"
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
  data = _jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "answer": "7"}])
  text = _jsonl(tmp_path / "text.jsonl", [{"prompt": question, "answer": "7"}])
  for kwargs in ({}, {"enable_thinking": False}):
    task = DatasetTask(data, "math", tokenizer=chatml_dir, chat_template_kwargs=kwargs, vocab_size=VOCAB)
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
    assert list(task.records[0].ids) == want
    # The same ids from the template written out by hand: an independent oracle.
    by_hand = (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + question + "<|im_end|>\n"
      "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if kwargs else "")
    )
    assert want == hf.encode(by_hand)
    # A plain prompt string is one user message (chat_template: null = the tokenizer has one).
    task = DatasetTask(text, "math", tokenizer=chatml_dir, chat_template_kwargs=kwargs, vocab_size=VOCAB)
    user = [{"role": "user", "content": question}]
    assert list(task.records[0].ids) == hf.apply_chat_template(
      user, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
  thinking_off = DatasetTask(data, "math", tokenizer=chatml_dir, chat_template_kwargs={"enable_thinking": False})
  assert thinking_off.records[0].ids != DatasetTask(data, "math", tokenizer=chatml_dir).records[0].ids
  # chat_template: false encodes the text as it is.
  raw = DatasetTask(text, "math", tokenizer=chatml_dir, chat_template=False)
  assert list(raw.records[0].ids) == hf.encode(question)
  # Stop tokens: the template's end of turn, then EOS.
  assert raw.stop_token_ids == (hf.convert_tokens_to_ids("<|im_end|>"), hf.eos_token_id) == (2, 0)
  llama = _hf(llama_dir)
  task = DatasetTask(
    _jsonl(tmp_path / "l.jsonl", [{"prompt": "what is two plus two ?", "answer": "4"}]),
    "exact_match",
    tokenizer=llama_dir,
  )
  user = [{"role": "user", "content": "what is two plus two ?"}]
  assert list(task.records[0].ids) == llama.apply_chat_template(
    user, add_generation_prompt=True, tokenize=True, return_dict=False
  )
  assert task.stop_token_ids == tuple(llama.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"]))
  # The reward sees the response decoded without special tokens (the stop token is not text).
  response = llama.encode("two", add_special_tokens=False) + [llama.convert_tokens_to_ids("<|eot_id|>")]
  assert task.reward(task.records[0], response, "server text is not used") == 0.0
  assert task.reward(Prompt(task.records[0].ids, answer="two"), response, "") == 1.0


def _layouts(tmp_path):
  """Six GSM8K problems in the layouts verl and TRL users have, with the config keys they need."""
  rows = gsm8k_sample.verl_rows()[:6]
  user = [r["prompt"][0]["content"] for r in rows]
  trl_chat = [
    {"prompt": [{"role": "user", "content": u}], "solution": r["extra_info"]["answer"]} for u, r in zip(user, rows)
  ]
  (tmp_path / "shards").mkdir()
  _parquet(tmp_path / "shards" / "train-00000-of-00002.parquet", rows[:4])
  _parquet(tmp_path / "shards" / "train-00001-of-00002.parquet", rows[4:])
  return rows, {
    "verl parquet": (_parquet(tmp_path / "verl.parquet", rows), {}),
    "verl jsonl": (_jsonl(tmp_path / "verl.jsonl", rows), {}),
    "verl shards (directory)": (str(tmp_path / "shards"), {}),
    "verl shards (glob)": (str(tmp_path / "shards" / "train-*.parquet"), {}),
    "trl chat prompt parquet": (_parquet(tmp_path / "trl.parquet", trl_chat), {}),
    "trl messages jsonl": (
      _jsonl(
        tmp_path / "trl_messages.jsonl",
        [
          {"messages": [{"role": "user", "content": u}], "answer": r["reward_model"]["ground_truth"]}
          for u, r in zip(user, rows)
        ],
      ),
      {},
    ),
    "trl text prompt jsonl": (
      _jsonl(
        tmp_path / "trl_text.jsonl",
        [{"prompt": u, "extra": {"gt": int(r["reward_model"]["ground_truth"])}} for u, r in zip(user, rows)],
      ),
      {"answer_key": "extra.gt"},
    ),
    "renamed columns": (
      _jsonl(
        tmp_path / "renamed.jsonl",
        [
          {"question": {"chat": [{"role": "user", "content": u}]}, "label": r["reward_model"]["ground_truth"]}
          for u, r in zip(user, rows)
        ],
      ),
      {"prompt_key": "question.chat", "answer_key": "label"},
    ),
  }


def test_verl_and_trl_layouts_in_jsonl_and_parquet_load_to_the_same_prompts(tmp_path, chatml_dir):
  rows, layouts = _layouts(tmp_path)
  hf = _hf(chatml_dir)
  want = [
    hf.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False) for r in rows
  ]
  results = [r["reward_model"]["ground_truth"] for r in rows]
  for name, (path, keys) in layouts.items():
    task = DatasetTask(path, "math", tokenizer=chatml_dir, vocab_size=VOCAB, **keys)
    assert [list(p.ids) for p in task.records] == want, name
    right = [task.reward(p, hf.encode(f"so {c}.\n#### {c}") + [2], "") for p, c in zip(task.records, results)]
    wrong = [task.reward(p, hf.encode(f"#### {int(c) + 1}"), "") for p, c in zip(task.records, results)]
    assert right == [1.0] * 6 and wrong == [0.0] * 6, name
  auto = DatasetTask(layouts["verl parquet"][0], "math", tokenizer=chatml_dir)
  assert (auto.prompt_key, auto.answer_key) == ("prompt", "reward_model.ground_truth")
  assert DatasetTask(layouts["trl chat prompt parquet"][0], "math", tokenizer=chatml_dir).answer_key == "solution"
  assert PROMPT_KEYS == ("prompt_ids", "messages", "prompt")


def test_token_id_records_and_reward_functions_by_import_path(tmp_path, chatml_dir):
  data = _jsonl(tmp_path / "data.jsonl", [{"prompt_ids": [1, 3 + i], "answer": 3 + i} for i in range(5)])
  # model.path's tokenizer is loaded only when something needs it (here nothing: a directory without one is fine).
  task = DatasetTask(
    data, "test_tasks:first_token_reward", stop_token_ids=[2], vocab_size=VOCAB, model_path=str(tmp_path)
  )
  assert task.tokenizer is None and task.stop_token_ids == (2,)
  assert DatasetTask(data, "test_tasks:first_token_reward", model_path=chatml_dir).stop_token_ids == (2, 0)
  step0 = task.prompts(seed=0, step=0, count=3)
  assert [p.ids for p in step0] == [p.ids for p in task.prompts(seed=0, step=0, count=3)]
  seen = [p.ids for s in range(5) for p in task.prompts(seed=0, step=s, count=3)]
  assert len(set(seen[:5])) == 5  # an epoch visits every record once
  assert task.reward(step0[0], [step0[0].record["answer"], 2], "") == 1.0
  assert task.reward(step0[0], [0, 2], "") == 0.0


def first_token_reward(record, response_ids, text):
  return float(bool(response_ids) and response_ids[0] == record["answer"])


def _write(path, content):
  (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
  return str(path)


def test_bad_files_rows_and_columns_are_errors_naming_them(tmp_path, chatml_dir):
  ok = {"prompt": "Ann has 3 pens. How many pens?", "answer": "3"}
  verl = gsm8k_sample.verl_rows()[:2]
  no_truth = [verl[0], dict(verl[1], reward_model={"style": "rule", "ground_truth": None})]
  (tmp_path / "empty").mkdir()
  cases = [  # (path, reward, task keys, message pieces)
    (
      _jsonl(tmp_path / "a.jsonl", [ok, {"question": "x", "answer": "3"}]),
      "math",
      {},
      ["a.jsonl:2: no column 'prompt' (task.prompt_key)", "columns: question, answer"],
    ),
    (
      _parquet(tmp_path / "b.parquet", no_truth),
      "math",
      {},
      ["b.parquet row 1: no column 'reward_model.ground_truth'", "reward_model.style"],
    ),
    (
      _jsonl(tmp_path / "c.jsonl", [{"question": "x"}]),
      "math",
      {},
      ["c.jsonl:1: no prompt column (prompt_ids / messages / prompt); set task.prompt_key", "question"],
    ),
    (_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}]), "math", {}, ["d.jsonl:1: no ground-truth column"]),
    (
      _write(tmp_path / "e.jsonl", json.dumps(ok) + "\n\n" + '{"prompt": "x",}\n'),
      "math",
      {},
      ["e.jsonl:3: invalid JSON"],
    ),
    (_write(tmp_path / "f.jsonl", "[1, 2]\n"), "math", {}, ["f.jsonl:1: a record must be a JSON object"]),
    (_write(tmp_path / "g.parquet", b"not parquet at all"), "math", {}, ["g.parquet: not a readable Parquet file"]),
    (str(tmp_path / "empty"), "math", {}, ["empty", "holds no .jsonl or .parquet file"]),
    (str(tmp_path / "missing.parquet"), "math", {}, ["dataset not found", "missing.parquet"]),
    (str(tmp_path / "nothing-*.parquet"), "math", {}, ["nothing-*.parquet", "no file matches"]),
    (_write(tmp_path / "h.csv", "prompt\nx\n"), "math", {}, ["h.csv: unknown dataset format"]),
    (_jsonl(tmp_path / "i.jsonl", []), "math", {}, ["i.jsonl", "no records"]),
    (
      _jsonl(tmp_path / "j.jsonl", [ok, {"prompt": [{"role": "user"}], "answer": "3"}]),
      "math",
      {},
      ["j.jsonl:2: column 'prompt': message 0 must be {role: str, content: str}"],
    ),
    (
      _jsonl(tmp_path / "k.jsonl", [ok, {"prompt": 5, "answer": "3"}]),
      "math",
      {},
      ["k.jsonl:2: column 'prompt' must be a non-empty list of token ids, a list of chat messages or a string"],
    ),
    (
      _jsonl(tmp_path / "l.jsonl", [{"prompt_ids": [1, 2], "answer": "3"}, {"prompt_ids": [1, 99], "answer": "3"}]),
      "math",
      {},
      ["l.jsonl:2: prompt token id 99 is outside the model's vocabulary (0..63)"],
    ),
    (
      _jsonl(tmp_path / "m.jsonl", [ok, dict(ok, answer="")]),
      "math",
      {},
      ["m.jsonl:2: column 'answer': math-verify cannot read the ground truth ''"],
    ),
    (
      _jsonl(tmp_path / "n.jsonl", [ok, dict(ok, answer=["3"])]),
      "exact_match",
      {},
      ["n.jsonl:2: column 'answer' must be a string or a number, got list"],
    ),
    (
      _parquet(tmp_path / "o.parquet", verl),
      "math",
      {"chat_template": False},
      ["o.parquet row 0: column 'prompt' holds chat messages but task.chat_template is false"],
    ),
    (
      _jsonl(tmp_path / "p.jsonl", [ok]),
      "math",
      {"chat_template_kwargs": {"enable_thinkng": False}},
      ["chat_template_kwargs", "never reads enable_thinkng", "enable_thinking"],
    ),
    (_jsonl(tmp_path / "q.jsonl", [ok]), "mathh", {}, ["task.reward_fn: unknown reward 'mathh'", "math, exact_match"]),
    (_jsonl(tmp_path / "r.jsonl", [ok]), "math", {"stop_token_ids": [64]}, ["task.stop_token_ids: 64"]),
    (
      _jsonl(tmp_path / "s.jsonl", [{"prompt_ids": []}]),
      "test_tasks:first_token_reward",
      {"stop_token_ids": [2]},
      ["s.jsonl:1: column 'prompt_ids' must be a non-empty list of token ids"],
    ),
    (_jsonl(tmp_path / "t.jsonl", [ok]), "nope:fn", {}, ["task.reward_fn", "cannot import module 'nope'"]),
  ]
  for path, reward, keys, pieces in cases:
    with pytest.raises((ValueError, FileNotFoundError)) as e:
      DatasetTask(path, reward, tokenizer=chatml_dir, vocab_size=VOCAB, **keys)
    for piece in pieces:
      assert piece in str(e.value), (piece, str(e.value))
  with pytest.raises(ValueError, match="the tokenizer has 64 tokens but the model's vocabulary only 32"):
    DatasetTask(str(tmp_path / "p.jsonl"), "math", tokenizer=chatml_dir, vocab_size=32)
  with pytest.raises(ValueError, match=r"needs a tokenizer \(a built-in reward decodes responses with it\)"):
    DatasetTask(str(tmp_path / "l.jsonl"), "math")
  with pytest.raises(ValueError, match=r"p.jsonl:1 has a text or chat prompt in 'prompt'"):
    DatasetTask(str(tmp_path / "p.jsonl"), "test_tasks:first_token_reward", stop_token_ids=[2])
  with pytest.raises(ValueError, match="tokenizer .*nowhere.*: no such directory"):
    DatasetTask(str(tmp_path / "p.jsonl"), "math", tokenizer=str(tmp_path / "nowhere"))


def _cli_train(tmp_path, *sets):
  run_dir = tmp_path / "run"
  argv = ["train", "--config", "configs/gsm8k_example.yaml", "--run-dir", str(run_dir), "--no-progress"]
  for s in sets:
    argv += ["--set", s]
  return cli.main(argv), run_dir


@pytest.mark.integration
def test_bad_datasets_stop_the_cli_before_any_server_starts(tmp_path, chatml_dir, capsys):
  rows = gsm8k_sample.verl_rows()[:3]
  bad_row = _parquet(tmp_path / "bad.parquet", rows[:2] + [dict(rows[2], reward_model={"style": "rule"})])
  cases = [
    ([f"task.path={bad_row}"], ["bad.parquet row 2: no column 'reward_model.ground_truth'"]),
    ([f"task.path={_write(tmp_path / 'x.jsonl', '{oops')}"], ["x.jsonl:1: invalid JSON"]),
    ([f"task.path={tmp_path / 'none.parquet'}"], ["task.path: dataset not found", "none.parquet"]),
    (["task.prompt_key=question"], ["train.parquet row 0: no column 'question' (task.prompt_key)"]),
    (["task.reward_fn=mathh"], ["task.reward_fn has invalid value 'mathh'"]),
    (["task.reward_fn=no_such_module:f"], ["no_such_module"]),
    (
      ["task.num_digits=3"],
      ["configs/gsm8k_example.yaml: task.num_digits is a key of the toy tasks, not of 'dataset'"],
    ),
    (["task.name=copy_digits"], ["task.answer_key is not a key of task 'copy_digits'"]),
    ([f"task.tokenizer={tmp_path / 'no-tokenizer'}"], ["no-tokenizer", "no such directory"]),
    (["train.row_len=100"], ["train.row_len (100)", "longest prompt (176 tokens)"]),
    (["task.stop_token_ids=[1, x]"], ["task.stop_token_ids[1] must be an integer"]),
  ]
  for sets, pieces in cases:
    code, run_dir = _cli_train(tmp_path, f"task.tokenizer={chatml_dir}", *sets)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in captured.err, captured
    for piece in pieces:
      assert piece in lines[0], (piece, lines[0])
    assert "embedded SGLang-protocol server" not in captured.out and not run_dir.exists()


def test_the_committed_sample_is_what_its_script_writes(tmp_path):
  root = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "gsm8k_sample")
  assert pq.read_table(os.path.join(root, "train.parquet")).to_pylist() == gsm8k_sample.verl_rows()
  gsm8k_sample.build_tokenizer().save_pretrained(str(tmp_path))
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    with open(os.path.join(root, "tokenizer", name)) as committed, open(tmp_path / name) as fresh:
      assert committed.read() == fresh.read(), name
  assert chat.has_chat_template(_hf(os.path.join(root, "tokenizer")))


@pytest.mark.integration
def test_the_gsm8k_example_trains_on_the_embedded_server(tmp_path, chatml_dir, capsys):
  # Two steps; dense attention without remat compiles fastest at this size.
  code, run_dir = _cli_train(
    tmp_path, f"task.tokenizer={chatml_dir}", "train.steps=2", "model.attention=dense", "model.remat=none"
  )
  out = capsys.readouterr().out
  assert code == 0, out
  assert (
    "task: dataset data/gsm8k_sample/train.parquet: 32 records, prompt 'prompt' (chat messages, chat template)" in out
    and "reward math, stop tokens [2, 0]" in out
  )
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:
    assert r["num_samples"] == 16 and 0.0 <= r["reward_mean"] <= 1.0 and math.isfinite(r["loss"])
    assert r["response_length"] > 1
  assert "reward: first 2 steps mean" in out
