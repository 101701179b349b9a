"""Question answering over a synthetic encyclopedia with a ``search`` tool (one or two hops).

The world is made up (so no model knows it in advance) and generated deterministically from
a fixed seed: ``num_authors`` writers with invented names, each born in one of the
cities of eight invented countries, and ``num_books`` book titles, each written by one of
the writers. The corpus has one passage per fact::

    The Silver Lamp is a novel written by Ravel Omni.
    Ravel Omni was born in Kesta, a city in Norvania.
    Kesta is a city in Norvania.

Question kinds (``kinds`` kwarg):

* ``writer``: "Who wrote The Silver Lamp?" -> one search for the title.
* ``birthplace``: "In which city was Ravel Omni born?" -> one search for the name.
* ``author_country``: "In which country was the author of The Silver Lamp born?" -> two
  searches: the title gives the writer, the writer's name gives the country (no passage
  names both the book and the country, so one search cannot answer it).

The tool searches either an ``agentrl serve-search`` server at ``search_url`` (started with
``--corpus`` set to :func:`corpus_path`, the shipped copy of this corpus) or, when
``search_url`` is empty, the same BM25 index built in this process.

Splits: a question is in ``test`` when the SHA-1 of its text falls in the lowest
``test_fraction`` of the hash range; ``train`` cycles through the others, reshuffled with
``seed`` on every pass. Reward ``{"correct": 1.0}`` on a normalised exact match of the final
answer ("The answer is Norvania." and "norvania" both match). Demonstrations run the real
searches against the local index, so their tool results are what the agent would see.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from agentrl.envs.base import Env, Message, Task
from agentrl.envs.rewards import exact_match, final_assistant_text
from agentrl.tools.base import Tool
from agentrl.tools.search import SearchTool, format_passages
from agentrl.tools.search_server import SEARCH_TOKEN_ENV

SYSTEM_PROMPT = "Use the search tool to look up facts, then give a short answer."
KINDS = ("writer", "birthplace", "author_country")
CORPUS_FILE = Path(__file__).parent / "data" / "search_qa_corpus.jsonl"

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ra",
    "ven",
    "tor",
    "sel",
    "dri",
    "mar",
    "no",
    "bel",
    "quin",
    "sa",
    "tu",
    "fen",
    "gal",
    "ori",
    "pel",
    "zan",
    "du",
    "her",
    "vo",
    "li",
    "ast",
]
_ADJECTIVES = [
    "Silver",
    "Hidden",
    "Broken",
    "Quiet",
    "Crimson",
    "Endless",
    "Golden",
    "Last",
    "Frozen",
    "Wandering",
    "Distant",
    "Burning",
    "Secret",
    "Painted",
    "Sleeping",
    "Iron",
    "Glass",
    "Hollow",
    "Northern",
    "Lonely",
    "Bitter",
    "Bright",
    "Shifting",
    "Velvet",
]
_NOUNS = [
    "Lamp",
    "Garden",
    "River",
    "Tower",
    "Harbor",
    "Mirror",
    "Orchard",
    "Voyage",
    "Lantern",
    "Bridge",
    "Forest",
    "Clock",
    "Island",
    "Letter",
    "Crown",
    "Road",
    "Winter",
    "Feather",
    "Compass",
    "Shadow",
    "Meadow",
    "Citadel",
    "Archive",
    "Kingdom",
]
_COUNTRIES = ["Norvania", "Estraly", "Quorland", "Belmaria", "Tessaly", "Orvenia", "Dalmora", "Ketheria"]


def _name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()


@lru_cache(maxsize=4)
def build_world(num_authors: int = 150, num_books: int = 300, cities_per_country: int = 4) -> dict[str, Any]:
    """The synthetic facts and their corpus passages (deterministic)."""
    if num_books > len(_ADJECTIVES) * len(_NOUNS):
        raise ValueError(f"num_books is limited to {len(_ADJECTIVES) * len(_NOUNS)}")
    rng = random.Random("search-qa-world-v1")
    used: set[str] = set(_COUNTRIES)

    def fresh(make) -> str:
        while True:
            value = make()
            if value not in used:
                used.add(value)
                return value

    cities = {fresh(lambda: _name(rng, 2)): country for country in _COUNTRIES for _ in range(cities_per_country)}
    city_names = list(cities)
    authors = {
        fresh(lambda: f"{_name(rng, 2)} {_name(rng, rng.choice([2, 3]))}"): rng.choice(city_names)
        for _ in range(num_authors)
    }
    author_names = list(authors)
    titles = [f"The {a} {n}" for a in _ADJECTIVES for n in _NOUNS]
    rng.shuffle(titles)
    books = {title: rng.choice(author_names) for title in titles[:num_books]}
    passages = []
    for title, author in books.items():
        passages.append({"id": f"book-{len(passages)}", "text": f"{title} is a novel written by {author}."})
    for author, city in authors.items():
        passages.append(
            {"id": f"person-{len(passages)}", "text": f"{author} was born in {city}, a city in {cities[city]}."}
        )
    for city, country in cities.items():
        passages.append({"id": f"city-{len(passages)}", "text": f"{city} is a city in {country}."})
    return {"cities": cities, "authors": authors, "books": books, "passages": passages}


def write_corpus(path: str | Path, **world_kwargs: int) -> Path:
    """Write the corpus as JSONL for ``agentrl serve-search --corpus``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for passage in build_world(**world_kwargs)["passages"]:
            f.write(json.dumps(passage) + "\n")
    return out


