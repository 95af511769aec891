"""Deterministic sample of short chat dialogues for fine-tuning demos.

Real SFT data is mostly short: one-word replies, bare greetings, empty system prompts and a
minority of multi-turn chats. This module composes such dialogues from templates and slot
values with a seeded ``random.Random``, so ``data/short_dialogues.jsonl`` regenerates byte for
byte. Every checkable answer (arithmetic, unit conversions, letter counts, orderings) is computed
here rather than typed in, so a model trained on the file learns true things.
"""

import json
import random

# Rough token budget: ~100 English words is ~150 tokens, the upper end of a "short" dialogue.
MAX_WORDS = 100


def _table(spec):
    """Parse one row per line, fields split by ``|``; keeps the fact tables compact."""
    return [tuple(f.strip() for f in line.split("|")) for line in spec.strip().splitlines()]


# "country=capital" pairs by continent; the article lives in the name ("the Netherlands").
_CAPITALS = [(country, city, continent) for continent, spec in {
    "Europe": "France=Paris; Germany=Berlin; Italy=Rome; Spain=Madrid; Portugal=Lisbon; "
              "Ireland=Dublin; the United Kingdom=London; Greece=Athens; Norway=Oslo; "
              "Sweden=Stockholm; Finland=Helsinki; Denmark=Copenhagen; Poland=Warsaw; "
              "Austria=Vienna; Hungary=Budapest; the Czech Republic=Prague; Belgium=Brussels; "
              "Iceland=Reykjavik; Ukraine=Kyiv",
    "Asia": "Japan=Tokyo; China=Beijing; India=New Delhi; South Korea=Seoul; Thailand=Bangkok; "
            "Vietnam=Hanoi; the Philippines=Manila; Saudi Arabia=Riyadh",
    "North America": "Canada=Ottawa; Mexico=Mexico City; Cuba=Havana; "
                     "the United States=Washington, D.C.",
    "South America": "Brazil=Brasilia; Argentina=Buenos Aires; Peru=Lima; Chile=Santiago; "
                     "Colombia=Bogota",
    "Africa": "Egypt=Cairo; Kenya=Nairobi; Nigeria=Abuja; Morocco=Rabat; Ghana=Accra",
    "Oceania": "Australia=Canberra; New Zealand=Wellington",
}.items() for country, city in (pair.split("=") for pair in spec.split("; "))]

# question | short answer | full answer
_FACTS = _table("""
Which is the largest ocean on Earth?|The Pacific.|The Pacific Ocean is the largest and deepest ocean on Earth.
What is the tallest mountain above sea level?|Mount Everest.|Mount Everest, in the Himalayas, is the tallest mountain above sea level.
Which continent is the largest?|Asia.|Asia is the largest continent, both by area and by population.
Which planet is closest to the sun?|Mercury.|Mercury is the planet closest to the sun, and also the smallest planet.
What is the largest planet in our solar system?|Jupiter.|Jupiter is the largest planet in our solar system, a gas giant.
How many planets are in the solar system?|Eight.|There are eight: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune.
Which planet is called the Red Planet?|Mars.|Mars is called the Red Planet because iron oxide in its dust gives it a reddish color.
How many legs does a spider have?|Eight.|A spider has eight legs. Insects, by contrast, have six.
What is the chemical formula of water?|H2O.|Water is H2O: two hydrogen atoms bonded to one oxygen atom.
What is the chemical symbol for gold?|Au.|The symbol for gold is Au, from the Latin word aurum.
What is the largest animal on Earth?|The blue whale.|The blue whale is the largest animal known to have ever lived.
Which gas do plants take in to make food?|Carbon dioxide.|Plants take in carbon dioxide and use sunlight and water to turn it into sugar, releasing oxygen.
How many days are in a leap year?|366.|A leap year has 366 days; the extra day is February 29.
What is the longest bone in the human body?|The femur.|The femur, or thigh bone, is the longest bone in the human body.
Who wrote Romeo and Juliet?|William Shakespeare.|Romeo and Juliet is a play by William Shakespeare.
At what temperature does water boil at sea level?|100 degrees Celsius.|At sea level water boils at 100 degrees Celsius, which is 212 degrees Fahrenheit.
""")

