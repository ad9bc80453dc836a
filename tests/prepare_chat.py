"""The Python half of prepare_chat_test.sh: examples/llama/prepare_chat.py on tiny offline
tokenizer folders, every id and mask bit checked against values written out here.

    prepare_chat.py PREPARE_CHAT_PY DIR SHOW_SAMPLES_PY

Two folders share one word-level vocabulary (every space run, word and punctuation run is
one token; <s> is added in front of plain text): "plain" has a chat template without
{% generation %} markers in tokenizer_config.json, "marked" has one with them in
chat_template.jinja. Each shape is written to JSONL and the safetensors file read back.
Last, show_samples.py prints a samples.jsonl as finetune --sample_prompts writes it.
"""
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

SPECIAL = ["<s>", "</s>", "[UNK]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PIECES = re.compile(r"\s+|\w+|[^\w\s]+")  # the tokenizer's pre-tokenizer, as a regex
# Stanford Alpaca's prompts, copied here so that a change to prepare_chat.py's shows.
ALPACA = ("Below is an instruction that describes a task, paired with an input that provides "
          "further context. Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that "
                   "appropriately completes the request.\n\n### Instruction:\n{instruction}"
                   "\n\n### Response:\n")
WORDS = sorted(set(PIECES.findall(ALPACA + ALPACA_NO_INPUT + " hi hello there be brief say to me")))
VOCAB = {token: i for i, token in enumerate(SPECIAL + WORDS)}
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
                  "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MARKED_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n"
                   "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>"
                   "{% endgeneration %}{% else %}{{ m.content }}<|end|>{% endif %}{{ '\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_folder(path, template_in_config, template):
    os.makedirs(path)
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES.pattern), behavior="isolated")
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", VOCAB["<s>"])])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "[UNK]"}
    if template is not None and template_in_config:
        config["chat_template"] = template
    elif template is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(template)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def t(*tokens):
    """The ids of these tokens."""
    return [VOCAB[token] for token in tokens]


def text(s):
    """The ids of plain text, without <s>: one per piece."""
    return [VOCAB[piece] for piece in PIECES.findall(s)]


def example(prompt, completion):
    """(ids, mask): the prompt's tokens not counted, the completion's counted."""
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def turn(role, *content):
    return t(f"<|{role}|>", "\n", *content, "<|end|>", "\n")


def user(content):
    return {"role": "user", "content": content}


def assistant(content):
    return {"role": "assistant", "content": content}


SYSTEM = {"role": "system", "content": "be brief"}
PLAIN_LINES = [
    {"messages": [SYSTEM, user("hi"), assistant("hello there")]},
    None,  # an empty line, skipped
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                       {"from": "human", "value": "hi there"}, {"from": "gpt", "value": "there"}]},
    {"instruction": "say hi", "input": "to me", "output": "hi there"},
    {"instruction": "say hello", "input": "", "output": "hello"},
    {"prompt": "hi", "completion": " hello"},
    {"prompt": [user("hi")], "completion": [assistant("hello")]},
]
GENERATION_PROMPT = t("<|assistant|>", "\n")
PLAIN_EXPECTED = [
    # The last assistant turn only: the template has no generation markers.
    example(t("<s>") + turn("system", "be", " ", "brief") + turn("user", "hi") + GENERATION_PROMPT,
            t("hello", " ", "there", "<|end|>", "\n")),
    example(t("<s>") + turn("user", "hi") + turn("assistant", "hello") +
            turn("user", "hi", " ", "there") + GENERATION_PROMPT, t("there", "<|end|>", "\n")),
    example(t("<s>") + text(ALPACA.format(instruction="say hi", input="to me")),
            t("hi", " ", "there", "</s>")),
    example(t("<s>") + text(ALPACA_NO_INPUT.format(instruction="say hello")), t("hello", "</s>")),
    example(t("<s>", "hi"), t(" ", "hello", "</s>")),
    example(t("<s>") + turn("user", "hi") + GENERATION_PROMPT, t("hello", "<|end|>", "\n")),
]

