"""The golden file of every attention option's composed config (tests/train/golden/attention_options.json).

``test_entry.py`` checks that each option (each conf/attention/*.yaml and each group option on the group bases,
``tests.helpers.VARIANTS``) still composes to the values recorded here, so a change to a YAML, a group or a
default shows up as a diff. After an intended change, regenerate and review the diff:

    .venv/bin/python -m tests.train.golden_attention
"""

from __future__ import annotations

import json
from pathlib import Path

from ckv.config import AttentionConfig
from tests.helpers import VARIANTS, variant

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "attention_options.json"


def composed_options() -> dict[str, dict]:
    """Every attention option's composed and validated config, as ``AttentionConfig.to_dict``."""
    return {name: AttentionConfig.from_dict(variant(name)).to_dict() for name in VARIANTS}


def main() -> None:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(composed_options(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN.relative_to(REPO)}")


if __name__ == "__main__":
    main()
