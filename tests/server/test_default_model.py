"""The embedded model's tokenizer is reproducible from the committed corpus and script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "server" / "models" / "tiny-multilingual"


def test_build_script_reproduces_the_committed_files(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_default_model.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / name).read_bytes() == (MODEL / name).read_bytes(), name


def test_tokenizer_round_trips_text_in_several_scripts() -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    assert 4000 <= tokenizer.get_vocab_size() <= 8000
    for text in ["The train was late.", "Der Zug nach Hamburg", "Поезд опоздал.", "开往海边的火车"]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
