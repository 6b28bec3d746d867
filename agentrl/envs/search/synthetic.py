"""An offline Search-R1 world: invented people, organisations and towns, a corpus about them,
and questions whose answers can only be found by searching that corpus.

    agentrl retriever --make-synthetic runs/search_r1/data   # corpus.jsonl, train.jsonl, test.jsonl

Every name is made of random syllables ("Dravolek Quinmarth", "Sul Ketrabo"), every fact
is drawn at random, so no model knows an answer from pre-training: reward measures search
use. Questions are single-hop (where/when was X born, what did X found, who founded Y, where
is Y based) and two-hop like HotpotQA (where was the founder of Y born). The split is by
person: test questions are about people no train question mentions. The world is a pure
function of (seed, num_people), so `SearchR1Env.generate_tasks` draws the same questions
that `make_synthetic` wrote, as long as both use the same seed and size.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

from agentrl.envs.search.data import write_tasks

_SYLLABLES = (
    "dra vo lek quin marth sul ke tra bo zan mir thu gor fen xal rum pol sik nar vyn "
    "bel ok jas tev orn plix ud cra hem wul yat ib esk lo fri gan zo puth an"
).split()
_PROFESSIONS = "cartographer glassblower astronomer luthier botanist archivist engraver surveyor".split()
MAX_PEOPLE = 10_000  # names are drawn from ~65k syllable words; all names in a world are distinct
_ORG_KINDS = ("guild", "observatory", "trading house", "press", "conservatory", "foundry")


def _word(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(low, high))).capitalize()


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _unique(rng: random.Random, count: int, make: Any, taken: set[str]) -> list[str]:
    names: list[str] = []
    for _ in range(100 * count + 1000):
        if len(names) == count:
            return names
        name = make()
        if name.lower() not in taken:
            taken.add(name.lower())
            names.append(name)
    if len(names) == count:
        return names
    raise ValueError(f"cannot invent {count} more distinct names; use a smaller synthetic world")


@functools.lru_cache(maxsize=4)
def build_world(seed: int = 0, num_people: int = 200) -> dict[str, Any]:
    """People, organisations, towns, the corpus and the QA pairs of one synthetic world."""
    if not 1 <= num_people <= MAX_PEOPLE:
        raise ValueError(f"num_people must be from 1 to {MAX_PEOPLE}, got {num_people}")
    rng = random.Random(seed)
    taken: set[str] = set()
    towns = _unique(rng, max(8, num_people // 4), lambda: _word(rng, 2, 3), taken)
    regions = _unique(rng, 6, lambda: _word(rng, 2, 2), taken)
    firsts = _unique(rng, num_people, lambda: _word(rng, 1, 3), taken)
    people = [
        f"{first} {last}"
        for first, last in zip(firsts, _unique(rng, num_people, lambda: _word(rng, 2, 3), taken), strict=True)
    ]
    orgs = [
        f"{name} {kind.title()}"
        for name, kind in zip(
            _unique(rng, num_people, lambda: _word(rng, 2, 3), taken),
            [rng.choice(_ORG_KINDS) for _ in range(num_people)],
            strict=True,
        )
    ]
    corpus: list[dict[str, str]] = []
    for town in towns:
        text = f"{town} is a small town in the region of {rng.choice(regions)}, known for its {rng.choice(('markets', 'bridges', 'orchards', 'quarries'))}."
        corpus.append({"id": str(len(corpus)), "contents": f'"{town}"\n{text}'})
    qa: list[dict[str, Any]] = []
    for i, (person, org) in enumerate(zip(people, orgs, strict=True)):
        born, based = rng.choice(towns), rng.choice(towns)
        year = rng.randint(1650, 1950)
        founded = year + rng.randint(20, 50)
        job = rng.choice(_PROFESSIONS)
        corpus.append(
            {
                "id": str(len(corpus)),
                "contents": f'"{person}"\n{person} was {_a(job)} born in {born} in {year}. '
                f"In {founded}, {person} founded the {org}.",
            }
        )
        corpus.append(
            {
                "id": str(len(corpus)),
                "contents": f'"{org}"\nThe {org} is {_a(org.split()[-1].lower())} based in {based}. '
                f"It was founded in {founded} by the {job} {person}.",
            }
        )
        split = "test" if i % 10 == 0 else "train"
        for kind, question, answer in (
            ("birthplace", f"In which town was {person} born?", born),
            ("birth_year", f"In what year was {person} born?", str(year)),
            ("founded", f"What did {person} found?", org),
            ("founder", f"Who founded the {org}?", person),
            ("based", f"In which town is the {org} based?", based),
            ("founder_birthplace", f"In which town was the founder of the {org} born?", born),
        ):
            qa.append(
                {
                    "id": f"synth-{seed}-{i}-{kind}",
                    "question": question,
                    "golden_answers": [answer],
                    "data_source": "synthetic_2hop" if kind == "founder_birthplace" else "synthetic",
                    "split": split,
                }
            )
    return {"corpus": corpus, "qa": qa, "people": people, "orgs": orgs, "towns": towns}


def synthetic_tasks(
    num: int, seed: int = 0, split: str = "train", world_seed: int = 0, num_people: int = 200
) -> list[dict[str, Any]]:
    """`num` questions of one split, in a shuffled order fixed by `seed` (cycling if num is larger)."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be train, test or all, got {split!r}")
    pool = [q for q in build_world(world_seed, num_people)["qa"] if split in ("all", q["split"])]
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < num:
        order = list(range(len(pool)))
        rng.shuffle(order)
        out += [dict(pool[i]) for i in order[: num - len(out)]]
    return out


def make_synthetic(out_dir: str | Path, seed: int = 0, num_people: int = 200) -> dict[str, Path]:
    """Write corpus.jsonl, train.jsonl and test.jsonl (and train/test .parquet when pyarrow is installed)."""
    out = Path(out_dir)
    world = build_world(seed, num_people)
    paths = {"corpus": write_tasks(world["corpus"], out / "corpus.jsonl")}
    for split in ("train", "test"):
        rows = [q for q in world["qa"] if q["split"] == split]
        paths[split] = write_tasks(rows, out / f"{split}.jsonl")
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            continue
        paths[f"{split}_parquet"] = write_tasks(rows, out / f"{split}.parquet")
    return paths
