"""Prints the answers examples/llama/finetune wrote to OUT/samples.jsonl (--sample_prompts)
as text, decoded with the model folder's tokenizer (transformers' AutoTokenizer).

    python3 show_samples.py --model=MODEL_DIR OUT/samples.jsonl

For each line, in order: the prompt, the example's own answer ("reference"), and the
model's greedy answers before and after training where the file has them, each decoded
with its special tokens kept (so turn markers and the end-of-sequence token show):

    === sample 1 of 2
    --- prompt
    ...
    --- reference
    ...
    --- before
    ...
    --- after
    ...

A bad line stops it with "FILE:LINE: ..." and exit status 1.
"""
import os
import sys

# As prepare_chat.py: this folder's tokenize.py must not stand in for the standard
# library's tokenize module, which transformers imports.
_HERE = os.path.dirname(os.path.realpath(__file__))
if sys.path and os.path.realpath(sys.path[0] or ".") == _HERE:
    del sys.path[0]

import argparse  # noqa: E402 (after the path is fixed)
import json  # noqa: E402

PARTS = ("prompt", "reference", "before", "after")


def stop(message):
    print(f"show_samples.py: {message}", file=sys.stderr)
    sys.exit(1)


def read_samples(path):
    """Every line of `path` as a dict of PARTS to token id lists."""
    samples = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                stop(f"{where}: expected a JSON object, found invalid JSON ({error})")
            if not isinstance(record, dict) or "prompt" not in record:
                stop(f"{where}: expected an object with \"prompt\" (finetune's samples.jsonl)")
            for part in PARTS:
                ids = record.get(part, [])
                if not (isinstance(ids, list) and
                        all(isinstance(i, int) and i >= 0 for i in ids)):
                    stop(f"{where}: expected \"{part}\" to be a list of token ids")
            samples.append({part: record[part] for part in PARTS if part in record})
    return samples


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model folder (its tokenizer)")
    parser.add_argument("samples", help="finetune's OUT/samples.jsonl")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.samples):
        stop(f"{args.samples}: expected finetune's samples.jsonl, found no such file")
    samples = read_samples(args.samples)

    from transformers import AutoTokenizer  # slow to import: after the file is read

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except Exception as error:
        stop(f"--model={args.model}: expected a folder with a tokenizer, found: {error}")
    for number, sample in enumerate(samples, start=1):
        print(f"=== sample {number} of {len(samples)}")
        for part in PARTS:
            if part in sample:
                print(f"--- {part}")
                print(tokenizer.decode(sample[part], skip_special_tokens=False))


if __name__ == "__main__":
    main()
