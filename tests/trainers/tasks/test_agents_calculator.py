"""Qwen3's tool format and the calculator task (`trainers.tasks.qwen3_tools`, `trainers.tasks.calculator`).

A character-level `transformers` tokenizer with Qwen3's special tokens and Qwen3's real chat
template is built here (no download). The observation ids an environment appends equal what
`apply_chat_template` renders after the model's ``<|im_end|>`` wherever the template is append-only;
where it is not (thinking dropped, the empty think block of ``enable_thinking: false``), the
trajectory built token in, token out keeps the sampled ids as they were."""

import hashlib
import json
import time

import pytest

from trainers.tasks import calculator as calc
from trainers.tasks import qwen3_tools as qwen3
from trainers.tasks.env import Turn
from trainers.tasks.base import Prompt

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHARS = tuple(chr(c) for c in range(32, 127)) + ("\n",)


def build_tokenizer(template=qwen3.QWEN3_CHAT_TEMPLATE):
  """Character-level BPE (no merges) with Qwen3's special tokens: ``<|im_start|>`` / ``<|im_end|>``
  / ``<|endoftext|>`` special, the think / tool tags added non-special (as Qwen3's are); EOS
  ``<|im_end|>``, pad ``<|endoftext|>`` (Qwen3's instruct tokenizer_config)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models
  from transformers import PreTrainedTokenizerFast

  vocab = {t: i for i, t in enumerate(SPECIAL + ADDED + ("<unk>",) + CHARS)}
  core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
  core.decoder = decoders.Fuse()
  tok = PreTrainedTokenizerFast(
    tokenizer_object=core,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    unk_token="<unk>",
    additional_special_tokens=["<|im_start|>", "<|im_end|>"],
  )
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
  tok.chat_template = template
  return tok


# Qwen2/Qwen3's pre-tokenizer split (tokenizer.json), before byte-level BPE: digits one by one.
QWEN_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
  r"|\s+(?!\S)|\s+"
)


def build_bytelevel_tokenizer():
  """Byte-level BPE as Qwen3's (its split, 600 tokens trained here on the template and a few
  words): merges across newlines and punctuation, so token boundaries are not characters."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  core = Tokenizer(models.BPE(unk_token=None))
  core.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  core.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=600,
    special_tokens=list(SPECIAL + ADDED),
    show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  words = "What is 12 * 34 + 5? user assistant system calculator expression arguments name " + calc.INSTRUCTION
  core.train_from_iterator([qwen3.QWEN3_CHAT_TEMPLATE, words] * 20, trainer)
  tok = PreTrainedTokenizerFast(
    tokenizer_object=core,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    additional_special_tokens=["<|im_start|>", "<|im_end|>"],
  )
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
  tok.chat_template = qwen3.QWEN3_CHAT_TEMPLATE
  return tok


@pytest.fixture(scope="module")
def bytelevel_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("qwen3-bytes"))
  build_bytelevel_tokenizer().save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("qwen3-chars"))
  build_tokenizer().save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def tok(tok_dir):
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)


@pytest.fixture(scope="module")
def task(tok_dir):
  return calc.CalculatorTask(tok_dir)


@pytest.fixture(scope="module")
def task_nothink(tok_dir):
  return calc.CalculatorTask(tok_dir, chat_template_kwargs={"enable_thinking": False})


def _ids(tok, text):
  return [int(t) for t in tok.encode(text, add_special_tokens=False)]


def _call(name, arguments):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _turn(tok, text, index=1, end="<|im_end|>", finish="stop"):
  """A model turn as the engine returns it: sampled ids (stop token kept), its text without specials."""
  return Turn(ids=tuple(_ids(tok, text + end)), text=text, finish_reason=finish, index=index)