# question | answer word | explanation (yes/no questions about fixed facts)
_YES_NO = _table("""
Is the sun a star?|Yes|the sun is a medium-sized star at the center of our solar system.
Is a whale a fish?|No|whales are mammals. They breathe air and feed their young with milk.
Is a spider an insect?|No|spiders are arachnids. They have eight legs, while insects have six.
Can penguins fly?|No|penguins cannot fly, but they are excellent swimmers.
Is Pluto a planet?|No|since 2006 Pluto has been classified as a dwarf planet.
Is a tomato a fruit?|Yes|botanically a tomato is a fruit, though it is usually cooked as a vegetable.
Do bats lay eggs?|No|bats are mammals and give birth to live young.
Is ice lighter than liquid water?|Yes|ice is less dense than liquid water, which is why it floats.
""")

# English | Spanish | French | German (words without accents, to stay ASCII)
_TRANSLATIONS = _table("""
hello|hola|bonjour|hallo
thank you|gracias|merci|danke
cat|gato|chat|Katze
dog|perro|chien|Hund
water|agua|eau|Wasser
house|casa|maison|Haus
book|libro|livre|Buch
red|rojo|rouge|rot
blue|azul|bleu|blau
bread|pan|pain|Brot
apple|manzana|pomme|Apfel
sun|sol|soleil|Sonne
moon|luna|lune|Mond
friend|amigo|ami|Freund
milk|leche|lait|Milch
flower|flor|fleur|Blume
good night|buenas noches|bonne nuit|gute Nacht
two|dos|deux|zwei
three|tres|trois|drei
""")
_LANGUAGES = ["Spanish", "French", "German"]

# article | word | definition | example (no article for mass nouns: "What is gravity?")
_DEFINITIONS = _table("""
an|algorithm|a step-by-step procedure for solving a problem or doing a task.|A cooking recipe is a simple algorithm.
a|noun|a word that names a person, place, thing or idea.|In "The dog ate the bread", "dog" and "bread" are nouns.
a|verb|a word that describes an action or a state.|In "She runs every day", the verb is "runs".
a|synonym|a word that means the same or nearly the same as another word.|"Big" and "large" are synonyms.
an|antonym|a word with the opposite meaning of another word.|"Hot" and "cold" are antonyms.
a|prime number|a whole number greater than 1 whose only divisors are 1 and itself.|2, 3, 5, 7 and 11 are the first five primes.
|gravity|the force that pulls objects with mass toward each other.|Gravity is why a dropped ball falls to the ground.
|evaporation|the change of a liquid into a gas.|A puddle drying in the sun is evaporation.
a|habitat|the natural home of an animal or plant, where it finds food and shelter.|The ocean is the habitat of the octopus.
a|fraction|a number that represents part of a whole.|If you eat 3 of 4 equal slices of a pie, you ate 3/4 of it.
a|metaphor|a figure of speech that describes something as if it were something else.|"Time is money" is a metaphor.
a|budget|a plan for how much money you will earn and spend over a period of time.|A monthly budget might set aside money for rent, food and savings.
an|ecosystem|a community of living things together with the environment they live in.|A pond, with its fish, plants, insects and water, is an ecosystem.
a|perimeter|the total length of the boundary around a flat shape.|A square with 3 cm sides has a perimeter of 12 cm.
a|volcano|an opening in the Earth's crust through which molten rock, ash and gas escape.|Mount Fuji in Japan is a volcano.
""")

