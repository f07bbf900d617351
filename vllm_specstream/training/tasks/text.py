"""E2E-style data-to-text task: restaurant meaning representations and templated references."""

from __future__ import annotations

import random

from vllm_specstream.training.tasks._english import articled
from vllm_specstream.training.tasks._split import draw, normalise_key

_E2E_ADJ = (
    "Golden",
    "Blue",
    "Red",
    "Green",
    "Silver",
    "Old",
    "Little",
    "Royal",
    "Rusty",
    "Jolly",
    "Happy",
    "Hidden",
    "Wandering",
    "Twin",
    "Black",
    "White",
    "Sleepy",
    "Crooked",
    "Merry",
    "Brave",
    "Lucky",
    "Hungry",
    "Copper",
    "Velvet",
    "Laughing",
)
_E2E_NOUN = (
    "Eagle",
    "Dragon",
    "Palace",
    "Mill",
    "Plough",
    "Phoenix",
    "Spice",
    "Lion",
    "Punter",
    "Wrestlers",
    "Cricketers",
    "Vine",
    "Oak",
    "Anchor",
    "Lantern",
    "Swan",
    "Fox",
    "Bell",
    "Harbour",
    "Garden",
    "Kettle",
    "Crown",
    "Barrel",
    "Olive",
    "Bridge",
)
_E2E_SINGLE = (
    "Aromi",
    "Zizzi",
    "Cotto",
    "Fitzbillies",
    "Alimentum",
    "Bibimbap House",
    "Browns Cambridge",
    "Clowns",
    "Giraffe",
    "Loch Fyne",
    "Midsummer House",
    "Strada",
    "Taste of Cambridge",
    "Wildwood",
    "Cocum",
    "Travellers Rest Beefeater",
)
_E2E_LANDMARKS = (
    "Café Rouge",
    "Burger King",
    "The Bakers",
    "Raja Indian Cuisine",
    "Crowne Plaza Hotel",
    "Yippee Noodle Bar",
    "Café Sicilia",
    "Rainbow Vegetarian Café",
    "Express by Holiday Inn",
    "The Portland Arms",
    "All Bar One",
    "Ranch",
    "Café Brazil",
    "The Sorrento",
    "Avalon",
    "Clare Hall",
    "The Six Bells",
)
E2E_VALUES = {
    "eatType": ("coffee shop", "restaurant", "pub"),
    "food": ("French", "Italian", "Chinese", "Indian", "Japanese", "English", "Fast food"),
    "priceRange": ("cheap", "moderate", "high", "less than £20", "£20-25", "more than £30"),
    "customer rating": ("low", "average", "high", "1 out of 5", "3 out of 5", "5 out of 5"),
    "area": ("riverside", "city centre"),
    "familyFriendly": ("yes", "no"),
}
#: E2E attribute order (the MR lists attributes in this order).
E2E_ORDER = (
    "name",
    "eatType",
    "food",
    "priceRange",
    "customer rating",
    "area",
    "familyFriendly",
    "near",
)
_PRICE_ADJ = {
    "cheap": ("cheap", "inexpensive", "low-priced"),
    "moderate": ("moderately priced", "mid-priced", "reasonably priced"),
    "high": ("expensive", "high-priced", "pricey"),
}
_PRICE_POST = {
    "less than £20": "with prices under £20",
    "£20-25": "with prices of £20-25",
    "more than £30": "with prices over £30",
}


def _e2e_name(rng: random.Random, pool: tuple[str, ...] = _E2E_SINGLE) -> str:
    if rng.random() < 0.75:
        return f"The {rng.choice(_E2E_ADJ)} {rng.choice(_E2E_NOUN)}"
    return rng.choice(pool)


def e2e_mr(rng: random.Random) -> dict[str, str]:
    """A random meaning representation: a name plus 2-7 other attributes."""
    attrs = {"name": _e2e_name(rng)}
    chosen = set(rng.sample(E2E_ORDER[1:], rng.randint(2, 7)))
    for slot in E2E_ORDER[1:]:
        if slot in chosen:
            attrs[slot] = (
                _e2e_name(rng, _E2E_LANDMARKS) if slot == "near" else rng.choice(E2E_VALUES[slot])
            )
    if attrs.get("near") == attrs["name"]:
        del attrs["near"]
    return attrs


def format_mr(attrs: dict[str, str]) -> str:
    """``name[X], eatType[Y], ...`` in E2E attribute order."""
    return ", ".join(f"{slot}[{attrs[slot]}]" for slot in E2E_ORDER if slot in attrs)


def realise(attrs: dict[str, str], rng: random.Random) -> str:
    """One templated sentence that states every attribute of ``attrs``."""
    name, noun = attrs["name"], attrs.get("eatType", rng.choice(("place", "venue")))
    food, price, rating = attrs.get("food"), attrs.get("priceRange"), attrs.get("customer rating")
    family = attrs.get("familyFriendly")
    evaluative, post = [], []  # comma-separated adjectives before the noun; clauses after it
    if price in _PRICE_ADJ:
        evaluative.append(rng.choice(_PRICE_ADJ[price]))
    elif price:
        post.append(_PRICE_POST[price])
    if family == "yes":
        evaluative.append(rng.choice(("family-friendly", "kid-friendly", "child-friendly")))
    elif family == "no":
        evaluative.append(rng.choice(("adults-only", "non-family-friendly")))
    cuisine = food if food != "Fast food" else "fast food"
    food_adj = None
    if food and rng.random() < 0.4:
        post.append("serving fast food" if food == "Fast food" else f"serving {food} food")
    elif food:
        food_adj = cuisine
    if rating:
        post.append(
            f"with {articled(rating)} customer rating"
            if "out of" not in rating
            else f"rated {rating} by customers"
        )
    where = []
    if "area" in attrs:
        where.append("by the riverside" if attrs["area"] == "riverside" else "in the city centre")
    if "near" in attrs:
        where.append(f"near {attrs['near']}")
    rng.shuffle(post)
    description = articled(" ".join(w for w in (", ".join(evaluative), food_adj, noun) if w))
    tail = "".join(f" {clause}" if i == 0 else f", {clause}" for i, clause in enumerate(post))
    place = "".join(f" {w}" for w in where)
    template = rng.randrange(3) if where else rng.choice((0, 2))
    if template == 1:
        return f"Located{place}, {name} is {description}{tail}."
    if template == 2:
        return f"There is {description} called {name}{place}{tail}."
    return f"{name} is {description}{place}{tail}."


def text_record(rng: random.Random) -> dict:
    """One random ``{"mr", "ref"}`` record."""
    attrs = e2e_mr(rng)
    return {"mr": format_mr(attrs), "ref": realise(attrs, rng)}


def text_key(record: dict) -> str:
    return normalise_key(record["mr"])


def build_text(split: str, n: int, seed: int) -> list[dict]:
    """``n`` distinct data-to-text records of ``split``."""
    return draw("text", split, n, seed, text_record, text_key)