MARKED_LINES = [
    {"messages": [user("hi"), assistant("hello there"), user("hi"), assistant("hello")]},
    {"conversations": [{"from": "system", "value": "be brief"}, {"from": "user", "value": "hi"},
                       {"from": "assistant", "value": "hello"}, {"from": "user", "value": "hi"}]},
    {"prompt": "hi", "completion": " hello"},
]
MARKED_EXPECTED = [
    # Every assistant turn, from {% generation %} to {% endgeneration %} (the "\n" after is
    # outside); the conversation may end with any role.
    (t("<s>", "<|user|>", "\n", "hi", "<|end|>", "\n", "<|assistant|>", "\n", "hello", " ",
       "there", "<|end|>", "\n", "<|user|>", "\n", "hi", "<|end|>", "\n", "<|assistant|>", "\n",
       "hello", "<|end|>", "\n"),
     [0] * 8 + [1] * 4 + [0] * 8 + [1] * 2 + [0]),
    (t("<s>") + turn("system", "be", " ", "brief") + turn("user", "hi") +
     t("<|assistant|>", "\n", "hello", "<|end|>", "\n") + turn("user", "hi"),
     [0] * 15 + [1] * 2 + [0] * 6),
    example(t("<s>", "hi"), t(" ", "hello", "</s>")),
]