# question | answer: the longest single replies, short explanations written for this file
_EXPLAIN = _table("""
Why is the sky blue?|Sunlight contains every color. Air molecules scatter short blue wavelengths much more strongly than long red ones, so blue light reaches your eyes from all over the sky. At sunset the light crosses more air, more blue is scattered away, and the sky turns orange and red.
Why do we have seasons?|Earth's axis is tilted about 23.5 degrees. As Earth orbits the sun, each hemisphere takes turns leaning toward it. The half tilted toward the sun gets more direct light and longer days, so it has summer while the other half has winter. Distance from the sun is not the cause.
What causes ocean tides?|Mostly the moon's gravity. It pulls the oceans into a bulge on the side of Earth facing the moon and another on the opposite side. As Earth turns through these bulges, most coasts get two high tides and two low tides a day. The sun adds a smaller effect.
How does a rainbow form?|Sunlight enters raindrops, bends, reflects off the back of each drop and bends again on the way out. Each color bends by a slightly different amount, so white light spreads into red, orange, yellow, green, blue, indigo and violet. You see a rainbow with the sun behind you.
Why does ice float?|Water expands when it freezes: its molecules lock into an open crystal pattern that takes more space, so ice is about 9 percent less dense than liquid water. Anything less dense than the liquid around it floats. That is why lakes freeze from the top down.
Why do leaves change color in autumn?|Leaves are green because of chlorophyll, which captures sunlight. Shorter, cooler days make trees stop producing it. As the green fades, yellow and orange pigments that were there all along show through, and some trees also make new red pigments.
What is the difference between weather and climate?|Weather is what the air is doing now or over a few days: rain, wind, sun and temperature. Climate is the usual pattern of weather in a place over many years, typically 30 or more. A cold day is weather; cold winters every year are climate.
""")

# occasion | opening sentence | further sentences (a message keeps the opening, then 1-2 of these)
_MESSAGES = _table("""
birthday message|Happy birthday!|I hope your day is full of laughter and good food.|Wishing you a wonderful year ahead.|Thank you for being such a great friend.
thank-you note|Thank you so much for your help this week.|I really appreciated your time and patience.|It made a big difference to me.|Next coffee is on me.
get-well message|I was sorry to hear you are not feeling well.|Take all the time you need to rest.|I am thinking of you and hope you feel better soon.
note congratulating them on a new job|Congratulations on the new job!|They are lucky to have you.|I know you will do great things there.|Let's celebrate soon.
good-luck message for an exam|Good luck on your exam tomorrow!|You have prepared well, so trust yourself.|Get a good night's sleep and take it one question at a time.
""")
_NAMES = ["Anna", "Tom", "Maria", "David", "Priya", "Sam", "Lena", "Omar"]

# task | steps...
_HOWTO = _table("""
make a cup of tea|Boil fresh water.|Put a tea bag in a cup.|Pour the hot water over it.|Let it steep for three to five minutes, then remove the bag.
boil an egg|Put the egg in a pot and cover it with cold water.|Bring the water to a boil.|Simmer about 6 minutes for a soft yolk or 10 for a firm one.|Cool the egg in cold water before peeling.
wash your hands properly|Wet your hands with clean water.|Lather with soap, including between your fingers.|Scrub for at least 20 seconds.|Rinse and dry with a clean towel.
plant a seed|Fill a small pot with moist soil.|Press the seed in about twice as deep as it is wide.|Cover it lightly.|Keep the soil damp and the pot in a warm, bright spot.
write a thank-you note|Greet the person by name.|Thank them for the specific gift or help.|Say what it meant to you.|Sign off warmly.
prepare for a job interview|Research the company and the role.|Practice answers to common questions.|Prepare two questions to ask.|Plan your route the day before.
save money each month|Track your spending for a month.|Set a limit for each category.|Move a fixed amount to savings on payday.
""")

# category | items... (a model should list real members, so every item is a clear member)
_CATEGORIES = _table("""
fruits|apple|banana|cherry|grape|mango|orange|pear|peach|plum|kiwi
colors|red|blue|green|yellow|purple|orange|black|white|pink|brown
animals|dog|cat|horse|elephant|lion|rabbit|giraffe|dolphin|owl|tiger
vegetables|carrot|broccoli|spinach|potato|onion|cabbage|lettuce|pea|celery
musical instruments|piano|guitar|violin|drums|flute|trumpet|cello|harp|clarinet
sports|soccer|tennis|basketball|swimming|cycling|volleyball|golf|rugby|baseball
programming languages|Python|Java|C|JavaScript|Rust|Go|Ruby|Kotlin|Swift
planets|Mercury|Venus|Earth|Mars|Jupiter|Saturn|Uranus|Neptune
""")

