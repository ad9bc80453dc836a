"""Turns a JSONL file of conversations or prompt/completion pairs into a token file with a
loss mask, for supervised fine-tuning, with a model folder's own tokenizer and chat template
(transformers' AutoTokenizer and apply_chat_template).

    python3 prepare_chat.py --model=MODEL_DIR --out=FILE.safetensors [--format=auto]
        [--mask=assistant|all] [--max_length=N] DATA.jsonl

Each non-empty line of DATA.jsonl is one example, in one of these shapes (--format=auto
tells them apart per line, trying them in this order):
  messages           {"messages": [{"role": "system"|"user"|"assistant", "content": STR}, ...]}
  sharegpt           {"conversations": [{"from": "system"|"human"|"gpt", "value": STR}, ...]}
                     ("user" and "assistant" are accepted in "from" too)
  prompt_completion  {"prompt": STR, "completion": STR}, or both lists of messages (TRL's
                     conversational prompt/completion)
  alpaca             {"instruction": STR, "input": STR (optional), "output": STR}
Which tokens count (--mask=assistant, the default):
  conversations, template with {% generation %} markers: the assistant tokens (transformers'
      return_assistant_tokens_mask, TRL's assistant_only_loss);
  conversations, template without them: the last turn, which must be the assistant's
      (prompt = the messages before it with the generation prompt, as TRL's
      prompt/completion);
  prompt/completion and Alpaca: the completion (TRL's completion_only_loss). A plain-text
      completion gets the tokenizer's eos token appended and the prompt is encoded with the
      tokenizer's special tokens (TRL's way); Alpaca's prompt is Stanford Alpaca's template.
--mask=all counts every token (the same tokens and examples, for comparison).

The output is one safetensors file (format "fsdp-chat-v1"):
  input_ids        int32 [N]    every example's ids, concatenated in file order;
  loss_mask        uint8 [N]    1 where token i is a target (predicted from token i - 1 of
                                the same example), so an example's first token has 0;
  example_offsets  int64 [E+1]  example e is input_ids[offsets[e]:offsets[e + 1]];
and the metadata format, vocab_size (len(tokenizer), added tokens included), examples,
counted_tokens and source (the input file's name). Examples are never cut: --max_length
only reports how many are longer. A bad line stops it with "FILE:LINE: ..." and exit
status 1, and nothing is written.
"""
import os
import sys

# Run as a script, this folder comes first on the path, and its tokenize.py would stand in
# for the standard library's tokenize module, which transformers imports: drop the folder.
_HERE = os.path.dirname(os.path.realpath(__file__))  # Python puts the resolved folder there
if sys.path and os.path.realpath(sys.path[0] or ".") == _HERE:
    del sys.path[0]

import argparse  # noqa: E402 (after the path is fixed)
import json  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

SHAPES = ("messages", "sharegpt", "prompt_completion", "alpaca")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user",
                  "assistant": "assistant"}
# The test transformers' apply_chat_template makes before it fills assistant masks.
GENERATION_MARKER = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class BadLine(Exception):
    """A line that is not what this tool reads; the message says what was expected and
    what was found."""


def found(value):
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def detect(record, fmt):
    """The record's shape: the one --format names, else the first that fits."""
    keys = {
        "messages": ("messages",),
        "sharegpt": ("conversations",),
        "prompt_completion": ("prompt", "completion"),
        "alpaca": ("instruction", "output"),
    }
    shapes = SHAPES if fmt == "auto" else (fmt,)
    for shape in shapes:
        if all(key in record for key in keys[shape]):
            return shape
    wanted = " or ".join("+".join(keys[shape]) for shape in shapes)
    raise BadLine(f"expected an object with {wanted}, found the keys {found(sorted(record))}")


