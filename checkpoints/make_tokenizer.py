"""The shipped tiny checkpoint's tokenizer: a byte-level BPE of the tiny model's 512 ids (`<pad>` = 0
and `<eos>` = 1, as its config says, then the 256 bytes and 254 merges), trained with `tokenizers`
on this repository's docs/*.md. A toy vocabulary for a toy model: what lets the CLI's text modes and
the training command run end to end on a fresh clone. The release's own tokenizer is loaded from its
checkpoint.

    python checkpoints/make_tokenizer.py [--out checkpoints/glm5next-tiny/tokenizer.json]
"""

import argparse
import glob
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIAL = ["<pad>", "<eos>"]  # ids 0 and 1: the tiny config's pad_token_id and eos_token_id
VOCAB = 512


def make(files):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train(files, trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIAL] == [0, 1] and tokenizer.get_vocab_size() == VOCAB
    return tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "checkpoints", "glm5next-tiny", "tokenizer.json"))
    args = parser.parse_args()
    make(sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
