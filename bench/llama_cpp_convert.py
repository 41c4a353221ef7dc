"""llama.cpp's convert_hf_to_gguf script, run unchanged, with two fallbacks for noria's demo tokenizer.

Run by the converter's own venv (bench/llama_cpp_build.py), never imported by noria:

    python llama_cpp_convert.py SRC MODEL_DIR [--pre NAME] -- CONVERTER_OPTIONS...

The benchmark models carry noria's small demo tokenizer (a tokenizer.json of 706 byte-level BPE
tokens, GPT-2's pre-tokenizer), saved by transformers 5. Two things in it stop the converter,
which pins transformers 4.57:

* tokenizer_config.json names the class `TokenizersBackend`, transformers 5's name for a
  tokenizer read from tokenizer.json, which transformers 4 calls `PreTrainedTokenizerFast`.
  Where the converter's transformers lacks the class, the converter is given a view of MODEL_DIR
  (links to every file; that one file with the class renamed), in a temporary folder of the
  same name (the GGUF's model name comes from it).
* The converter names a byte-level BPE pre-tokenizer by hashing how it tokenizes a test string,
  against a table of published models; any other stops the conversion with "BPE pre-tokenizer
  was not recognized". With `--pre NAME`, an unrecognised hash gets NAME instead of the error;
  the caller passes "gpt-2" only after checking that tokenizer.json's pre-tokenizer is exactly
  GPT-2's (bench/llama_cpp_build.py: pre_tokenizer). A recognised hash keeps its own name.

The weights, the vocabulary and the rest of the conversion are the converter's own. The
benchmarks send token ids, so the pre-tokenizer never runs there.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
from pathlib import Path

RENAMED = {"TokenizersBackend": "PreTrainedTokenizerFast"}  # transformers 5 -> 4


def _staged(model: Path, tmp: Path) -> Path:
    """`model`, or a view of it whose tokenizer_config.json names a class this transformers has."""
    import transformers

    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    cls = config.get("tokenizer_class")
    if cls not in RENAMED or hasattr(transformers, cls):
        return model
    view = tmp / model.name
    view.mkdir()
    for f in model.iterdir():
        if f.name != config_path.name:
            (view / f.name).symlink_to(f.resolve())
    (view / config_path.name).write_text(json.dumps({**config, "tokenizer_class": RENAMED[cls]}, indent=2))
    print(f"tokenizer_class {cls!r} is {RENAMED[cls]!r} in transformers {transformers.__version__}: "
          f"converting through {view}", file=sys.stderr)
    return view


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path, help="the llama.cpp source tree")
    ap.add_argument("model", type=Path, help="the Hugging Face checkpoint folder")
    ap.add_argument("--pre", default=None, help="the pre-tokenizer name for an unrecognised BPE hash")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = ap.parse_args(argv[:split]), argv[split + 1:]
    # As the converter does for itself: the source tree's gguf-py, not one from an index.
    sys.path[:0] = [str(args.src), str(args.src / "gguf-py")]
    if args.pre:
        from conversion.base import TextModel

        upstream = TextModel.get_vocab_base_pre

        def get_vocab_base_pre(self, tokenizer) -> str:
            try:
                return upstream(self, tokenizer)
            except NotImplementedError:
                print(f"pre-tokenizer not in the converter's table: {args.pre!r}, as the caller checked",
                      file=sys.stderr)
                return args.pre

        TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = args.src / "convert_hf_to_gguf.py"
    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = [str(script), *rest, str(_staged(args.model, Path(tmp)))]
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