def messages_of(value, field, role_key="role", content_key="content", roles=None):
    """value as a list of {"role", "content"} messages, checked."""
    if not isinstance(value, list) or not value:
        raise BadLine(f'expected "{field}" to be a non-empty list of messages, found '
                      f"{found(value)}")
    roles = roles or {role: role for role in ROLES}
    messages = []
    for i, message in enumerate(value):
        where = f'"{field}"[{i}]'
        if not isinstance(message, dict):
            raise BadLine(f"expected {where} to be an object, found {found(message)}")
        role = message.get(role_key)
        if role not in roles:
            raise BadLine(f'expected {where}.{role_key} to be one of {", ".join(roles)}, '
                          f"found {found(role)}")
        content = message.get(content_key)
        if not isinstance(content, str):
            raise BadLine(f"expected {where}.{content_key} to be a string, found "
                          f"{found(content)}")
        if role_key == "role":
            messages.append(dict(message))  # other keys (e.g. a name) reach the template
        else:
            messages.append({"role": roles[role], "content": content})
    return messages


def string_field(record, field, required=True):
    value = record.get(field, None if required else "")
    if not isinstance(value, str):
        raise BadLine(f'expected "{field}" to be a string, found {found(value)}')
    return value


class Renderer:
    """Tokenizes one record into (ids, counted), counted[i] = 1 for a counted token."""

    def __init__(self, tokenizer, model_dir):
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        try:  # the folder's template, or its "default" one when it names several
            self.template = tokenizer.get_chat_template()
        except ValueError:
            self.template = None
        self.has_generation = bool(self.template and GENERATION_MARKER.search(self.template))

    def __call__(self, record, shape):
        if shape == "messages":
            return self.conversation(messages_of(record["messages"], "messages"))
        if shape == "sharegpt":
            return self.conversation(
                messages_of(record["conversations"], "conversations", "from", "value",
                            SHAREGPT_ROLES))
        if shape == "alpaca":
            instruction = string_field(record, "instruction")
            extra = string_field(record, "input", required=False)
            output = string_field(record, "output")
            template = ALPACA_PROMPT if extra else ALPACA_PROMPT_NO_INPUT
            return self.text_pair(template.format(instruction=instruction, input=extra), output)
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return self.text_pair(prompt, completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            return self.chat_pair(messages_of(prompt, "prompt"),
                                  messages_of(completion, "completion"))
        raise BadLine('expected "prompt" and "completion" to be both strings or both lists '
                      f"of messages, found {found(prompt)} and {found(completion)}")

    def text_pair(self, prompt, completion):
        """TRL's plain prompt/completion: the prompt encoded with the tokenizer's special
        tokens, then prompt + completion + eos; the ids past the prompt's count."""
        eos = self.tokenizer.eos_token
        if not eos:
            raise BadLine(f"expected --model={self.model_dir}'s tokenizer to have an "
                          "eos_token (the completion ends with it), found none")
        if not completion.endswith(eos):  # as TRL: unless it already ends with it
            completion += eos
        prompt_ids = self.tokenizer(prompt)["input_ids"]
        ids = self.tokenizer(prompt + completion)["input_ids"]
        return self.split(prompt_ids, ids, "the prompt")

    def conversation(self, messages):
        if self.has_generation:
            out = self.render(messages, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), list(out["assistant_masks"])
        last = messages[-1]["role"]
        if last != "assistant":
            raise BadLine("expected the last message to be the assistant's (the chat template "
                          "has no {% generation %} markers, so the last turn is what counts), "
                          f"found {found(last)}")
        return self.chat_pair(messages[:-1], messages[-1:])

    def chat_pair(self, prompt, completion):
        prompt_ids = self.render(prompt, add_generation_prompt=True)["input_ids"] if prompt else []
        ids = self.render(prompt + completion)["input_ids"]
        return self.split(prompt_ids, ids, "the prompt rendered with the generation prompt")

    def render(self, messages, **kwargs):
        if self.template is None:
            raise BadLine(f"expected --model={self.model_dir} to have a chat template "
                          "(tokenizer_config.json's chat_template or chat_template.jinja), "
                          "found none")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                      **kwargs)
        except Exception as error:  # the template's own raise_exception and Jinja errors
            raise BadLine(f"expected the chat template to render it, found the error: {error}")

    @staticmethod
    def split(prompt_ids, ids, what):
        prompt_ids, ids = list(prompt_ids), list(ids)
        if ids[:len(prompt_ids)] != prompt_ids:
            first = next(i for i, id in enumerate(prompt_ids) if i >= len(ids) or ids[i] != id)
            raise BadLine(f"expected the whole example's tokens to start with {what}'s "
                          f"{len(prompt_ids)} tokens, found a different token at {first}")
        return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


