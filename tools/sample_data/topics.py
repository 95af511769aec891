"""Topic generators for the sample dialogues: one (user, assistant) exchange and follow-ups.

Each generator draws from a seeded ``random.Random`` and computes every checkable answer
(arithmetic, unit conversions, letter counts, orderings) instead of typing it in; the fact and
phrasing tables live in ``tables``. ``dialogues`` assembles whole dialogues.
"""

from . import tables as T


def _end(text):
    """Close a sentence with a period unless it already ends with one ("Washington, D.C.")."""
    return text if text.endswith((".", "!", "?")) else text + "."


def _cap(text):
    """Upper-case the first letter only; ``str.capitalize`` would lower "Paris" in the rest."""
    return text[:1].upper() + text[1:]


def _pick(rng, short, full, p_short=0.2):
    """Choose a terse or a full reply: real assistants give both kinds to the same question."""
    return short if rng.random() < p_short else full


def _arithmetic(rng):
    """Arithmetic with the answer computed here, plus a follow-up that reuses the result."""
    op = rng.choice("+-*/")
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if op == "*":
        a, b = rng.randint(2, 30), rng.randint(2, 12)
    elif op == "/":
        b = rng.randint(2, 12)
        a = b * rng.randint(2, 15)  # exact division only: no rounding to explain
    elif op == "-" and b > a:
        a, b = b, a
    r = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    word = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}[op]
    user = rng.choice(
        [
            f"What is {a} {word} {b}?",
            f"What's {a} {op} {b}?",
            f"Calculate {a} {op} {b}.",
            f"{a} {op} {b} = ?",
            f"{a}{op}{b}",
        ]
    )
    full = f"{a} {word} {b} is {r}."
    if op == "*" and a >= 10 and a % 10:
        t, u = a - a % 10, a % 10
        full += f" Split it up: {t} x {b} = {t * b} and {u} x {b} = {u * b}, which add to {r}."
    elif op == "/":
        full += f" You can check it: {b} x {r} = {a}."
    elif op == "-":
        full += f" Check: {r} + {b} = {a}."
    elif op == "+" and a >= 10 and b >= 10:
        ta, tb = a - a % 10, b - b % 10
        full += (
            f" Add the tens, {ta} + {tb} = {ta + tb}, then the ones, {a % 10} + {b % 10} = "
            f"{a % 10 + b % 10}, and {ta + tb} + {a % 10 + b % 10} = {r}."
        )
    c = rng.randint(2, 9)
    follow = rng.choice(
        [
            (f"And if you add {c} to that?", f"{r} + {c} = {r + c}."),
            (f"Now multiply that by {c}.", f"{r} x {c} = {r * c}."),
        ]
    )
    return [(user, _pick(rng, f"{r}.", full)), follow]


def _word_problem(rng):
    """A one-line story problem; the sum or product is computed, never typed."""
    item = rng.choice(["apples", "books", "pencils", "cookies", "marbles", "stickers"])
    a, b = rng.randint(2, 20), rng.randint(2, 12)
    if rng.random() < 0.5:
        user = f"If I have {a} {item} and get {b} more, how many {item} do I have?"
        return [(user, _pick(rng, f"{a + b}.", f"You have {a} + {b} = {a + b} {item}."))]
    user = f"A box holds {b} {item}. How many {item} are in {a} boxes?"
    return [(user, _pick(rng, f"{a * b}.", f"{a} boxes x {b} {item} = {a * b} {item}."))]


def _conversion(rng):
    """Exact unit conversions, both directions, and Celsius to Fahrenheit."""
    if rng.random() < 0.2:
        c = 5 * rng.randint(-8, 20)  # multiples of 5 keep C * 9 / 5 an integer
        f = c * 9 // 5 + 32
        user = rng.choice([f"What is {c} degrees Celsius in Fahrenheit?", f"Convert {c}C to F."])
        full = (
            f"Multiply by 9/5 and add 32: {c} x 9/5 = {c * 9 // 5}, plus 32 is {f}. "
            f"So {c} degrees Celsius is {f} degrees Fahrenheit."
        )
        return [(user, _pick(rng, f"{f} degrees Fahrenheit.", full))]
    one, big, small, factor = rng.choice(T.UNITS)
    factor, v = int(factor), rng.randint(2, 12)
    why = f"There are {factor} {small} in {one}"
    if rng.random() < 0.6:
        user = rng.choice([f"How many {small} are in {v} {big}?", f"Convert {v} {big} to {small}."])
        full = f"{why}, so {v} {big} is {v} x {factor} = {v * factor} {small}."
        return [(user, _pick(rng, f"{v * factor} {small}.", full))]
    user = rng.choice(
        [f"How many {big} is {v * factor} {small}?", f"Convert {v * factor} {small} to {big}."]
    )
    full = f"{why}, so {v * factor} {small} is {v * factor} / {factor} = {v} {big}."
    return [(user, _pick(rng, f"{v} {big}.", full))]