# present | past | rest of sentence
_VERBS = _table("""
walks|walked|to the park after lunch
plays|played|the piano every evening
cooks|cooked|dinner for the whole family
opens|opened|the window in the morning
watches|watched|a movie with friends
writes|wrote|a letter to an old friend
reads|read|the newspaper before work
drives|drove|to the office
buys|bought|fresh bread at the market
teaches|taught|math at the local school
""")
_SUBJECTS = ["She", "He", "My brother", "The teacher", "Our neighbor", "Anna", "Tom"]
_REQUESTS = ["send me the file", "close the door", "call me back later", "check these numbers",
             "turn down the music", "book a table for two", "review my draft", "wait a moment"]
_WORDS = ["banana", "strawberry", "elephant", "mississippi", "committee", "bookkeeper", "apple",
          "necessary", "rhythm", "balloon", "library", "computer", "umbrella", "giraffe",
          "pepper", "success", "coffee", "parallel", "tomorrow", "address", "happiness", "level"]
_UNITS = _table("""
a kilometer|kilometers|meters|1000
a meter|meters|centimeters|100
a kilogram|kilograms|grams|1000
an hour|hours|minutes|60
a minute|minutes|seconds|60
a day|days|hours|24
a week|weeks|days|7
a foot|feet|inches|12
a yard|yards|feet|3
a liter|liters|milliliters|1000
a year|years|months|12
""")
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
             "ninth", "tenth", "eleventh", "twelfth"]

# Greetings repeat on purpose: real chat logs are full of identical "Hello!" turns.
_HELLO_USER = ["hi", "hello", "Hello!", "Hi there", "hey", "Hi!", "Good morning", "Hello"]
_HELLO_BOT = ["Hello! How can I help you today?", "Hi there! What can I do for you?", "Hello!",
              "Hi! How can I help?", "Hello! What would you like to know?"]
_THANKS_USER = ["thanks", "thank you", "Thanks!", "great, thanks", "Thank you very much."]
_THANKS_BOT = ["You're welcome!", "Happy to help.", "You're welcome. Anything else?",
               "Glad I could help!", "Anytime!"]
_SMALL_TALK = _table("""
How are you?|I'm doing well, thanks for asking. How can I help you today?
how are you doing today|Pretty good, thank you! What can I do for you?
What can you do?|I can answer questions, do quick math, convert units, explain words and help rewrite short texts.
Can you help me?|Of course. What do you need help with?
What's your name?|I'm an AI assistant. I don't have a personal name, but I'm happy to help.
ok|Great. Let me know if you need anything else.
bye|Goodbye! Have a great day.
Good night|Good night! Sleep well.
""")
_SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a knowledgeable assistant.",
    "You are a friendly tutor who explains things simply and double-checks every fact and number "
    "before answering.",
    "Answer the user's question accurately and politely. If you are not sure about something, "
    "say so instead of guessing.",
    "You are a helpful, honest and harmless AI assistant. Give correct answers, keep them short, "
    "and show the working for any calculation.",
    "You are a patient teacher helping students with math, language and geography. Give clear "
    "answers, and add a short explanation when it helps the student learn.",
    "You are a chat assistant on a learning website for adults. Be warm and encouraging, use "
    "plain English, and avoid long lists unless the user asks for one.",
]
# Context the user sometimes types before the question; real prompts are rarely bare.
_PREFIXES = ["Quick question: ", "Hey, ", "I'm helping my son with his homework. ",
             "I always forget this one. ", "Settle a bet for me. ", "Sorry if this is basic, but ",
             "I'm studying for a quiz tomorrow and want to check something. "]


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
    user = rng.choice([f"What is {a} {word} {b}?", f"What's {a} {op} {b}?",
                       f"Calculate {a} {op} {b}.", f"{a} {op} {b} = ?", f"{a}{op}{b}"])
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
        full += (f" Add the tens, {ta} + {tb} = {ta + tb}, then the ones, {a % 10} + {b % 10} = "
                 f"{a % 10 + b % 10}, and {ta + tb} + {a % 10 + b % 10} = {r}.")
    c = rng.randint(2, 9)
    follow = rng.choice([(f"And if you add {c} to that?", f"{r} + {c} = {r + c}."),
                         (f"Now multiply that by {c}.", f"{r} x {c} = {r * c}.")])
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
        full = (f"Multiply by 9/5 and add 32: {c} x 9/5 = {c * 9 // 5}, plus 32 is {f}. "
                f"So {c} degrees Celsius is {f} degrees Fahrenheit.")
        return [(user, _pick(rng, f"{f} degrees Fahrenheit.", full))]
    one, big, small, factor = rng.choice(_UNITS)
    factor, v = int(factor), rng.randint(2, 12)
    why = f"There are {factor} {small} in {one}"
    if rng.random() < 0.6:
        user = rng.choice([f"How many {small} are in {v} {big}?", f"Convert {v} {big} to {small}."])
        full = f"{why}, so {v} {big} is {v} x {factor} = {v * factor} {small}."
        return [(user, _pick(rng, f"{v * factor} {small}.", full))]
    user = rng.choice([f"How many {big} is {v * factor} {small}?",
                       f"Convert {v * factor} {small} to {big}."])
    full = f"{why}, so {v * factor} {small} is {v * factor} / {factor} = {v} {big}."
    return [(user, _pick(rng, f"{v} {big}.", full))]


