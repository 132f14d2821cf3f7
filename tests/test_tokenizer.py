"""Tokenizer loading: a directory whose tokenizer is a generic `tokenizer.json` class is loaded
through that class, the same tokenizer AutoTokenizer builds, without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from jaxllm.models import materialize_preset
from jaxllm.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello world! What is the capital of France?", "  spaces\tand\nnewlines  ", "ünïcödé 日本語 🙂", ""]


def test_generic_tokenizer_is_the_one_autotokenizer_builds():
    from transformers import AutoTokenizer

    path = materialize_preset("tiny-moe")
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert type(ours) is type(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id, len(ours)) == (
        theirs.eos_token_id,
        theirs.bos_token_id,
        theirs.pad_token_id,
        len(theirs),
    )
    assert sorted(ours.all_special_ids) == sorted(theirs.all_special_ids)
    assert ours.get_vocab() == theirs.get_vocab()


def test_loading_the_tokenizer_does_not_import_torch():
    code = (
        "import sys; from jaxllm.models import materialize_preset; from jaxllm.tokenizer import load_tokenizer; "
        "load_tokenizer(materialize_preset('tiny-moe')); print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