def _geography(rng):
    """Capital cities, with a "what about X?" follow-up on a second country."""
    (country, city, continent), (c2, city2, _) = rng.sample(T.CAPITALS, 2)
    user = rng.choice(
        [
            f"What is the capital of {country}?",
            f"Capital of {country}?",
            f"Which city is the capital of {country}?",
            f"capital of {country}",
        ]
    )
    full = f"The capital of {country} is {_end(city)} {_cap(country)} is in {continent}."
    follow = (f"What about {c2}?", _pick(rng, _end(city2), f"The capital of {c2} is {_end(city2)}"))
    return [(user, _pick(rng, _end(city), full)), follow]


def _fact(rng):
    """Fixed science and general-knowledge facts that are not in dispute."""
    question, short, full = rng.choice(T.FACTS)
    return [(question, _pick(rng, short, full))]


def _yes_no(rng):
    """Yes/no questions: primality, parity and comparisons computed, plus fixed facts."""
    kind, n = rng.randrange(5), rng.randint(2, 99)
    if kind == 0:
        d = next((k for k in range(2, n) if n % k == 0), None)
        full = f"Yes, {n} is a prime number." if d is None else f"No, {n} is divisible by {d}."
        return [(f"Is {n} a prime number?", _pick(rng, "Yes." if d is None else "No.", full))]
    if kind == 1:
        even = n % 2 == 0
        full = f"{'Yes' if even else 'No'}, {n} is {'even' if even else 'odd'}."
        return [(f"Is {n} an even number?", _pick(rng, "Yes." if even else "No.", full))]
    if kind == 2:
        m = rng.randint(2, 99)
        ans = "Yes" if n > m else "No"
        rel = "greater than" if n > m else ("equal to" if n == m else "less than")
        return [(f"Is {n} greater than {m}?", _pick(rng, ans + ".", f"{ans}, {n} is {rel} {m}."))]
    if kind == 3:
        (country, city, _), (_, other, _) = rng.sample(T.CAPITALS, 2)
        guess = rng.choice([city, other])
        full = (
            f"Yes, {city} is the capital of {country}."
            if guess == city
            else f"No, the capital of {country} is {_end(city)}"
        )
        user = f"Is {guess} the capital of {country}?"
        return [(user, _pick(rng, "Yes." if guess == city else "No.", full))]
    question, ans, why = rng.choice(T.YES_NO)
    return [(question, _pick(rng, ans + ".", f"{ans}, {why}"))]


def _translation(rng):
    """Single words into Spanish, French or German, with an "and in X?" follow-up."""
    row = rng.choice(T.TRANSLATIONS)
    lang, lang2 = rng.sample(range(3), 2)
    word, target, target2 = row[0], row[1 + lang], row[1 + lang2]
    name = T.LANGUAGES[lang]
    user = rng.choice(
        [
            f"How do you say '{word}' in {name}?",
            f"Translate '{word}' to {name}.",
            f"{word} in {name}?",
        ]
    )
    full = f"'{_cap(word)}' in {name} is '{target}'."
    follow = (f"And in {T.LANGUAGES[lang2]}?", f"In {T.LANGUAGES[lang2]} it is '{target2}'.")
    return [(user, _pick(rng, _cap(target) + ".", full)), follow]


def _definition(rng):
    """Short definitions written for this file."""
    article, word, meaning, example = rng.choice(T.DEFINITIONS)
    term = f"{article} {word}".strip()
    user = rng.choice([f"What is {term}?", f"Define {word}.", f"What does '{word}' mean?"])
    answer = f"{_cap(term)} is {meaning}"
    return [(user, _pick(rng, answer, f"{answer} For example: {example}", p_short=0.4))]


def _howto(rng):
    """Numbered how-to steps, the longest single replies in the file."""
    task, *steps = rng.choice(T.HOWTO)
    user = rng.choice([f"How do I {task}?", f"How to {task}?", f"Give me steps to {task}."])
    body = "\n".join(f"{i}. {step}" for i, step in enumerate(steps, 1))
    return [(user, rng.choice(["", "Here's how:\n", "Sure:\n"]) + body)]


def _list_items(rng):
    """Name k members of a category, as an inline sentence, bullets or numbers."""
    name, *items = rng.choice(T.CATEGORIES)
    k = rng.randint(2, 5)
    picked = rng.sample(items, k)
    user = rng.choice(
        [
            f"Name {T.NUMBER_WORDS[k]} {name}.",
            f"List {T.NUMBER_WORDS[k]} {name}.",
            f"Give me {T.NUMBER_WORDS[k]} {name}, please.",
        ]
    )
    style = rng.randrange(3)
    if style == 0:
        return [(user, _cap(", ".join(picked[:-1]) + " and " + picked[-1] + "."))]
    marks = ["-"] * k if style == 1 else [f"{i}." for i in range(1, k + 1)]
    return [(user, "\n".join(f"{m} {_cap(x)}" for m, x in zip(marks, picked)))]


