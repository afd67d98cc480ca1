"""Project-written sentences of varied length and topic, reproducible from a seed.

Used for stage 0's quantization quality gate and static-INT8 calibration, the benchmarks, the
load tests and the tests; it lives in ``common`` so that none of them depends on stage 0 for its
texts (a stage may import ``common``, the measuring kit may import both). Sentences are assembled
from small hand-written templates, so every call with the same seed yields the same texts, and
different seeds yield texts the cache has not seen.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_TOPICS: dict[str, dict[str, list[str]]] = {
    "cooking": {
        "subject": ["the chef", "my grandmother", "a line cook", "the baker", "our neighbour"],
        "verb": ["simmers", "roasts", "whisks", "seasons", "slices", "folds"],
        "object": [
            "the tomato sauce",
            "a loaf of sourdough",
            "fresh basil",
            "the onions",
            "a pot of lentils",
            "the pastry dough",
        ],
        "tail": [
            "before the guests arrive",
            "for about twenty minutes",
            "with a pinch of salt",
            "until it turns golden",
            "on a cast iron pan",
            "while the oven heats up",
        ],
    },
    "finance": {
        "subject": [
            "the central bank",
            "an index fund",
            "the startup",
            "a retail investor",
            "the treasurer",
            "the auditor",
        ],
        "verb": ["raises", "reviews", "hedges", "reports", "cuts", "rebalances"],
        "object": [
            "interest rates",
            "the quarterly budget",
            "its currency exposure",
            "operating costs",
            "the bond portfolio",
            "cash reserves",
        ],
        "tail": [
            "after a weak jobs report",
            "ahead of the earnings call",
            "by half a percent",
            "to calm the markets",
            "for the third year in a row",
            "despite rising inflation",
        ],
    },
    "sports": {
        "subject": [
            "the goalkeeper",
            "a young sprinter",
            "the home team",
            "the coach",
            "the veteran striker",
            "a tennis player",
        ],
        "verb": ["blocks", "wins", "trains for", "loses", "celebrates", "prepares for"],
        "object": [
            "the penalty kick",
            "the final match",
            "the marathon",
            "a tight rematch",
            "the championship title",
            "the season opener",
        ],
        "tail": [
            "in front of a packed stadium",
            "in extra time",
            "under heavy rain",
            "after months of injury",
            "with a record crowd watching",
            "on a cold evening",
        ],
    },
    "science": {
        "subject": [
            "the telescope",
            "a research team",
            "the enzyme",
            "the satellite",
            "a graduate student",
            "the climate model",
        ],
        "verb": ["detects", "measures", "predicts", "catalyses", "maps", "simulates"],
        "object": [
            "a distant galaxy",
            "ocean temperatures",
            "protein folding",
            "the magnetic field",
            "rainfall patterns",
            "a faint radio signal",
        ],
        "tail": [
            "with unexpected precision",
            "over several decades",
            "in a peer reviewed study",
            "using machine learning",
            "for the first time",
            "near the polar ice caps",
        ],
    },
    "travel": {
        "subject": [
            "the night train",
            "a backpacker",
            "the ferry",
            "our tour guide",
            "the airline",
            "a family of four",
        ],
        "verb": ["reaches", "explores", "crosses", "recommends", "delays", "books"],
        "object": [
            "the old harbour",
            "a mountain village",
            "the border",
            "a quiet beach",
            "the evening flight",
            "a room near the station",
        ],
        "tail": [
            "just after sunrise",
            "during the festival",
            "without a map",
            "because of a storm",
            "for less than fifty euros",
            "at the end of summer",
        ],
    },
    "software": {
        "subject": [
            "the compiler",
            "a junior developer",
            "the load balancer",
            "the database",
            "the build server",
            "an on-call engineer",
        ],
        "verb": ["rejects", "refactors", "routes", "caches", "deploys", "debugs"],
        "object": [
            "the pull request",
            "a memory leak",
            "incoming traffic",
            "the query plan",
            "the nightly release",
            "a flaky test",
        ],
        "tail": [
            "before the weekend",
            "in under a second",
            "after the outage",
            "with a single config change",
            "across three regions",
            "late at night",
        ],
    },
    "health": {
        "subject": [
            "the nurse",
            "a family doctor",
            "the patient",
            "the clinic",
            "a physiotherapist",
            "the pharmacist",
        ],
        "verb": ["checks", "prescribes", "treats", "monitors", "explains", "schedules"],
        "object": [
            "blood pressure",
            "a course of antibiotics",
            "a sprained ankle",
            "sleep patterns",
            "the side effects",
            "a follow-up visit",
        ],
        "tail": [
            "every morning",
            "after the surgery",
            "within two weeks",
            "with great patience",
            "during flu season",
            "before the results arrive",
        ],
    },
    "nature": {
        "subject": [
            "the river",
            "a flock of geese",
            "the old oak",
            "a red fox",
            "the glacier",
            "the honeybee",
        ],
        "verb": ["floods", "crosses", "shelters", "hunts", "carves", "pollinates"],
        "object": [
            "the valley",
            "the frozen lake",
            "a nest of sparrows",
            "field mice",
            "the mountain side",
            "the apple blossoms",
        ],
        "tail": [
            "in early spring",
            "as the sun sets",
            "after heavy snowfall",
            "without making a sound",
            "year after year",
            "along the northern coast",
        ],
    },
}

_QUERY_STARTS = ["how to", "why does", "best way to", "what is", "where can I find", "when should"]
_CONNECTORS = ["Meanwhile,", "However,", "As a result,", "Later,", "In the end,", "Still,"]


def _sentence(rng: random.Random, topic: str) -> str:
    parts = _TOPICS[topic]
    words = [rng.choice(parts["subject"]), rng.choice(parts["verb"]), rng.choice(parts["object"])]
    if rng.random() < 0.8:
        words.append(rng.choice(parts["tail"]))
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def query(rng: random.Random) -> str:
    """A short search-style query (3-8 words)."""
    parts = _TOPICS[rng.choice(list(_TOPICS))]
    return f"{rng.choice(_QUERY_STARTS)} {rng.choice(parts['verb'])} {rng.choice(parts['object'])}"


def sentence(rng: random.Random) -> str:
    """One sentence of roughly 8-20 words, sometimes two joined."""
    topic = rng.choice(list(_TOPICS))
    text = _sentence(rng, topic)
    if rng.random() < 0.35:
        text += f" {rng.choice(_CONNECTORS)} " + _sentence(rng, topic).lower()
    return text


def passage(rng: random.Random, sentences: tuple[int, int] = (4, 14)) -> str:
    """A paragraph on one topic (roughly 40-250 words)."""
    topic = rng.choice(list(_TOPICS))
    n = rng.randint(*sentences)
    out = [_sentence(rng, topic)]
    for _ in range(n - 1):
        nxt = _sentence(rng, topic)
        if rng.random() < 0.3:
            nxt = f"{rng.choice(_CONNECTORS)} {nxt[0].lower()}{nxt[1:]}"
        out.append(nxt)
    return " ".join(out)


def mixed(rng: random.Random) -> str:
    """The mixed-length workload: 40% queries, 45% sentences, 15% passages."""
    roll = rng.random()
    if roll < 0.40:
        return query(rng)
    if roll < 0.85:
        return sentence(rng)
    return passage(rng)


def texts(n: int, seed: int = 0, kind: str = "mixed", unique: bool = True) -> list[str]:
    """``n`` texts of one ``kind`` (query, sentence, passage, mixed). ``unique`` adds a tag."""
    maker = {"query": query, "sentence": sentence, "passage": passage, "mixed": mixed}[kind]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = maker(rng)
        out.append(f"{text} (#{seed}-{i})" if unique else text)
    return out


def stream(seed: int = 0, kind: str = "sentence") -> Iterator[str]:
    """An endless reproducible stream of unique texts (load tests)."""
    maker = {"query": query, "sentence": sentence, "passage": passage, "mixed": mixed}[kind]
    rng = random.Random(seed)
    i = 0
    while True:
        yield f"{maker(rng)} (#{seed}-{i})"
        i += 1