def _geography(rng):
    """Capital cities, with a "what about X?" follow-up on a second country."""
    (country, city, continent), (c2, city2, _) = rng.sample(_CAPITALS, 2)
    user = rng.choice([f"What is the capital of {country}?", f"Capital of {country}?",
                       f"Which city is the capital of {country}?", f"capital of {country}"])
    full = f"The capital of {country} is {_end(city)} {_cap(country)} is in {continent}."
    follow = (f"What about {c2}?", _pick(rng, _end(city2), f"The capital of {c2} is {_end(city2)}"))
    return [(user, _pick(rng, _end(city), full)), follow]


def _fact(rng):
    """Fixed science and general-knowledge facts that are not in dispute."""
    question, short, full = rng.choice(_FACTS)
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
        (country, city, _), (_, other, _) = rng.sample(_CAPITALS, 2)
        guess = rng.choice([city, other])
        full = (f"Yes, {city} is the capital of {country}." if guess == city
                else f"No, the capital of {country} is {_end(city)}")
        user = f"Is {guess} the capital of {country}?"
        return [(user, _pick(rng, "Yes." if guess == city else "No.", full))]
    question, ans, why = rng.choice(_YES_NO)
    return [(question, _pick(rng, ans + ".", f"{ans}, {why}"))]


def _translation(rng):
    """Single words into Spanish, French or German, with an "and in X?" follow-up."""
    row = rng.choice(_TRANSLATIONS)
    lang, lang2 = rng.sample(range(3), 2)
    word, target, target2 = row[0], row[1 + lang], row[1 + lang2]
    name = _LANGUAGES[lang]
    user = rng.choice([f"How do you say '{word}' in {name}?", f"Translate '{word}' to {name}.",
                       f"{word} in {name}?"])
    full = f"'{_cap(word)}' in {name} is '{target}'."
    follow = (f"And in {_LANGUAGES[lang2]}?", f"In {_LANGUAGES[lang2]} it is '{target2}'.")
    return [(user, _pick(rng, _cap(target) + ".", full)), follow]


def _definition(rng):
    """Short definitions written for this file."""
    article, word, meaning, example = rng.choice(_DEFINITIONS)
    term = f"{article} {word}".strip()
    user = rng.choice([f"What is {term}?", f"Define {word}.", f"What does '{word}' mean?"])
    answer = f"{_cap(term)} is {meaning}"
    return [(user, _pick(rng, answer, f"{answer} For example: {example}", p_short=0.4))]


def _howto(rng):
    """Numbered how-to steps, the longest single replies in the file."""
    task, *steps = rng.choice(_HOWTO)
    user = rng.choice([f"How do I {task}?", f"How to {task}?", f"Give me steps to {task}."])
    body = "\n".join(f"{i}. {step}" for i, step in enumerate(steps, 1))
    return [(user, rng.choice(["", "Here's how:\n", "Sure:\n"]) + body)]


