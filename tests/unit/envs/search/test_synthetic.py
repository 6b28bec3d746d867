"""The synthetic world: reproducible, split by person, answers absent from questions."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.envs.search.data import load_qa
from agentrl.envs.search.env import SearchR1Env
from agentrl.envs.search.synthetic import build_world, make_synthetic, synthetic_tasks


def test_world_is_a_function_of_seed_and_size() -> None:
    a, b = build_world(5, 40), build_world.__wrapped__(5, 40)
    assert a == b
    assert build_world(6, 40)["corpus"] != a["corpus"]


def test_answers_need_search() -> None:
    world = build_world(0, 100)
    for q in world["qa"]:
        assert q["golden_answers"][0].lower() not in q["question"].lower()
    # every answer is stated in some document of the corpus
    text = "\n".join(d["contents"] for d in world["corpus"])
    assert all(q["golden_answers"][0] in text for q in world["qa"])
    assert {q["data_source"] for q in world["qa"]} == {"synthetic", "synthetic_2hop"}


def test_split_is_by_person() -> None:
    world = build_world(0, 100)
    people = {
        split: {q["id"].split("-")[2] for q in world["qa"] if q["split"] == split}
        for split in ("train", "test")
    }
    assert people["train"] and people["test"] and not people["train"] & people["test"]


def test_files_and_generator_agree(tmp_path: Path) -> None:
    paths = make_synthetic(tmp_path, seed=0, num_people=50)
    train = load_qa(paths["train"])
    assert load_qa(paths["train_parquet"]) == train
    generated = SearchR1Env.generate_tasks(2 * len(train), seed=1, split="train", num_people=50)
    assert {t["id"] for t in generated} == {t["id"] for t in train}  # cycles through the pool
    assert synthetic_tasks(10, seed=1, num_people=50) == synthetic_tasks(10, seed=1, num_people=50)
    assert all(t["split"] == "test" for t in synthetic_tasks(20, split="test", num_people=50))


def test_world_size_is_bounded() -> None:
    with pytest.raises(ValueError, match="num_people"):
        build_world(0, 0)
    with pytest.raises(ValueError, match="num_people"):
        build_world(0, 10**6)
    world = build_world(1, 3000)  # larger worlds still get distinct, single-token names
    names = [*world["people"], *world["orgs"], *world["towns"]]
    assert len({n.lower() for n in names}) == len(names)