def read_examples(path, fmt, mask, renderer):
    """Every example of the JSONL file: (ids, loss_mask, shape). Raises SystemExit on the
    first bad line."""
    examples = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig").strip()  # a BOM and the newline dropped
                if not line:
                    continue
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise BadLine(f"expected a JSON object, found {found(record)}")
                shape = detect(record, fmt)
                ids, counted = renderer(record, shape)
                if mask == "all":
                    counted = [1] * len(ids)
                counted = [0] + list(counted[1:])  # the first token predicts, never a target
                if not any(counted):
                    raise BadLine(f"expected at least one counted token, found none among "
                                  f"its {len(ids)} tokens")
            except UnicodeDecodeError as error:
                stop(f"{path}:{number}: expected UTF-8, found {error.reason}")
            except json.JSONDecodeError as error:
                stop(f"{path}:{number}: expected a JSON object, found invalid JSON "
                     f"({error.msg} at column {error.colno})")
            except BadLine as error:
                stop(f"{path}:{number}: {error}")
            examples.append((ids, counted, shape))
    return examples


def stop(message):
    print(f"prepare_chat.py: {message}", file=sys.stderr)
    sys.exit(1)


def write_atomically(path, data):
    """FILE.tmp, flushed and synced, renamed over path, then the folder synced."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="Hugging Face model folder (tokenizer and chat template)")
    parser.add_argument("--out", required=True, help="the .safetensors file to write")
    parser.add_argument("--format", default="auto", choices=("auto",) + SHAPES,
                        help="every line's shape (auto: told apart per line)")
    parser.add_argument("--mask", default="assistant", choices=("assistant", "all"),
                        help="the tokens that count: the assistant's or completion, or all")
    parser.add_argument("--max_length", type=int, default=None,
                        help="report how many examples are longer (none is cut)")
    parser.add_argument("data", help="JSONL file, one example per line")
    args = parser.parse_args(argv)
    if args.max_length is not None and args.max_length <= 0:
        stop(f"--max_length: expected a positive number of tokens, found {args.max_length}")
    if not os.path.isfile(args.data):
        stop(f"{args.data}: expected a JSONL file, found no such file")

    from transformers import AutoTokenizer  # slow to import: after the flags are checked
    from safetensors.numpy import save

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception as error:
        stop(f"--model={args.model}: expected a folder with a tokenizer, found: {error}")
    examples = read_examples(args.data, args.format, args.mask, Renderer(tokenizer, args.model))
    if not examples:
        stop(f"{args.data}: expected at least one example, found none")

    lengths = np.array([len(ids) for ids, _, _ in examples], dtype=np.int64)
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    input_ids = np.array([i for ids, _, _ in examples for i in ids], dtype=np.int32)
    loss_mask = np.array([m for _, counted, _ in examples for m in counted], dtype=np.uint8)
    counted_tokens = int(loss_mask.sum(dtype=np.int64))
    metadata = {
        "format": "fsdp-chat-v1",
        "vocab_size": str(len(tokenizer)),
        "examples": str(len(examples)),
        "counted_tokens": str(counted_tokens),
        "source": os.path.basename(args.data),
    }
    tensors = {"input_ids": input_ids, "loss_mask": loss_mask, "example_offsets": offsets}
    try:
        write_atomically(args.out, save(tensors, metadata=metadata))
    except OSError as error:
        stop(f"--out={args.out}: cannot write it ({error})")

    shapes = ", ".join(f"{shape} {sum(s == shape for _, _, s in examples)}" for shape in SHAPES)
    longer = ""
    if args.max_length is not None:
        longer = (f", {int((lengths > args.max_length).sum())} longer than "
                  f"--max_length={args.max_length}")
    print(f"{args.out}: {len(examples)} examples, {len(input_ids)} tokens, {counted_tokens} "
          f"counted, longest {int(lengths.max())} ({shapes}){longer}")


if __name__ == "__main__":
    main()
