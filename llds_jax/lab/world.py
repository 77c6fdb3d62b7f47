"""A synthetic search world: fictional people, cities, countries and companies, and questions about them.

Why fictional: a tiny policy pre-trained from scratch knows nothing, so every answer must come
from retrieval, and no real-world fact can leak in. The world is a pure function of its settings
(``lab.world``), so the same settings give byte-identical files on every machine.

Passages are rows of the wiki-18 corpus format (``{"id", "contents": "\\"Title\\"\\ntext"}``,
SPEC §6), read by ``llds_jax.retrieval`` like the real corpus. Questions are FlashRAG JSONL rows
(``id``, ``question``, ``golden_answers``, ``metadata``; SPEC §7) read by ``llds_jax.data``:

* one hop (written as ``nq``): the answer is in the passage of the entity the question names,
  e.g. "Where was Davo Kelmin born?" → the person's passage says "born in Tarvel";
* two hops (written as ``hotpotqa``): the first passage names a bridge entity whose own passage
  holds the answer, e.g. "In which country was Davo Kelmin born?" → Tarvel → "Tarvel is a city in
  Omeria". ``metadata.bridge`` records the bridge so trajectories can search it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from llds_jax.errors import InputError

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "br", "dr", "kr", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "m", "k", "th")
OCCUPATIONS = ("potter", "astronomer", "sailor", "baker", "painter", "miner", "weaver", "doctor", "teacher",
               "carpenter", "singer", "farmer", "engineer", "poet", "merchant", "judge")
INDUSTRIES = ("shipping", "textiles", "mining", "software", "farming", "banking", "glassware", "printing")

DEFAULT_WORLD = dict(
    seed=0,
    countries=8,
    cities=40,
    companies=40,
    people=400,
    train_questions=4000,
    dev_questions=200,
    two_hop_fraction=0.5,  # share of questions that need two retrieval hops
)

# (relation, question template, how to find the answer) — see _one_hop / _two_hop.
ONE_HOP_KINDS = ("person_city", "person_occupation", "person_company", "city_country", "company_city",
                 "country_capital")
TWO_HOP_KINDS = ("person_country", "person_company_city", "company_country")


class WorldConfigError(InputError):
    """A ``lab.world`` value no world can be built from; the message names the field and value."""


@dataclasses.dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: str
    hops: int
    bridge: str  # the entity the second search must name ("" for one hop)
    kind: str
    entity: str = ""  # the entity the question names (what the first search should ask for)

    @property
    def data_source(self) -> str:
        return "nq" if self.hops == 1 else "hotpotqa"

    def row(self) -> dict:
        return dict(id=self.id, question=self.question, golden_answers=[self.answer], data_source=self.data_source,
                    metadata=dict(hops=self.hops, bridge=self.bridge, kind=self.kind, entity=self.entity))


@dataclasses.dataclass(frozen=True)
class World:
    passages: tuple[tuple[str, str], ...]  # (title, text)
    train: tuple[Question, ...]
    dev: tuple[Question, ...]

    def corpus_rows(self) -> list[dict]:
        return [dict(id=str(i), contents=f'"{title}"\n{text}') for i, (title, text) in enumerate(self.passages)]


def check_world_settings(settings: Mapping) -> dict:
    """``lab.world`` merged over the defaults, every field checked; fails naming field and value."""
    unknown = set(settings) - set(DEFAULT_WORLD)
    if unknown:
        raise WorldConfigError(f"lab.world has unknown fields {sorted(unknown)}; known: {sorted(DEFAULT_WORLD)}")
    merged = {**DEFAULT_WORLD, **dict(settings)}
    for field in ("countries", "cities", "companies", "people", "train_questions", "dev_questions"):
        value = merged[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WorldConfigError(f"lab.world.{field}={value!r} must be a positive integer")
    if merged["cities"] < merged["countries"]:
        raise WorldConfigError(f"lab.world.cities={merged['cities']} must be ≥ lab.world.countries="
                               f"{merged['countries']} (every country has a capital city)")
    fraction = merged["two_hop_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 <= fraction <= 1.0:
        raise WorldConfigError(f"lab.world.two_hop_fraction={fraction!r} must be a number in [0, 1]")
    return merged


def with_article(noun: str) -> str:
    """``a potter`` / ``an astronomer``: the indefinite article that agrees with the noun's first letter."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


