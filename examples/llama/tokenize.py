"""Turns text into a token file for examples/llama:finetune, with a model folder's own
tokenizer (Hugging Face's `tokenizers` library, reading MODEL_DIR/tokenizer.json).

    python3 tokenize.py --model=MODEL_DIR --out=TOKENS [--dtype=auto|uint16|uint32] TEXT...

Each TEXT file is encoded on its own (with the tokenizer's special tokens, e.g. a leading
<s>, as the tokenizer's post-processor adds them) and the ids are appended in order. The
file is a flat little-endian array of token ids (the nanoGPT / llm.c convention): uint16
when the vocabulary fits (at most 65536 ids), else uint32 (--dtype=auto), the same rule
as finetune's --data_dtype=auto. Prints the number of tokens and the dtype.
"""
import argparse
import os
import sys

import numpy as np
from tokenizers import Tokenizer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="folder holding tokenizer.json")
    parser.add_argument("--out", required=True, help="token file to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"])
    parser.add_argument("text", nargs="+", help="UTF-8 text files")
    args = parser.parse_args(argv)

    path = os.path.join(args.model, "tokenizer.json")
    if not os.path.isfile(path):
        sys.exit(f"tokenize.py: --model={args.model}: no tokenizer.json there (a Hugging Face "
                 "model folder with a fast tokenizer has one)")
    tokenizer = Tokenizer.from_file(path)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = args.dtype if args.dtype != "auto" else ("uint16" if vocab <= 65536 else "uint32")
    if dtype == "uint16" and vocab > 65536:
        sys.exit(f"tokenize.py: --dtype=uint16: the vocabulary of {vocab} ids does not fit")
    ids = []
    for name in args.text:
        try:
            with open(name, encoding="utf-8") as f:
                ids.extend(tokenizer.encode(f.read()).ids)
        except (OSError, UnicodeDecodeError) as error:
            sys.exit(f"tokenize.py: {name}: expected a readable UTF-8 text file ({error})")
    array = np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<"))
    tmp = args.out + ".tmp"
    try:
        array.tofile(tmp)
        os.replace(tmp, args.out)
    except OSError as error:
        sys.exit(f"tokenize.py: --out={args.out}: cannot write it ({error})")
    # A width other than the one finetune's --data_dtype=auto picks must be named to it.
    flag = "" if dtype == ("uint16" if vocab <= 65536 else "uint32") else (
        f"; finetune reads it with --data_dtype={dtype}")
    print(f"{args.out}: {len(ids)} tokens, {dtype} (vocabulary {vocab}){flag}")


if __name__ == "__main__":
    main()
