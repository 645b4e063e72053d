"""Build the embedded default model: server/models/tiny-multilingual.

    python scripts/build_default_model.py [--out DIR]

Trains a byte-level BPE tokenizer with the `tokenizers` library on the plain sentences in
server/corpus/*.txt and writes `tokenizer.json`, `tokenizer_config.json` and the `config.json`
of a tiny Llama-architecture decoder whose vocabulary matches the tokenizer. There are no
weights: the server loads the model with `load_format: dummy` (random weights), so its output
is gibberish, but compute and memory use are real, which is what tuning measures.

The output is deterministic (same corpus -> byte-identical files); a test re-runs this script
and compares with the committed files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
CORPUS_DIR = ROOT / "server" / "corpus"
DEFAULT_OUT = ROOT / "server" / "models" / "tiny-multilingual"

TARGET_VOCAB_SIZE = 6000
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = [UNK, BOS, EOS]  # ids 0, 1, 2 as in Llama

# A tiny Llama decoder: small enough to start and run on 2 CPU cores in seconds, real
# enough (GQA, RoPE, SwiGLU) to exercise the same vLLM code paths as a production model.
MODEL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
}


def corpus_files(corpus_dir: Path) -> list[Path]:
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise SystemExit(f"build_default_model: error: no *.txt files in {corpus_dir}")
    return files


def train_tokenizer(files: list[Path]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Lines in a fixed order so that training is reproducible.
    lines = [line for path in files for line in path.read_text(encoding="utf-8").splitlines()]
    tokenizer.train_from_iterator([line for line in lines if line.strip()], trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_SHAPE["max_position_embeddings"],
    }


def model_config(tokenizer: Tokenizer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODEL_SHAPE,
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": tokenizer.token_to_id(BOS),
        "eos_token_id": tokenizer.token_to_id(EOS),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "attention_bias": False,
        "mlp_bias": False,
    }


def write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)  # package data: readable like any other file in the wheel
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_json(data: dict) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False, sort_keys=True) + "\n"


def build(out_dir: Path, corpus_dir: Path = CORPUS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_files(corpus_dir))
    write_text_atomic(out_dir / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    write_text_atomic(out_dir / "tokenizer_config.json", dump_json(tokenizer_config()))
    write_text_atomic(out_dir / "config.json", dump_json(model_config(tokenizer)))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="folder of *.txt")
    args = parser.parse_args(argv)
    out = build(args.out, args.corpus)
    vocab = json.loads((out / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    print(f"wrote {out} (vocab {vocab})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