def write_jsonl(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write("\n" if line is None else json.dumps(line) + "\n")


def check_file(path, expected, source):
    tensors = load_file(path)
    assert sorted(tensors) == ["example_offsets", "input_ids", "loss_mask"], sorted(tensors)
    ids = [i for e, _ in expected for i in e]
    mask = [m for _, e in expected for m in e]
    offsets = np.cumsum([0] + [len(e) for e, _ in expected])
    for name, dtype, want in (("input_ids", np.int32, ids), ("loss_mask", np.uint8, mask),
                              ("example_offsets", np.int64, offsets)):
        got = tensors[name]
        assert got.dtype == dtype and got.ndim == 1, (name, got.dtype, got.shape)
        assert got.tolist() == list(want), \
            f"{path}: {name}\n got  {got.tolist()}\n want {list(want)}"
    with safe_open(path, "np") as f:
        metadata = f.metadata()
    want = {"format": "fsdp-chat-v1", "vocab_size": str(len(VOCAB)),
            "examples": str(len(expected)), "counted_tokens": str(sum(mask)), "source": source}
    assert metadata == want, (metadata, want)


def load_tool(path):
    spec = importlib.util.spec_from_file_location("prepare_chat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_in_process(tool, argv):
    """(exit status, stdout, stderr) of tool.main(argv)."""
    out, err = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            tool.main(argv)
        except SystemExit as exit:
            status = exit.code
    return status, out.getvalue(), err.getvalue()


# (folder, lines, flags, the message after "FILE:2: "); line 1 is always good.
GOOD = {"prompt": "hi", "completion": " hello"}
BAD = [
    ("plain", '{"messages": [', [], "expected a JSON object, found invalid JSON "
     "(Expecting value at column 15)"),
    ("plain", [1, 2], [], "expected a JSON object, found [1, 2]"),
    ("plain", {"text": "hi"}, [], "expected an object with messages or conversations or "
     'prompt+completion or instruction+output, found the keys ["text"]'),
    ("plain", {"messages": [{"role": "bot", "content": "hi"}]}, [],
     'expected "messages"[0].role to be one of system, user, assistant, found "bot"'),
    ("plain", {"conversations": [{"from": "bot", "value": "hi"}]}, [],
     'expected "conversations"[0].from to be one of system, human, gpt, user, assistant, '
     'found "bot"'),
    ("plain", {"messages": []}, [], 'expected "messages" to be a non-empty list of messages, '
     "found []"),
    ("plain", {"messages": [user(["hi"]), assistant("hello")]}, [],
     'expected "messages"[0].content to be a string, found ["hi"]'),
    ("plain", {"messages": [user("hi"), assistant(None)]}, [],
     'expected "messages"[1].content to be a string, found null'),
    ("plain", {"messages": [user("hi")]}, [],
     "expected the last message to be the assistant's (the chat template has no "
     '{% generation %} markers, so the last turn is what counts), found "user"'),
    ("plain", {"prompt": "hi", "completion": [assistant("hello")]}, [],
     'expected "prompt" and "completion" to be both strings or both lists of messages, '
     'found "hi" and [{"role": "assistant", "content": "hello"}]'),
    ("plain", {"instruction": 3, "output": "hi"}, [],
     'expected "instruction" to be a string, found 3'),
    ("plain", {"messages": [user("hi"), assistant("hello")]}, ["--format=prompt_completion"],
     'expected an object with prompt+completion, found the keys ["messages"]'),
    ("plain", {"prompt": "hi", "completion": "hello"}, [],  # "hihello" is one token
     "expected the whole example's tokens to start with the prompt's 2 tokens, found a "
     "different token at 1"),
    ("untemplated", {"messages": [user("hi"), assistant("hello")]}, [],
     "expected --model={root}/untemplated to have a chat template (tokenizer_config.json's "
     "chat_template or chat_template.jinja), found none"),
    ("marked", {"messages": [SYSTEM, user("hi")]}, [],
     "expected at least one counted token, found none among its 13 tokens"),
]


def check_bad_lines(tool, root):
    for n, (folder, line, flags, message) in enumerate(BAD):
        data = os.path.join(root, f"bad{n}.jsonl")
        with open(data, "w") as f:
            f.write(json.dumps(GOOD) + "\n")
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
        out = os.path.join(root, f"bad{n}.safetensors")
        with open(out, "w") as f:
            f.write("an earlier file")
        argv = [f"--model={root}/{folder}", f"--out={out}", *flags, data]
        status, stdout, stderr = run_in_process(tool, argv)
        want = f"prepare_chat.py: {data}:2: {message.replace('{root}', root)}\n"
        got = (status, stdout, stderr)
        assert got == (1, "", want), f"\n got  {got}\n want {want}"
        with open(out) as f:
            assert f.read() == "an earlier file", f"{out} was written"
        assert not os.path.exists(out + ".tmp"), f"{out}.tmp was left"


def check_show_samples(show_path, root):
    """show_samples.py: each line's parts in order, decoded with the folder's tokenizer and
    its special tokens kept; a part the line lacks left out; a bad line stops it."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "plain"))
    prompt = t("<s>", "<|user|>") + text("\nsay hi") + t("<|end|>") + text("\n") + t("<|assistant|>")
    lines = [{"prompt": prompt, "reference": text("hello there") + t("<|end|>"),
              "before": text("hi hi"), "after": text("hello") + t("</s>")},
             {"prompt": t("<s>") + text("be brief"), "reference": text("me"),
              "before": text("to")}]
    samples = os.path.join(root, "samples.jsonl")
    write_jsonl(samples, lines)
    run = subprocess.run([sys.executable, show_path, f"--model={root}/plain", samples],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    want = ""
    for number, line in enumerate(lines, start=1):
        want += f"=== sample {number} of 2\n"
        for part in ("prompt", "reference", "before", "after"):
            if part in line:
                want += f"--- {part}\n{tokenizer.decode(line[part], skip_special_tokens=False)}\n"
    assert "<|assistant|>" in want and "</s>" in want, want  # special tokens kept
    assert run.stdout == want, (run.stdout, want)
    with open(samples, "a") as f:
        f.write(json.dumps({"prompt": [1, -2]}) + "\n")
    run = subprocess.run([sys.executable, show_path, f"--model={root}/plain", samples],
                         capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (1, ""), (run.returncode, run.stdout)
    assert run.stderr == (f"show_samples.py: {samples}:3: expected \"prompt\" to be a list of "
                          "token ids\n"), run.stderr


def main():
    tool_path, root, show_path = sys.argv[1:]
    make_folder(os.path.join(root, "plain"), True, PLAIN_TEMPLATE)
    make_folder(os.path.join(root, "marked"), False, MARKED_TEMPLATE)
    make_folder(os.path.join(root, "untemplated"), True, None)
    plain, marked = os.path.join(root, "plain.jsonl"), os.path.join(root, "marked.jsonl")
    write_jsonl(plain, PLAIN_LINES)
    write_jsonl(marked, MARKED_LINES)

    # The command line once each way: a good run, and a bad line (exit status 1, no file).
    out = os.path.join(root, "plain.safetensors")
    lengths = [len(ids) for ids, _ in PLAIN_EXPECTED]
    counted = sum(sum(mask) for _, mask in PLAIN_EXPECTED)
    run = subprocess.run([sys.executable, tool_path, f"--model={root}/plain", f"--out={out}",
                          "--max_length=30", plain], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout == (
        f"{out}: 6 examples, {sum(lengths)} tokens, {counted} counted, longest {max(lengths)} "
        "(messages 1, sharegpt 1, prompt_completion 2, alpaca 2), "
        f"{sum(n > 30 for n in lengths)} longer than --max_length=30\n"), run.stdout
    assert sum(n > 30 for n in lengths) == 2, lengths  # the two Alpaca examples
    check_file(out, PLAIN_EXPECTED, "plain.jsonl")
    bad = os.path.join(root, "bad.jsonl")
    with open(bad, "w") as f:
        f.write(json.dumps(GOOD) + "\n\nnot json\n")
    run = subprocess.run([sys.executable, tool_path, f"--model={root}/plain",
                          f"--out={root}/bad.safetensors", bad], capture_output=True, text=True)
    assert (run.returncode, run.stdout) == (1, ""), (run.returncode, run.stdout)
    assert run.stderr == (f"prepare_chat.py: {bad}:3: expected a JSON object, found invalid "
                          "JSON (Expecting value at column 1)\n"), run.stderr
    for name in ("bad.safetensors", "bad.safetensors.tmp"):
        assert not os.path.exists(os.path.join(root, name)), f"{name} was written"

    tool = load_tool(tool_path)
    out = os.path.join(root, "marked.safetensors")
    status, _, err = run_in_process(tool, [f"--model={root}/marked", f"--out={out}", marked])
    assert status == 0, err
    check_file(out, MARKED_EXPECTED, "marked.jsonl")

    # --mask=all: the same tokens, every one but each example's first counted.
    out = os.path.join(root, "all.safetensors")
    status, _, err = run_in_process(tool, [f"--model={root}/plain", f"--out={out}", "--mask=all",
                                           plain])
    assert status == 0, err
    check_file(out, [(ids, [0] + [1] * (len(ids) - 1)) for ids, _ in PLAIN_EXPECTED],
               "plain.jsonl")

    # --format=alpaca takes only the Alpaca lines' shape.
    alpaca = os.path.join(root, "alpaca.jsonl")
    write_jsonl(alpaca, PLAIN_LINES[3:5])
    out = os.path.join(root, "alpaca.safetensors")
    status, _, err = run_in_process(tool, [f"--model={root}/plain", f"--out={out}",
                                           "--format=alpaca", alpaca])
    assert status == 0, err
    check_file(out, PLAIN_EXPECTED[2:4], "alpaca.jsonl")

    check_bad_lines(tool, root)
    check_show_samples(show_path, root)
    print(f"PASS: {len(PLAIN_EXPECTED) + len(MARKED_EXPECTED)} examples of every shape with "
          f"exact ids and masks, --mask=all, --format, {len(BAD) + 1} bad lines; "
          "show_samples.py")


if __name__ == "__main__":
    main()
