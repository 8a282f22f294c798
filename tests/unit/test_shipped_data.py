"""The data the repo ships for env=math and env=dataset: its validation split is held out."""

import json

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.mark.parametrize("name, key", [("math", "question"), ("reverse", "prompt")])
def test_shipped_validation_prompts_are_not_training_prompts(name, key):
    train = {json.loads(line)[key] for line in (DATA / f"{name}_train.jsonl").read_text().splitlines()}
    val = [json.loads(line)[key] for line in (DATA / f"{name}_val.jsonl").read_text().splitlines()]
    assert len(set(val)) == len(val)
    assert not train.intersection(val)
