"""Small on-disk corpora for the data tests (generated, so no test needs the network or a big file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckv.data.tokenizer import train_bpe

EOD = "<|endoftext|>"
WORDS = (
    "the of and to in that he shall unto for his a lord they be is him not them it with all thou was "
    "king people house day land came god israel son said made children went"
).split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct documents of 20-80 random words, each starting with its own number."""
    rng = np.random.default_rng(seed)
    return [f"doc{i} " + " ".join(rng.choice(WORDS, rng.integers(20, 81))) + "." for i in range(n)]


@pytest.fixture(scope="session")
def docs() -> list[str]:
    return make_docs(120)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory, docs: list[str]) -> Path:
    """The same documents as jsonl, as txt (one paragraph each) and as a saved ``datasets`` folder."""
    import datasets

    d = tmp_path_factory.mktemp("corpus")
    (d / "docs.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(docs)))
    (d / "docs.txt").write_text("\n\n".join(docs) + "\n")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(d / "saved"))
    return d


@pytest.fixture(scope="session")
def tokenizer(cache_dir: str) -> str:
    """A BPE of 400 tokens with the end-of-document token ``EOD``, trained on ``make_docs(200)`` in the session's
    cache (tests/conftest.py): what the shard tests prepare and read their shards with."""
    return train_bpe(make_docs(200), vocab_size=400, special_tokens=[EOD], cache_dir=cache_dir)