class _Names:
    """Unique pronounceable fictional names; a name is never reused for two entities."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.used = rng, set()

    def word(self, syllables: int) -> str:
        parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables)]
        return ("".join(parts) + self.rng.choice(_CODAS)).capitalize()

    def unique(self, make) -> str:
        for _ in range(10_000):
            name = make()
            if name not in self.used:
                self.used.add(name)
                return name
        raise WorldConfigError("ran out of distinct fictional names: lower the lab.world entity counts")


def generate_world(settings: Mapping) -> World:
    """The world for ``settings`` (``lab.world``); deterministic in ``settings['seed']``."""
    s = check_world_settings(settings)
    rng = np.random.default_rng(s["seed"])
    names = _Names(rng)
    countries = [names.unique(lambda: names.word(2) + "ia") for _ in range(s["countries"])]
    cities = [names.unique(lambda: names.word(2)) for _ in range(s["cities"])]
    city_country = {c: countries[i % len(countries)] if i < len(countries) else str(rng.choice(countries))
                    for i, c in enumerate(cities)}
    capital = {country: cities[i] for i, country in enumerate(countries)}
    companies = [names.unique(lambda: f"{names.word(2)} {rng.choice(('Works', 'Trading', 'Guild', 'Company'))}")
                 for _ in range(s["companies"])]
    company_city = {c: str(rng.choice(cities)) for c in companies}
    company_industry = {c: str(rng.choice(INDUSTRIES)) for c in companies}
    # First names repeat across people, so a question's full name (not one word) picks the passage.
    first_names = [names.unique(lambda: names.word(1)) for _ in range(max(4, s["people"] // 8))]
    people = [names.unique(lambda: f"{rng.choice(first_names)} {names.word(2)}") for _ in range(s["people"])]
    person_city = {p: str(rng.choice(cities)) for p in people}
    person_job = {p: str(rng.choice(OCCUPATIONS)) for p in people}
    person_company = {p: str(rng.choice(companies)) for p in people}

    passages = []
    for country in countries:
        passages.append((country, f"{country} is a country. The capital of {country} is {capital[country]}."))
    for city in cities:
        passages.append((city, f"{city} is a city in {city_country[city]}."))
    for company in companies:
        passages.append((company, f"{company} is {with_article(company_industry[company])} company based in "
                                  f"{company_city[company]}."))
    for person in people:
        passages.append((person, f"{person} is {with_article(person_job[person])} born in {person_city[person]}. "
                                 f"{person} works for {person_company[person]}."))

    def one_hop(kind: str) -> tuple[str, str, str, str]:  # question, answer, bridge, named entity
        if kind == "person_city":
            p = str(rng.choice(people))
            return f"Where was {p} born?", person_city[p], "", p
        if kind == "person_occupation":
            p = str(rng.choice(people))
            return f"What is the occupation of {p}?", person_job[p], "", p
        if kind == "person_company":
            p = str(rng.choice(people))
            return f"Which company does {p} work for?", person_company[p], "", p
        if kind == "city_country":
            c = str(rng.choice(cities))
            return f"In which country is {c}?", city_country[c], "", c
        if kind == "company_city":
            c = str(rng.choice(companies))
            return f"Where is {c} based?", company_city[c], "", c
        country = str(rng.choice(countries))
        return f"What is the capital of {country}?", capital[country], "", country

    def two_hop(kind: str) -> tuple[str, str, str, str]:
        if kind == "person_country":
            p = str(rng.choice(people))
            return f"In which country was {p} born?", city_country[person_city[p]], person_city[p], p
        if kind == "person_company_city":
            p = str(rng.choice(people))
            return (f"In which city is the company that {p} works for based?",
                    company_city[person_company[p]], person_company[p], p)
        c = str(rng.choice(companies))
        return f"In which country is {c} based?", city_country[company_city[c]], company_city[c], c

    def questions(count: int, split: str) -> tuple[Question, ...]:
        out = []
        for i in range(count):
            hops = 2 if rng.random() < s["two_hop_fraction"] else 1
            kind = str(rng.choice(TWO_HOP_KINDS if hops == 2 else ONE_HOP_KINDS))
            text, answer, bridge, entity = (two_hop if hops == 2 else one_hop)(kind)
            out.append(Question(f"lab_{split}_{i}", text, answer, hops, bridge, kind, entity))
        return tuple(out)

    return World(tuple(passages), questions(s["train_questions"], "train"), questions(s["dev_questions"], "dev"))


def _write_jsonl(path: Path, rows) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def question_files(directory: Path, split: str) -> tuple[str, ...]:
    """The per-hop question files of a split; file names name the benchmark the loader files them under."""
    return tuple(str(directory / f"{source}_lab_{split}.jsonl") for source in ("nq", "hotpotqa"))


def write_world(world: World, directory: Path) -> Path:
    """``corpus.jsonl`` plus ``{nq,hotpotqa}_lab_{train,dev}.jsonl`` (one-hop / two-hop) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_jsonl(directory / "corpus.jsonl", world.corpus_rows())
    for split, questions in (("train", world.train), ("dev", world.dev)):
        one, two = question_files(directory, split)
        _write_jsonl(Path(one), (q.row() for q in questions if q.hops == 1))
        _write_jsonl(Path(two), (q.row() for q in questions if q.hops == 2))
    return directory


def read_questions(path: str | Path) -> list[dict]:
    """The raw rows of a world question file (with ``metadata.bridge``, which ``QARecord`` drops)."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
