"""English phrasing helpers shared by the SQL and text generators."""


def articled(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word
