"""Fact and phrasing tables for ``tools.sample_data.dialogues`` (content only, no logic).

Every row is written for this project; answers that can be computed are computed in
``dialogues`` and ``topics``, so these tables hold only settled facts and phrasings.
"""


def _table(spec):
    """Parse one row per line, fields split by ``|``; keeps the fact tables compact."""
    return [tuple(f.strip() for f in line.split("|")) for line in spec.strip().splitlines()]


# "country=capital" pairs by continent; the article lives in the name ("the Netherlands").
CAPITALS = [
    (country, city, continent)
    for continent, spec in {
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
    }.items()
    for country, city in (pair.split("=") for pair in spec.split("; "))
]

# question | short answer | full answer
FACTS = _table("""
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
YES_NO = _table("""
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
TRANSLATIONS = _table("""
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
LANGUAGES = ["Spanish", "French", "German"]

# article | word | definition | example (no article for mass nouns: "What is gravity?")
DEFINITIONS = _table("""
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
EXPLAIN = _table("""
Why is the sky blue?|Sunlight contains every color. Air molecules scatter short blue wavelengths much more strongly than long red ones, so blue light reaches your eyes from all over the sky. At sunset the light crosses more air, more blue is scattered away, and the sky turns orange and red.
Why do we have seasons?|Earth's axis is tilted about 23.5 degrees. As Earth orbits the sun, each hemisphere takes turns leaning toward it. The half tilted toward the sun gets more direct light and longer days, so it has summer while the other half has winter. Distance from the sun is not the cause.
What causes ocean tides?|Mostly the moon's gravity. It pulls the oceans into a bulge on the side of Earth facing the moon and another on the opposite side. As Earth turns through these bulges, most coasts get two high tides and two low tides a day. The sun adds a smaller effect.
How does a rainbow form?|Sunlight enters raindrops, bends, reflects off the back of each drop and bends again on the way out. Each color bends by a slightly different amount, so white light spreads into red, orange, yellow, green, blue, indigo and violet. You see a rainbow with the sun behind you.
Why does ice float?|Water expands when it freezes: its molecules lock into an open crystal pattern that takes more space, so ice is about 9 percent less dense than liquid water. Anything less dense than the liquid around it floats. That is why lakes freeze from the top down.
Why do leaves change color in autumn?|Leaves are green because of chlorophyll, which captures sunlight. Shorter, cooler days make trees stop producing it. As the green fades, yellow and orange pigments that were there all along show through, and some trees also make new red pigments.
What is the difference between weather and climate?|Weather is what the air is doing now or over a few days: rain, wind, sun and temperature. Climate is the usual pattern of weather in a place over many years, typically 30 or more. A cold day is weather; cold winters every year are climate.
""")

# occasion | opening sentence | further sentences (a message keeps the opening, then 1-2 of these)
MESSAGES = _table("""
birthday message|Happy birthday!|I hope your day is full of laughter and good food.|Wishing you a wonderful year ahead.|Thank you for being such a great friend.
thank-you note|Thank you so much for your help this week.|I really appreciated your time and patience.|It made a big difference to me.|Next coffee is on me.
get-well message|I was sorry to hear you are not feeling well.|Take all the time you need to rest.|I am thinking of you and hope you feel better soon.
note congratulating them on a new job|Congratulations on the new job!|They are lucky to have you.|I know you will do great things there.|Let's celebrate soon.
good-luck message for an exam|Good luck on your exam tomorrow!|You have prepared well, so trust yourself.|Get a good night's sleep and take it one question at a time.
""")
NAMES = ["Anna", "Tom", "Maria", "David", "Priya", "Sam", "Lena", "Omar"]

# task | steps...
HOWTO = _table("""
make a cup of tea|Boil fresh water.|Put a tea bag in a cup.|Pour the hot water over it.|Let it steep for three to five minutes, then remove the bag.
boil an egg|Put the egg in a pot and cover it with cold water.|Bring the water to a boil.|Simmer about 6 minutes for a soft yolk or 10 for a firm one.|Cool the egg in cold water before peeling.
wash your hands properly|Wet your hands with clean water.|Lather with soap, including between your fingers.|Scrub for at least 20 seconds.|Rinse and dry with a clean towel.
plant a seed|Fill a small pot with moist soil.|Press the seed in about twice as deep as it is wide.|Cover it lightly.|Keep the soil damp and the pot in a warm, bright spot.
write a thank-you note|Greet the person by name.|Thank them for the specific gift or help.|Say what it meant to you.|Sign off warmly.
prepare for a job interview|Research the company and the role.|Practice answers to common questions.|Prepare two questions to ask.|Plan your route the day before.
save money each month|Track your spending for a month.|Set a limit for each category.|Move a fixed amount to savings on payday.
""")

# category | items... (a model should list real members, so every item is a clear member)
CATEGORIES = _table("""
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
VERBS = _table("""
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
SUBJECTS = ["She", "He", "My brother", "The teacher", "Our neighbor", "Anna", "Tom"]
REQUESTS = [
    "send me the file",
    "close the door",
    "call me back later",
    "check these numbers",
    "turn down the music",
    "book a table for two",
    "review my draft",
    "wait a moment",
]
WORDS = [
    "banana",
    "strawberry",
    "elephant",
    "mississippi",
    "committee",
    "bookkeeper",
    "apple",
    "necessary",
    "rhythm",
    "balloon",
    "library",
    "computer",
    "umbrella",
    "giraffe",
    "pepper",
    "success",
    "coffee",
    "parallel",
    "tomorrow",
    "address",
    "happiness",
    "level",
]
UNITS = _table("""
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
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
ORDINALS = [
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
]

# Greetings repeat on purpose: real chat logs are full of identical "Hello!" turns.
HELLO_USER = ["hi", "hello", "Hello!", "Hi there", "hey", "Hi!", "Good morning", "Hello"]
HELLO_BOT = [
    "Hello! How can I help you today?",
    "Hi there! What can I do for you?",
    "Hello!",
    "Hi! How can I help?",
    "Hello! What would you like to know?",
]
THANKS_USER = ["thanks", "thank you", "Thanks!", "great, thanks", "Thank you very much."]
THANKS_BOT = [
    "You're welcome!",
    "Happy to help.",
    "You're welcome. Anything else?",
    "Glad I could help!",
    "Anytime!",
]
SMALL_TALK = _table("""
How are you?|I'm doing well, thanks for asking. How can I help you today?
how are you doing today|Pretty good, thank you! What can I do for you?
What can you do?|I can answer questions, do quick math, convert units, explain words and help rewrite short texts.
Can you help me?|Of course. What do you need help with?
What's your name?|I'm an AI assistant. I don't have a personal name, but I'm happy to help.
ok|Great. Let me know if you need anything else.
bye|Goodbye! Have a great day.
Good night|Good night! Sleep well.
""")
SYSTEM_PROMPTS = [
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
PREFIXES = [
    "Quick question: ",
    "Hey, ",
    "I'm helping my son with his homework. ",
    "I always forget this one. ",
    "Settle a bet for me. ",
    "Sorry if this is basic, but ",
    "I'm studying for a quiz tomorrow and want to check something. ",
]