def _list_items(rng):
    """Name k members of a category, as an inline sentence, bullets or numbers."""
    name, *items = rng.choice(_CATEGORIES)
    k = rng.randint(2, 5)
    picked = rng.sample(items, k)
    user = rng.choice([f"Name {_NUMBER_WORDS[k]} {name}.", f"List {_NUMBER_WORDS[k]} {name}.",
                       f"Give me {_NUMBER_WORDS[k]} {name}, please."])
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
        pool = [row[0] for row in _TRANSLATIONS if " " not in row[0]]
        words = rng.sample(pool, rng.randint(3, 5))
        return [("Put these words in alphabetical order: " + ", ".join(words),
                 ", ".join(sorted(words)) + ".")]
    if kind == 2:
        i = rng.randrange(7)
        nxt = _DAYS[(i + 1) % 7]
        full = f"{nxt} comes after {_DAYS[i]}."
        return [(f"What day comes after {_DAYS[i]}?", _pick(rng, nxt + ".", full))]
    i = rng.randrange(12)
    return [(f"What is the {_ORDINALS[i]} month of the year?",
             _pick(rng, _MONTHS[i] + ".", f"The {_ORDINALS[i]} month is {_MONTHS[i]}."))]


def _explain(rng):
    """Why/how questions with a few sentences of answer."""
    return [rng.choice(_EXPLAIN)]


def _compose(rng):
    """Write a short personal message from an opening, 1-2 body sentences and a sign-off."""
    occasion, opening, *rest = rng.choice(_MESSAGES)
    to, sender = rng.sample(_NAMES, 2)
    body = [opening] + sorted(rng.sample(rest, rng.randint(1, 2)), key=rest.index)
    user = rng.choice([f"Write {to} a short {occasion}.",
                       f"Can you write {to} a {occasion}? Sign it from {sender}."])
    sign = sender if "Sign it" in user else "[Your name]"
    greeting = rng.choice([f"Dear {to},", f"Hi {to},", f"{to},"])
    closing = rng.choice(["Best wishes,", "Warmly,", "Take care,", "Cheers,"])
    return [(user, f"{greeting}\n\n{' '.join(body)}\n\n{closing}\n{sign}")]


def _letters(rng):
    """Letter counts, spelled out so the count can be checked by eye."""
    word = rng.choice(_WORDS)
    spelled = "-".join(word)
    if rng.random() < 0.3:
        full = f"'{word}' is spelled {spelled}, so it has {len(word)} letters."
        return [(f"How many letters are in the word '{word}'?", _pick(rng, f"{len(word)}.", full))]
    # A few letters that never occur teach the answer "zero" instead of always "at least one".
    letter = rng.choice(word) if rng.random() < 0.9 else rng.choice("qxzj")
    n = word.count(letter)
    user = rng.choice([f"How many times does the letter '{letter}' appear in '{word}'?",
                       f"How many {letter}'s are in {word}?"])
    times = "once" if n == 1 else f"{n} times"
    full = (f"Spelled out, '{word}' is {spelled}. The letter '{letter}' appears {times}." if n
            else f"The letter '{letter}' does not appear in '{word}'.")
    return [(user, _pick(rng, f"{n}.", full))]


def _rewrite(rng):
    """Rewrite a sentence: polite form, past tense, upper case, or count its words."""
    kind = rng.randrange(4)
    if kind == 0:
        req = rng.choice(_REQUESTS)
        return [(f"Make this more polite: {_cap(req)}.", f"Could you please {req}?")]
    subject = rng.choice(_SUBJECTS)
    present, past, rest = rng.choice(_VERBS)
    sentence = f"{subject} {present} {rest}."
    if kind == 1:
        return [(f"Rewrite in the past tense: {sentence}", f"{subject} {past} {rest}.")]
    if kind == 2:
        return [(f"Rewrite this in capital letters: {sentence}", sentence.upper())]
    n = len(sentence.split())
    return [(f"How many words are in this sentence? {sentence}",
             _pick(rng, f"{n}.", f"The sentence has {n} words."))]