def _assistant(content, *calls):
  m = {"role": "assistant", "content": content}
  if calls:
    m["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
  return m


def _render(tok, messages, **kw):
  return [
    int(t)
    for t in tok.apply_chat_template(
      messages, tools=[calc.CALCULATOR_SCHEMA], add_generation_prompt=True, tokenize=True, return_dict=False, **kw
    )
  ]


def _contains(seq, sub):
  return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_template_is_qwen3s_verbatim():
  assert hashlib.sha256(qwen3.QWEN3_CHAT_TEMPLATE.encode()).hexdigest() == qwen3.QWEN3_CHAT_TEMPLATE_SHA256
  for piece in (
    "<tool_response>",
    "multi_step_tool",
    "reasoning_content",
    "enable_thinking is false",
    "'<|im_start|>user'",
  ):
    assert piece in qwen3.QWEN3_CHAT_TEMPLATE


# (1) The observation ids equal the re-rendered conversation's tail where the template is append-only.
@pytest.mark.parametrize("kind", ["chars", "bytelevel"])
def test_observation_ids_equal_transformers_rendering(kind, request):
  from transformers import AutoTokenizer

  path = request.getfixturevalue("tok_dir" if kind == "chars" else "bytelevel_dir")
  tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
  task = calc.CalculatorTask(path)
  task_nothink = calc.CalculatorTask(path, chat_template_kwargs={"enable_thinking": False})
  prompt = task.prompts(0, 0, 1)[0]
  messages = task.messages(prompt.record["question"])
  a = {"expression": "12*34"}
  b = {"expression": "408+1"}
  # Turn 1: one call, no reasoning. Turn 2: reasoning, then two calls (two tool messages merge into
  # one user turn). Turn 3: the answer.
  t1 = _turn(tok, _call("calculator", a), 1)
  t2_text = (
    "<think>\nadd one\n</think>\n\n" + _call("calculator", b) + "\n" + _call("calculator", {"expression": "2**3"})
  )
  t2 = _turn(tok, t2_text, 2)
  env = task.environment(prompt)
  o1 = env.step(t1)
  assert not o1.done and o1.reward == 0.0 and o1.counts == {"tool_calls": 1, "tool_errors": 0, "malformed_calls": 0}
  o2 = env.step(t2)
  assert o2.counts["tool_calls"] == 2
  trajectory = list(prompt.ids) + list(t1.ids) + list(o1.ids) + list(t2.ids) + list(o2.ids)

  conversation = messages + [
    _assistant("", ("calculator", a)),
    {"role": "tool", "content": "408"},
    _assistant("<think>\nadd one\n</think>\n\n", ("calculator", b), ("calculator", {"expression": "2**3"})),
    {"role": "tool", "content": "409"},
    {"role": "tool", "content": "8"},
  ]
  assert trajectory == _render(tok, conversation)
  assert list(prompt.ids) + list(t1.ids) + list(o1.ids) == _render(tok, conversation[:3])
  text = tok.decode(o2.ids)
  assert text == (
    "\n<|im_start|>user\n<tool_response>\n409\n</tool_response>\n<tool_response>\n8\n</tool_response>"
    "<|im_end|>\n<|im_start|>assistant\n"
  )
  o3 = env.step(_turn(tok, f"<think>\ndone\n</think>\n\n\\boxed{{{prompt.answer}}}", 3))
  assert o3.done and o3.reward == 1.0 and not o3.ids

  # enable_thinking: false: the generation prompt after the tool responses carries the empty think block.
  o = task_nothink.encoder(["7"])
  assert tok.decode(o) == (
    "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
  )
  assert o == qwen3.tool_response_ids(tok, ["7"], {"enable_thinking": False})


def test_encoder_raises_when_the_base_is_not_a_prefix():
  # A template that numbers every message from the end: nothing rendered is stable under appending.
  template = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + (messages|length - loop.index0)|string + '\\n'"
    " + (m['content'] or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
  )
  with pytest.raises(qwen3.TemplateNotPrefixError, match="not append-only"):
    qwen3.ToolResponseEncoder(build_tokenizer(template))(["1"])