def corpus_path() -> Path:
    """The shipped corpus of the default world (``agentrl/envs/data/search_qa_corpus.jsonl``)."""
    return CORPUS_FILE


@lru_cache(maxsize=4)
def _local_index(num_authors: int, num_books: int):
    from agentrl.tools.search_server import BM25Index

    return BM25Index(build_world(num_authors, num_books)["passages"])


def _bucket(text: str) -> float:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 16**8


class SearchQAEnv(Env):
    name = "search_qa"

    def __init__(
        self,
        search_url: str = "",
        top_k: int = 3,
        kinds: list[str] | tuple[str, ...] = KINDS,
        num_authors: int = 150,
        num_books: int = 300,
        test_fraction: float = 0.1,
        system_prompt: str = SYSTEM_PROMPT,
        search_token_env: str = SEARCH_TOKEN_ENV,
    ):
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"unknown question kinds {unknown}; choose from {', '.join(KINDS)}")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.search_url = search_url
        self.search_token_env = search_token_env
        self.top_k = top_k
        self.kinds = tuple(kinds)
        self.num_authors, self.num_books = num_authors, num_books
        self.test_fraction = test_fraction
        self.system_prompt = system_prompt
        self.world = build_world(num_authors, num_books)
        self._questions = self._all_questions()

    def _all_questions(self) -> list[Task]:
        w = self.world
        out = []
        for title, author in w["books"].items():
            if "writer" in self.kinds:
                out.append(self._task("writer", f"Who wrote {title}?", author, [title]))
            if "author_country" in self.kinds:
                country = w["cities"][w["authors"][author]]
                out.append(
                    self._task(
                        "author_country",
                        f"In which country was the author of {title} born?",
                        country,
                        [title, f"{author} born"],
                    )
                )
        if "birthplace" in self.kinds:
            for author, city in w["authors"].items():
                out.append(self._task("birthplace", f"In which city was {author} born?", city, [f"{author} born"]))
        return out

    @staticmethod
    def _task(kind: str, question: str, answer: str, queries: list[str]) -> Task:
        task_id = "sqa-" + hashlib.sha1(question.encode()).hexdigest()[:12]
        return Task(
            id=task_id,
            data={"kind": kind, "question": question, "answer": answer, "hops": len(queries), "queries": queries},
        )

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"search_qa env has splits 'train' and 'test', not {split!r}")
        in_test = [t for t in self._questions if _bucket(t.data["question"]) < self.test_fraction]
        if split == "test":
            yield from in_test
            return
        test_ids = {t.id for t in in_test}
        train = [t for t in self._questions if t.id not in test_ids]
        rng = random.Random(f"search-qa-train-{seed}")
        while True:
            rng.shuffle(train)
            yield from list(train)

    def initial_messages(self, task: Task) -> list[Message]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.data["question"]}]

    def tools(self) -> list[Tool]:
        if self.search_url:
            return [SearchTool(self.search_url, top_k=self.top_k, token_env=self.search_token_env)]
        return [SearchTool(index=_local_index(self.num_authors, self.num_books), top_k=self.top_k)]

    async def reward(self, task: Task, state: dict[str, Any], messages: list[Message]) -> dict[str, float]:
        text = final_assistant_text(messages)
        return {"correct": 1.0 if text is not None and exact_match(text, task.data["answer"]) else 0.0}

    def demonstration(self, task: Task) -> list[Message]:
        index = _local_index(self.num_authors, self.num_books)
        messages = self.initial_messages(task)
        for query in task.data["queries"]:
            call = {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            result = format_passages(index.search([query], self.top_k)[0])
            messages.append({"role": "tool", "name": "search", "content": result})
        messages.append({"role": "assistant", "content": f"The answer is {task.data['answer']}."})
        return messages