def _small_talk(rng):
    """Polite chit-chat that needs no facts."""
    return [rng.choice(_SMALL_TALK)]


# (topic, weight): checkable topics weigh more because they are what a demo model can get right.
_TOPICS = [(_arithmetic, 3), (_word_problem, 1), (_conversion, 2), (_geography, 3), (_fact, 2),
           (_yes_no, 2), (_translation, 2), (_definition, 2), (_howto, 2), (_list_items, 2),
           (_ordering, 1), (_letters, 2), (_rewrite, 2), (_small_talk, 1), (_explain, 4),
           (_compose, 3)]


def _topic(rng):
    """One topic's exchanges: the main (user, assistant) pair, then optional follow-ups."""
    fns, weights = zip(*_TOPICS)
    (user, assistant), *follow = rng.choices(fns, weights)[0](rng)
    if user.endswith("?") and rng.random() < 0.3:
        prefix = rng.choice(_PREFIXES)
        user = prefix + (user if prefix.endswith(". ") else user[:1].lower() + user[1:])
    return [(user, assistant)] + follow


def _turns(rng):
    """Pick a dialogue shape: mostly one exchange, sometimes 2-4 with greetings and thanks."""
    hello = (rng.choice(_HELLO_USER), rng.choice(_HELLO_BOT))
    thanks = (rng.choice(_THANKS_USER), rng.choice(_THANKS_BOT))
    shape = rng.random()
    if shape < 0.07:
        return [hello]  # a bare greeting is a whole dialogue surprisingly often
    exchanges = _topic(rng)
    if shape < 0.54:
        return exchanges[:1]
    turns = exchanges[: rng.randint(1, len(exchanges))]
    while len(turns) < 3 and rng.random() < 0.6:
        turns += _topic(rng)[:1]
    if rng.random() < 0.4:
        turns.insert(0, hello)
    if len(turns) < 2 or rng.random() < 0.4:
        turns.append(thanks)
    return turns[:4]


def _system(rng):
    """System message: absent, present but empty, or a real prompt (all three occur in the wild)."""
    r = rng.random()
    if r < 0.3:
        return []
    content = "" if r < 0.45 else rng.choice(_SYSTEM_PROMPTS)
    return [{"role": "system", "content": content}]


def dialogue_words(dialogue):
    """Count whitespace-separated words over all messages of one dialogue.

    Args:
        dialogue: A record ``{"messages": [{"role": ..., "content": ...}, ...]}``.

    Returns:
        The total number of words, system prompt included.
    """
    return sum(len(m["content"].split()) for m in dialogue["messages"])


def _dialogue(rng):
    """Build one dialogue, redrawing until it fits the ~150-token budget."""
    while True:
        messages = _system(rng)
        for user, assistant in _turns(rng):
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": assistant})
        dialogue = {"messages": messages}
        if dialogue_words(dialogue) <= MAX_WORDS:
            return dialogue


def generate_dialogues(n=2400, seed=0):
    """Generate ``n`` short chat dialogues, identical for identical ``(n, seed)``.

    Args:
        n: Number of dialogues.
        seed: Seed of the private ``random.Random``; the global RNG is never touched.

    Returns:
        A list of ``{"messages": [...]}`` records in OpenAI chat format: an optional system
        message, then user/assistant turns that alternate and end with the assistant.
    """
    rng = random.Random(seed)
    return [_dialogue(rng) for _ in range(n)]


def to_jsonl(dialogues):
    """Serialise dialogues as JSON Lines, one dialogue per ``\\n``-terminated line.

    Key order is the insertion order (``messages``; ``role`` before ``content``) and
    ``ensure_ascii=False`` keeps text readable, so the bytes are stable across runs.

    Args:
        dialogues: Records as returned by :func:`generate_dialogues`.

    Returns:
        The file contents as one string.
    """
    return "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in dialogues)


def write_jsonl(dialogues, path):
    """Write dialogues to ``path`` as UTF-8 JSON Lines with ``\\n`` line endings.

    Args:
        dialogues: Records as returned by :func:`generate_dialogues`.
        path: Output file path; parent folders must exist.
    """
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(to_jsonl(dialogues))