def _ordering(rng):
    """Sorting numbers or words and calendar order, all computed."""
    kind = rng.randrange(4)
    if kind == 0:
        nums = rng.sample(range(1, 100), rng.randint(3, 6))
        user = "Sort these numbers from smallest to largest: " + ", ".join(map(str, nums))
        return [(user, ", ".join(map(str, sorted(nums))) + ".")]
    if kind == 1:
        pool = [row[0] for row in T.TRANSLATIONS if " " not in row[0]]
        words = rng.sample(pool, rng.randint(3, 5))
        return [
            (
                "Put these words in alphabetical order: " + ", ".join(words),
                ", ".join(sorted(words)) + ".",
            )
        ]
    if kind == 2:
        i = rng.randrange(7)
        nxt = T.DAYS[(i + 1) % 7]
        full = f"{nxt} comes after {T.DAYS[i]}."
        return [(f"What day comes after {T.DAYS[i]}?", _pick(rng, nxt + ".", full))]
    i = rng.randrange(12)
    return [
        (
            f"What is the {T.ORDINALS[i]} month of the year?",
            _pick(rng, T.MONTHS[i] + ".", f"The {T.ORDINALS[i]} month is {T.MONTHS[i]}."),
        )
    ]


def _explain(rng):
    """Why/how questions with a few sentences of answer."""
    return [rng.choice(T.EXPLAIN)]


def _compose(rng):
    """Write a short personal message from an opening, 1-2 body sentences and a sign-off."""
    occasion, opening, *rest = rng.choice(T.MESSAGES)
    to, sender = rng.sample(T.NAMES, 2)
    body = [opening] + sorted(rng.sample(rest, rng.randint(1, 2)), key=rest.index)
    user = rng.choice(
        [
            f"Write {to} a short {occasion}.",
            f"Can you write {to} a {occasion}? Sign it from {sender}.",
        ]
    )
    sign = sender if "Sign it" in user else "[Your name]"
    greeting = rng.choice([f"Dear {to},", f"Hi {to},", f"{to},"])
    closing = rng.choice(["Best wishes,", "Warmly,", "Take care,", "Cheers,"])
    return [(user, f"{greeting}\n\n{' '.join(body)}\n\n{closing}\n{sign}")]


def _letters(rng):
    """Letter counts, spelled out so the count can be checked by eye."""
    word = rng.choice(T.WORDS)
    spelled = "-".join(word)
    if rng.random() < 0.3:
        full = f"'{word}' is spelled {spelled}, so it has {len(word)} letters."
        return [(f"How many letters are in the word '{word}'?", _pick(rng, f"{len(word)}.", full))]
    # A few letters that never occur teach the answer "zero" instead of always "at least one".
    letter = rng.choice(word) if rng.random() < 0.9 else rng.choice("qxzj")
    n = word.count(letter)
    user = rng.choice(
        [
            f"How many times does the letter '{letter}' appear in '{word}'?",
            f"How many {letter}'s are in {word}?",
        ]
    )
    times = "once" if n == 1 else f"{n} times"
    full = (
        f"Spelled out, '{word}' is {spelled}. The letter '{letter}' appears {times}."
        if n
        else f"The letter '{letter}' does not appear in '{word}'."
    )
    return [(user, _pick(rng, f"{n}.", full))]


def _rewrite(rng):
    """Rewrite a sentence: polite form, past tense, upper case, or count its words."""
    kind = rng.randrange(4)
    if kind == 0:
        req = rng.choice(T.REQUESTS)
        return [(f"Make this more polite: {_cap(req)}.", f"Could you please {req}?")]
    subject = rng.choice(T.SUBJECTS)
    present, past, rest = rng.choice(T.VERBS)
    sentence = f"{subject} {present} {rest}."
    if kind == 1:
        return [(f"Rewrite in the past tense: {sentence}", f"{subject} {past} {rest}.")]
    if kind == 2:
        return [(f"Rewrite this in capital letters: {sentence}", sentence.upper())]
    n = len(sentence.split())
    return [
        (
            f"How many words are in this sentence? {sentence}",
            _pick(rng, f"{n}.", f"The sentence has {n} words."),
        )
    ]


def _small_talk(rng):
    """Polite chit-chat that needs no facts."""
    return [rng.choice(T.SMALL_TALK)]


# (topic, weight): checkable topics weigh more because they are what a demo model can get right.
_TOPICS = [
    (_arithmetic, 3),
    (_word_problem, 1),
    (_conversion, 2),
    (_geography, 3),
    (_fact, 2),
    (_yes_no, 2),
    (_translation, 2),
    (_definition, 2),
    (_howto, 2),
    (_list_items, 2),
    (_ordering, 1),
    (_letters, 2),
    (_rewrite, 2),
    (_small_talk, 1),
    (_explain, 4),
    (_compose, 3),
]


def topic(rng):
    """One topic's exchanges: the main (user, assistant) pair, then optional follow-ups."""
    fns, weights = zip(*_TOPICS)
    (user, assistant), *follow = rng.choices(fns, weights)[0](rng)
    if user.endswith("?") and rng.random() < 0.3:
        prefix = rng.choice(T.PREFIXES)
        user = prefix + (user if prefix.endswith(". ") else user[:1].lower() + user[1:])
    return [(user, assistant)] + follow