# (2) Not append-only: re-rendering changes earlier turns; token in, token out keeps them.
def test_rerendering_drops_thinking_but_the_trajectory_keeps_sampled_ids(tok, task, task_nothink):
  # (a) A thinking turn before a later user query loses its <think> block on re-render.
  first = [{"role": "user", "content": "What is 2+2?"}]
  prompt = _render(tok, first)
  sampled = _ids(tok, "<think>\nfour, surely\n</think>\n\n\\boxed{4}<|im_end|>")
  follow = first + [
    _assistant("<think>\nfour, surely\n</think>\n\n\\boxed{4}"),
    {"role": "user", "content": "And 3+3?"},
  ]
  rerendered = _render(tok, follow)
  think = _ids(tok, "<think>\nfour, surely\n</think>")
  assert rerendered[: len(prompt)] == prompt
  assert not _contains(rerendered, sampled) and not _contains(rerendered, think)
  assert tok.decode(rerendered[len(prompt) :]).startswith("\\boxed{4}<|im_end|>")  # the reasoning is gone
  trajectory = prompt + sampled
  assert trajectory[len(prompt) :] == sampled and _contains(trajectory, think)

  # (b) enable_thinking: false — the prompt ends with an empty think block the model continued
  # after; re-rendering the conversation omits it for that (now earlier) assistant turn.
  p = task_nothink.prompts(0, 0, 1)[0]
  assert tok.decode(p.ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  call = {"expression": "5*5"}
  t1 = _turn(tok, _call("calculator", call))
  o1 = task_nothink.environment(p).step(t1)
  tito = list(p.ids) + list(t1.ids) + list(o1.ids)
  conversation = task_nothink.messages(p.record["question"]) + [
    _assistant("", ("calculator", call)),
    {"role": "tool", "content": "25"},
  ]
  rerendered = _render(tok, conversation, enable_thinking=False)
  assert rerendered != tito
  empty_think = _ids(tok, "<think>\n\n</think>\n\n")
  assert tito[len(p.ids) - len(empty_think) : len(p.ids)] == empty_think
  assert rerendered.count(_ids(tok, "<think>")[0]) == 1  # only the new generation prompt's
  assert tito.count(_ids(tok, "<think>")[0]) == 2
  assert tito[len(p.ids) : len(p.ids) + len(t1.ids)] == list(t1.ids)  # the sampled ids, byte for byte
  assert rerendered[-len(o1.ids) :] == list(o1.ids)  # the observation is still the template's own tail


# (3) The calculator: arithmetic only, bounded; tools that raise or hang become error observations.
@pytest.mark.parametrize(
  "expression, want",
  [
    ("2+3*4", "14"),
    ("(2+3)*4", "20"),
    ("7/2", "3.5"),
    ("8/2", "4"),
    ("7//2", "3"),
    ("-7 % 3", "2"),
    ("2**10", "1024"),
    ("1.5*2", "3"),
    ("-(3-5)", "2"),
    ("2**-2", "0.25"),
    ("1/3", "0.333333333333"),
    (" 999999*999999 ", "999998000001"),
  ],
)
def test_calculator_evaluates(expression, want):
  assert calc.Calculator()(expression=expression) == want


@pytest.mark.parametrize(
  "expression, match",
  [
    ("__import__('os').system('true')", "function call"),
    ("x + 1", "name 'x'"),
    ("abs(-1)", "function call"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("[1, 2]", "List"),
    ("2 ^ 3", r"\*\*"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2**1000", "exponent"),
    ("10**20", "larger"),
    ("99999999**2", "larger"),
    ("1e300", "larger"),
    ("(-8) ** 0.5", "negative"),
    ("", "empty"),
    ("1+" * 150 + "1", "longer"),
    ("1 +", "not an arithmetic"),
    ("(1).real", "Attribute"),
    ("lambda: 1", "Lambda"),
  ],
)
def test_calculator_refuses(expression, match):
  with pytest.raises(calc.CalculatorError, match=match):
    calc.evaluate(expression)


def test_calculator_arguments():
  with pytest.raises(TypeError, match="missing"):
    calc.Calculator()()
  with pytest.raises(TypeError, match="unexpected"):
    calc.Calculator()(expression="1", precision=3)
  with pytest.raises(calc.CalculatorError, match="string"):
    calc.Calculator()(expression=12)


class Boom:
  name = "boom"

  def __call__(self, **arguments):
    raise RuntimeError("the tool broke")


class Sleepy:
  name = "sleepy"

  def __call__(self, **arguments):
    time.sleep(1.0)
    return "late"


def test_tool_errors_and_timeouts_are_observations(tok, task):
  env = calc.CalculatorEnvironment(7, encoder=task.encoder, tools=[calc.Calculator(), Boom(), Sleepy()], timeout_s=0.2)
  text = "\n".join(
    [
      _call("boom", {}),
      _call("sleepy", {}),
      _call("calculator", {"expression": "1/0"}),
      _call("calculator", {"expr": "1"}),
      _call("calculator", {"expression": "3+4"}),
    ]
  )
  start = time.monotonic()
  obs = env.step(_turn(tok, text))
  assert time.monotonic() - start < 0.9  # the sleeper's time limit, not its sleep
  assert not obs.done and obs.reward == 0.0
  assert obs.counts == {"tool_calls": 5, "tool_errors": 4, "malformed_calls": 0}
  shown = tok.decode(obs.ids)
  responses = shown.split("<tool_response>\n")[1:]
  assert len(responses) == 5 and shown.count("<|im_start|>user") == 1  # one user turn for the five responses
  assert "Error: tool 'boom' failed: RuntimeError: the tool broke" in responses[0]
  assert "Error: tool 'sleepy' timed out after 0.2 s" in responses[1]
  assert "division by zero" in responses[2]
  assert "unexpected arguments expr" in responses[3]
  assert responses[4].startswith("7\n</tool_response>")


# (4) Malformed calls: answered with an error, counted, never raised.
def test_parse_tool_calls():
  ok = qwen3.parse_tool_calls('x <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>')
  assert [(c.name, dict(c.arguments), c.ok) for c in ok] == [("calculator", {"expression": "1+1"}, True)]
  assert qwen3.parse_tool_calls("no calls, \\boxed{3}") == []
  assert qwen3.parse_tool_calls('<think><tool_call>{"name": "a"}</tool_call></think>done') == []  # thought, not called
  as_string = qwen3.parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>')
  assert as_string[0].ok and as_string[0].arguments == {"x": 1}
  no_args = qwen3.parse_tool_calls('<tool_call>{"name": "a"}</tool_call><|im_end|>')
  assert no_args[0].ok and no_args[0].arguments == {}
  cases = {
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}\n</tool_call>': "not valid JSON",
    '<tool_call>{"arguments": {}}</tool_call>': 'no "name"',
    '<tool_call>{"name": 3}</tool_call>': 'no "name"',
    '<tool_call>["calculator"]</tool_call>': "JSON object",
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>': '"arguments" must be a JSON object',
    '<tool_call>{"name": "a", "arguments": "1 +"}</tool_call>': "not a JSON object",
    "<tool_call></tool_call>": "empty",
    '<tool_call>{"name": "a", "arguments": {}}': "without </tool_call>",
  }
  for text, why in cases.items():
    (call,) = qwen3.parse_tool_calls(text)
    assert not call.ok and why in call.error, (text, call.error)


def test_malformed_calls_are_error_observations(tok, task):
  env = task.environment(Prompt(ids=(), answer=4))
  text = "\n".join(
    [
      '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"\n</tool_call>',
      _call("search", {"query": "2+2"}),
      _call("calculator", {"expression": "2+2"}),
    ]
  )
  obs = env.step(_turn(tok, text))
  assert not obs.done and obs.counts == {"tool_calls": 3, "tool_errors": 0, "malformed_calls": 2}
  shown = tok.decode(obs.ids)
  assert "Error: malformed tool call: tool call is not valid JSON" in shown
  assert "Error: unknown tool 'search' (tools: calculator)" in shown
  assert "<tool_response>\n4\n</tool_response>" in shown
  assert shown.startswith("\n<|im_start|>user\n") and shown.endswith("<|im_start|>assistant\n")

  many = calc.CalculatorEnvironment(0, encoder=task.encoder, max_calls_per_turn=2)
  obs = many.step(_turn(tok, "".join(_call("calculator", {"expression": "1"}) for _ in range(3))))
  assert obs.counts == {"tool_calls": 3, "tool_errors": 0, "malformed_calls": 1}
  assert "more than 2 tool calls" in tok.decode(obs.ids)

  # A turn that stopped on <|endoftext|> rather than <|im_end|>: the observation closes it first.
  obs = env.step(_turn(tok, _call("calculator", {"expression": "1"}), end="<|endoftext|>"))
  assert tok.decode(obs.ids).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n")


# (5) The answer turn.
def test_answer_turn_reward_and_done(tok, task):
  env = task.environment(Prompt(ids=(), answer=408))
  for text, reward in [
    ("<think>\n12*34 = 408\n</think>\n\nThe answer is \\boxed{408}.", 1.0),
    ("\\boxed{408.0}", 1.0),
    ("\\boxed{$408$}", 1.0),
    ("\\boxed{409}", 0.0),
    ("It is 400 + 8 = 408", 1.0),
    ("408, or maybe 407", 0.0),
    ("\\boxed{about 408}", 0.0),
    ("<think>\nthe answer is 408\n</think>\n\nno idea", 0.0),
    ("", 0.0),
  ]:
    obs = env.step(_turn(tok, text, index=2))
    assert obs.done and obs.reward == reward and not obs.ids, text
  assert calc.score_answer("\\boxed{1,234}", 1234) == 1.0 and calc.score_answer("so x = -5", -5) == 1.0
  assert calc.score_answer("\\boxed{-5}", "-5") == 1.0 and calc.score_answer("12-4", 4) == 1.0  # 4, not -4
  # A turn cut by the token limit ends the trajectory; its (incomplete) calls are not run.
  cut = env.step(_turn(tok, "\\boxed{408} " + _call("calculator", {"expression": "1"})[:-3], end="", finish="length"))
  assert cut.done and cut.reward == 1.0 and not cut.ids


# (6) The task's prompts: deterministic, rendered with the template and the tools.
def test_task_prompts(tok, tok_dir, task):
  a, b = task.prompts(3, 5, 8), calc.CalculatorTask(tok_dir).prompts(3, 5, 8)
  assert a == b and a != task.prompts(3, 6, 8) and a != task.prompts(4, 5, 8)
  assert len({p.record["expression"] for p in a}) > 1
  for p in a:
    assert p.answer == eval(p.record["expression"])  # the test may; the calculator does not
    assert list(p.ids) == _render(tok, [{"role": "user", "content": p.record["question"]}])
    assert len(p.ids) <= task.max_prompt_len
    text = tok.decode(p.ids)
    system, user = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools") and '"name": "calculator"' in system
    assert user == f"<|im_start|>user\n{p.record['question']}<|im_end|>\n<|im_start|>assistant\n"
    assert "\\boxed{N}" in p.record["question"]
  im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
  assert task.stop_token_ids == (im_end, eot)
  assert task.max_new_tokens == 512 and "calculator" in task.summary
  with_system = calc.CalculatorTask(tok, system_prompt="Be exact.").prompts(3, 5, 1)[0]
  assert tok.decode(with_system.ids).startswith("<|im_start|>system\nBe exact.\n\n# Tools")
  env = task.environment(a[0])
  assert env.answer == a[0].answer and set(env.tools) == {"calculator"}


def test_environments_step_concurrently(tok, task):
  from concurrent.futures import ThreadPoolExecutor

  prompts = task.prompts(0, 1, 32)
  turns = [_turn(tok, _call("calculator", {"expression": p.record["expression"]})) for p in prompts]
  alone = [task.environment(p).step(t) for p, t in zip(prompts, turns)]
  with ThreadPoolExecutor(16) as pool:
    together = list(pool.map(lambda pt: task.environment(pt[0]).step(pt[1]), zip(prompts, turns)))
  assert together == alone
  assert [tok.decode(o.ids).split("\n")[3] for o in alone] == [str(p.answer) for p in prompts]


def test_task_rejects_bad_tokenizers(tok_dir):
  assert calc.CalculatorTask(model_path=tok_dir).stop_token_ids
  with pytest.raises(ValueError, match="no tokenizer"):
    calc.CalculatorTask()
  with pytest.raises(ValueError, match="no such directory"):
    calc.CalculatorTask("/nonexistent/tokenizer")
  with pytest.raises(ValueError, match="does not render tools"):
    calc.CalculatorTask(build_tokenizer("{%- for m in messages %}{{ m['content'] }}<|im_end|>{%- endfor %}"))
  with pytest.raises(ValueError, match="never reads"):
    calc.CalculatorTask(tok_dir, chat_template_kwargs={"thinking_budget": 3})
  with pytest.raises(ValueError, match="vocabulary"):
    calc.CalculatorTask(tok_dir, vocab_size=16)
