"""The items of the `ridgefill_cloze` task: plain facts a small instruct model mostly knows, each
with four one-word continuations (the answer first in the source, shuffled per item here so
position carries no signal). Written inline: the task must run with no network."""

import random

import datasets

ITEMS = [
    ("The capital of France is", "Paris", ["London", "Berlin", "Madrid"]),
    ("The largest planet in the solar system is", "Jupiter", ["Mars", "Venus", "Mercury"]),
    ("Water freezes at zero degrees", "Celsius", ["Kelvin", "minutes", "north"]),
    ("The opposite of hot is", "cold", ["blue", "loud", "tall"]),
    ("A week has seven", "days", ["apples", "rivers", "songs"]),
    ("The sun rises in the", "east", ["west", "kitchen", "bottle"]),
    ("Bees make", "honey", ["bricks", "glass", "paper"]),
    ("The chemical symbol for gold is", "Au", ["Ag", "Fe", "Pb"]),
    ("Two plus two equals", "four", ["seven", "nine", "eleven"]),
    ("The color of the clear daytime sky is", "blue", ["green", "purple", "brown"]),
    ("Shakespeare wrote Romeo and", "Juliet", ["Cleopatra", "Hamlet", "Portia"]),
    ("A baby cat is called a", "kitten", ["puppy", "calf", "foal"]),
    ("The capital of Japan is", "Tokyo", ["Beijing", "Seoul", "Bangkok"]),
    ("People read books in a", "library", ["volcano", "desert", "garage"]),
    ("The first month of the year is", "January", ["March", "October", "June"]),
    ("Ice is frozen", "water", ["sand", "smoke", "metal"]),
    ("The Earth orbits the", "Sun", ["Moon", "Mars", "comet"]),
    ("A square has four", "sides", ["wheels", "colors", "legs"]),
    ("Cows drink water and eat", "grass", ["stones", "plastic", "coins"]),
    ("The tallest animal in the world is the", "giraffe", ["mouse", "penguin", "snail"]),
]


def dataset(**kwargs):
    rng = random.Random(0)
    rows = []
    for context, answer, wrong in ITEMS:
        choices = [answer, *wrong]
        rng.shuffle(choices)
        rows.append(
            {"context": context, "choices": choices, "answer": choices.index(answer)}
        )
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}
