"""Synthetic text-to-SQL task: schema vocabularies, query shapes and the record builder."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from vllm_specstream.training.tasks._english import articled
from vllm_specstream.training.tasks._split import draw, normalise_key

# =========================================================================== SQL schemas

#: Value pools for string columns, keyed by kind.
_FIRST = (
    "John",
    "Maria",
    "Wei",
    "Aisha",
    "Carlos",
    "Emma",
    "Liam",
    "Sofia",
    "Yuki",
    "Omar",
    "Anna",
    "David",
    "Priya",
    "Lucas",
    "Fatima",
    "Noah",
    "Chloe",
    "Ivan",
    "Mei",
    "Diego",
    "Grace",
    "Hans",
    "Leila",
    "Mateo",
    "Olivia",
    "Ravi",
    "Sara",
    "Tom",
    "Zara",
    "Kenji",
)
_LAST = (
    "Smith",
    "Garcia",
    "Chen",
    "Khan",
    "Silva",
    "Brown",
    "Muller",
    "Rossi",
    "Tanaka",
    "Ali",
    "Novak",
    "Kim",
    "Patel",
    "Martin",
    "Lopez",
    "Wilson",
    "Dubois",
    "Ivanov",
    "Wang",
    "Costa",
    "Jones",
    "Schmidt",
    "Haddad",
    "Moreno",
    "Taylor",
    "Singh",
    "Berg",
    "Clark",
    "Ahmed",
    "Sato",
)
_ADJ = (
    "Silent",
    "Golden",
    "Crimson",
    "Hidden",
    "Broken",
    "Electric",
    "Frozen",
    "Wild",
    "Lost",
    "Midnight",
    "Iron",
    "Velvet",
    "Rising",
    "Endless",
    "Quiet",
    "Burning",
    "Paper",
    "Lucky",
    "Northern",
    "Hollow",
)
_NOUN = (
    "River",
    "Empire",
    "Garden",
    "Storm",
    "Echo",
    "Horizon",
    "Dream",
    "Tower",
    "Harbor",
    "Shadow",
    "Forest",
    "Signal",
    "Crown",
    "Voyage",
    "Mirror",
    "Circuit",
    "Legend",
    "Orbit",
    "Canyon",
    "Lantern",
)
_COMPANIES = (
    "Acme Corp",
    "Globex",
    "Initech",
    "Umbrella",
    "Stark Industries",
    "Wayne Enterprises",
    "Hooli",
    "Vandelay",
    "Soylent",
    "Cyberdyne",
    "Tyrell",
    "Wonka",
    "Massive Dynamic",
    "Aperture",
    "Oscorp",
    "Pied Piper",
    "Blue Sun",
    "Gringotts",
    "Monarch",
    "Nakatomi",
)
_POOLS: dict[str, tuple[str, ...]] = {
    "city": (
        "Paris",
        "London",
        "Tokyo",
        "Berlin",
        "Madrid",
        "Rome",
        "Toronto",
        "Sydney",
        "Cairo",
        "Mumbai",
        "Seoul",
        "Lima",
        "Oslo",
        "Dublin",
        "Chicago",
        "Boston",
        "Austin",
        "Denver",
        "Lagos",
        "Nairobi",
        "Lisbon",
        "Vienna",
        "Prague",
        "Istanbul",
        "Bangkok",
        "Manila",
        "Santiago",
        "Bogota",
        "Helsinki",
        "Warsaw",
    ),
    "country": (
        "France",
        "Japan",
        "Brazil",
        "Canada",
        "Germany",
        "India",
        "Mexico",
        "Italy",
        "Spain",
        "Kenya",
        "Egypt",
        "Norway",
        "Chile",
        "Peru",
        "Poland",
        "Sweden",
        "Australia",
        "Nigeria",
        "Vietnam",
        "Turkey",
        "Ireland",
        "Portugal",
        "Greece",
    ),
    "department": (
        "Sales",
        "Marketing",
        "Finance",
        "Engineering",
        "Research",
        "Legal",
        "Support",
        "Operations",
        "Design",
        "Security",
        "Logistics",
        "Human Resources",
    ),
    "job_title": (
        "Manager",
        "Engineer",
        "Analyst",
        "Clerk",
        "Director",
        "Intern",
        "Designer",
        "Accountant",
        "Consultant",
        "Technician",
        "Architect",
        "Specialist",
    ),
    "order_status": ("Pending", "Shipped", "Delivered", "Cancelled", "Returned", "Processing"),
    "category": (
        "Electronics",
        "Toys",
        "Books",
        "Garden",
        "Kitchen",
        "Sports",
        "Clothing",
        "Beauty",
        "Office",
        "Automotive",
        "Grocery",
        "Furniture",
    ),
    "color": ("Red", "Blue", "Green", "Black", "White", "Silver", "Yellow", "Purple", "Orange"),
    "major": (
        "Biology",
        "History",
        "Physics",
        "Economics",
        "Mathematics",
        "Chemistry",
        "Philosophy",
        "Computer Science",
        "Art",
        "Music",
        "Linguistics",
        "Psychology",
    ),
    "airline": (
        "Air France",
        "Lufthansa",
        "Delta",
        "Emirates",
        "Qantas",
        "KLM",
        "Iberia",
        "United",
        "Aeroflot",
        "Ryanair",
        "Air Canada",
        "LATAM",
    ),
    "game_genre": (
        "Action",
        "Puzzle",
        "Strategy",
        "Racing",
        "Adventure",
        "Shooter",
        "Platformer",
        "Simulation",
        "Fighting",
        "Sports",
    ),
    "platform": ("PC", "PlayStation", "Xbox", "Switch", "Mobile", "Arcade"),
    "music_genre": (
        "Rock",
        "Jazz",
        "Pop",
        "Classical",
        "Hip Hop",
        "Blues",
        "Folk",
        "Metal",
        "Reggae",
        "Country",
        "Electronic",
        "Soul",
    ),
    "specialty": (
        "Cardiology",
        "Neurology",
        "Pediatrics",
        "Oncology",
        "Surgery",
        "Radiology",
        "Dermatology",
        "Psychiatry",
        "Orthopedics",
    ),
    "movie_genre": (
        "Drama",
        "Comedy",
        "Horror",
        "Thriller",
        "Romance",
        "Documentary",
        "Animation",
        "Western",
        "Science Fiction",
        "Fantasy",
    ),
    "book_genre": (
        "Mystery",
        "Biography",
        "Poetry",
        "Fantasy",
        "History",
        "Romance",
        "Travel",
        "Science",
        "Cooking",
        "Horror",
    ),
    "position": (
        "Goalkeeper",
        "Defender",
        "Midfielder",
        "Forward",
        "Guard",
        "Center",
        "Pitcher",
        "Catcher",
    ),
    "make": ("Toyota", "Ford", "Honda", "BMW", "Fiat", "Volvo", "Kia", "Audi", "Tesla", "Mazda"),
    "fuel": ("Petrol", "Diesel", "Electric", "Hybrid"),
    "cuisine": (
        "Italian",
        "Thai",
        "Mexican",
        "Indian",
        "French",
        "Greek",
        "Korean",
        "Ethiopian",
        "Lebanese",
        "Spanish",
        "Vietnamese",
    ),
    "price_range": ("Budget", "Moderate", "Expensive"),
    "semester": ("Fall", "Spring", "Summer", "Winter"),
    "stadium": (
        "Olympic Park",
        "River Arena",
        "Central Field",
        "Lakeside Stadium",
        "Victory Ground",
        "North Dome",
        "Harbor Park",
    ),
    "hospital": (
        "St Mary",
        "General",
        "Mercy",
        "City Central",
        "Riverside",
        "Northwood",
        "Good Samaritan",
        "Royal Infirmary",
        "Hillcrest",
    ),
    "team": (
        "Lions",
        "Eagles",
        "Sharks",
        "Rovers",
        "United",
        "Wanderers",
        "Tigers",
        "Falcons",
        "Rangers",
        "Comets",
        "Titans",
        "Wolves",
    ),
    "code": tuple(
        f"{a}{b}"
        for a in ("AA", "BA", "LH", "AF", "DL", "EK", "QF")
        for b in ("101", "202", "317", "450", "588", "726", "904")
    ),
}


def _value(kind: str, rng: random.Random) -> str | int | float:
    """A random value for a column of ``kind``: ``int:lo:hi[:step]``, ``real:lo:hi``,
    ``date``, ``person``, ``title``, ``company`` or a pool name."""
    head, *args = kind.split(":")
    if head == "int":
        lo, hi, *step = (int(a) for a in args)
        return rng.randrange(lo, hi + 1, step[0] if step else 1)
    if head == "real":
        return round(rng.uniform(float(args[0]), float(args[1])), 1)
    if head == "date":
        return f"{rng.randint(1990, 2023)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if head == "person":
        return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    if head == "title":
        return f"{rng.choice(_ADJ)} {rng.choice(_NOUN)}"
    if head == "company":
        return rng.choice(_COMPANIES)
    return rng.choice(_POOLS[head])


@dataclass(frozen=True)
class Column:
    """A column a table of an entity may have: SQL type and how to draw its values."""

    name: str
    sql_type: str
    kind: str

    @property
    def numeric(self) -> bool:
        return self.sql_type in ("INTEGER", "REAL")

    @property
    def phrase(self) -> str:
        return self.name.replace("_", " ")


@dataclass(frozen=True)
class Entity:
    """A kind of row (employee, flight, ...) with the table names and columns it may use."""

    singular: str
    plural: str
    tables: tuple[str, ...]
    columns: tuple[Column, ...]


def _cols(spec: str) -> tuple[Column, ...]:
    """Parse ``"name TYPE kind, ..."`` into columns (keeps the vocabulary below compact)."""
    return tuple(Column(*part.split()) for part in spec.split(", "))


ENTITIES: dict[str, Entity] = {
    e.plural: e
    for e in (
        Entity(
            "employee",
            "employees",
            ("employees", "employee", "staff", "workers"),
            _cols(
                "name VARCHAR person, salary INTEGER int:20000:150000:500, age INTEGER int:18:67, "
                "city VARCHAR city, department VARCHAR department, hire_date DATE date, "
                "title VARCHAR job_title, bonus REAL real:0:9000, years_employed INTEGER int:0:40"
            ),
        ),
        Entity(
            "department",
            "departments",
            ("departments", "department", "divisions"),
            _cols(
                "department_name VARCHAR department, budget INTEGER int:10000:900000:1000, "
                "location VARCHAR city, head VARCHAR person, num_employees INTEGER int:3:400, "
                "founded_year INTEGER int:1950:2020"
            ),
        ),
        Entity(
            "order",
            "orders",
            ("orders", "purchases", "sales_orders"),
            _cols(
                "customer_name VARCHAR person, order_date DATE date, status VARCHAR order_status, "
                "total_amount REAL real:5:2500, quantity INTEGER int:1:500, "
                "shipping_city VARCHAR city, product_name VARCHAR title, discount REAL real:0:50"
            ),
        ),
        Entity(
            "customer",
            "customers",
            ("customers", "clients", "customer"),
            _cols(
                "customer_name VARCHAR person, city VARCHAR city, "
                "country TEXT country, signup_date DATE date, loyalty_points INTEGER int:0:10000, "
                "age INTEGER int:18:90"
            ),
        ),
        Entity(
            "product",
            "products",
            ("products", "product", "items", "inventory"),
            _cols(
                "product_name VARCHAR title, category VARCHAR category, price REAL real:1:999, "
                "stock INTEGER int:0:5000, supplier VARCHAR company, weight REAL real:0.1:80, "
                "color VARCHAR color, launch_date DATE date, rating REAL real:1:5"
            ),
        ),
        Entity(
            "supplier",
            "suppliers",
            ("suppliers", "vendors"),
            _cols(
                "supplier_name VARCHAR company, country VARCHAR country, rating REAL real:1:5, "
                "contract_year INTEGER int:1995:2023, city VARCHAR city"
            ),
        ),
        Entity(
            "student",
            "students",
            ("students", "student", "pupils", "enrollments"),
            _cols(
                "student_name VARCHAR person, age INTEGER int:16:40, major VARCHAR major, "
                "gpa REAL real:1.5:4, enrollment_year INTEGER int:2000:2023, hometown VARCHAR city, "
                "advisor VARCHAR person, credits INTEGER int:0:180"
            ),
        ),
        Entity(
            "course",
            "courses",
            ("courses", "course", "classes"),
            _cols(
                "course_name VARCHAR major, instructor VARCHAR person, credits INTEGER int:1:6, "
                "capacity INTEGER int:10:300, semester VARCHAR semester, room_number INTEGER int:100:499"
            ),
        ),
        Entity(
            "flight",
            "flights",
            ("flights", "flight", "routes"),
            _cols(
                "flight_number VARCHAR code, origin VARCHAR city, destination VARCHAR city, "
                "airline VARCHAR airline, departure_date DATE date, distance INTEGER int:150:15000, "
                "price REAL real:40:3000, duration INTEGER int:30:1100, seats INTEGER int:50:500"
            ),
        ),
        Entity(
            "airline",
            "airlines",
            ("airlines", "airline", "carriers"),
            _cols(
                "airline_name VARCHAR airline, country VARCHAR country, founded_year INTEGER int:1920:2015, "
                "fleet_size INTEGER int:5:900, hub_city VARCHAR city"
            ),
        ),
        Entity(
            "game",
            "games",
            ("games", "game", "video_games"),
            _cols(
                "title VARCHAR title, genre VARCHAR game_genre, platform VARCHAR platform, "
                "release_year INTEGER int:1980:2023, publisher VARCHAR company, score REAL real:1:10, "
                "sales INTEGER int:1000:9000000:1000, price REAL real:0:80"
            ),
        ),
        Entity(
            "publisher",
            "publishers",
            ("publishers", "publisher", "studios"),
            _cols(
                "publisher_name VARCHAR company, country VARCHAR country, "
                "founded_year INTEGER int:1900:2020, num_titles INTEGER int:1:800"
            ),
        ),
        Entity(
            "song",
            "songs",
            ("songs", "song", "tracks", "music"),
            _cols(
                "title VARCHAR title, artist VARCHAR person, genre VARCHAR music_genre, "
                "release_year INTEGER int:1950:2023, duration INTEGER int:60:900, "
                "plays INTEGER int:0:5000000, album TEXT title, label VARCHAR company"
            ),
        ),
        Entity(
            "artist",
            "artists",
            ("artists", "artist", "musicians", "singers"),
            _cols(
                "artist_name VARCHAR person, country VARCHAR country, genre VARCHAR music_genre, "
                "debut_year INTEGER int:1950:2022, age INTEGER int:16:90"
            ),
        ),
        Entity(
            "hospital",
            "hospitals",
            ("hospitals", "hospital", "clinics"),
            _cols(
                "hospital_name VARCHAR hospital, city VARCHAR city, beds INTEGER int:20:2000, "
                "founded_year INTEGER int:1850:2020, director VARCHAR person, rating REAL real:1:5, "
                "country VARCHAR country"
            ),
        ),
        Entity(
            "doctor",
            "doctors",
            ("doctors", "doctor", "physicians"),
            _cols(
                "name VARCHAR person, specialty VARCHAR specialty, years_experience INTEGER int:0:45, "
                "salary INTEGER int:60000:400000:1000, age INTEGER int:26:75, city VARCHAR city"
            ),
        ),
        Entity(
            "movie",
            "movies",
            ("movies", "movie", "films", "film"),
            _cols(
                "title VARCHAR title, director VARCHAR person, genre VARCHAR movie_genre, "
                "release_year INTEGER int:1920:2023, budget INTEGER int:100000:300000000:100000, "
                "gross INTEGER int:0:900000000:100000, rating REAL real:1:10, runtime INTEGER int:60:240, "
                "country VARCHAR country"
            ),
        ),
        Entity(
            "director",
            "directors",
            ("directors", "director", "filmmakers"),
            _cols(
                "name VARCHAR person, nationality VARCHAR country, birth_year INTEGER int:1900:2000, "
                "awards INTEGER int:0:40"
            ),
        ),
        Entity(
            "book",
            "books",
            ("books", "book", "titles"),
            _cols(
                "title TEXT title, author VARCHAR person, genre VARCHAR book_genre, "
                "pages INTEGER int:40:1500, publication_year INTEGER int:1800:2023, "
                "publisher VARCHAR company, price REAL real:2:90"
            ),
        ),
        Entity(
            "author",
            "authors",
            ("authors", "author", "writers"),
            _cols(
                "author_name VARCHAR person, nationality VARCHAR country, birth_year INTEGER int:1800:2000, "
                "num_books INTEGER int:1:120"
            ),
        ),
        Entity(
            "player",
            "players",
            ("players", "player", "athletes", "roster"),
            _cols(
                "name VARCHAR person, position VARCHAR position, age INTEGER int:16:42, "
                "height REAL real:1.5:2.2, goals INTEGER int:0:400, nationality VARCHAR country, "
                "salary INTEGER int:30000:9000000:10000, games_played INTEGER int:0:900"
            ),
        ),
        Entity(
            "team",
            "teams",
            ("teams", "team", "clubs"),
            _cols(
                "team_name VARCHAR team, city VARCHAR city, founded_year INTEGER int:1870:2015, "
                "stadium VARCHAR stadium, wins INTEGER int:0:100, losses INTEGER int:0:100"
            ),
        ),
        Entity(
            "car",
            "cars",
            ("cars", "car", "vehicles"),
            _cols(
                "make VARCHAR make, model VARCHAR title, year INTEGER int:1970:2024, "
                "price REAL real:1000:90000, mileage INTEGER int:0:300000:100, color VARCHAR color, "
                "fuel_type VARCHAR fuel"
            ),
        ),
        Entity(
            "restaurant",
            "restaurants",
            ("restaurants", "restaurant", "eateries"),
            _cols(
                "name VARCHAR title, cuisine TEXT cuisine, city VARCHAR city, rating REAL real:1:5, "
                "price_range VARCHAR price_range, seats INTEGER int:10:400, "
                "opened_year INTEGER int:1950:2023"
            ),
        ),
    )
}

#: Joinable pairs (child, parent, key): ``child.key = parent.key``.
JOINS = (
    ("employees", "departments", "department_id"),
    ("orders", "customers", "customer_id"),
    ("products", "suppliers", "supplier_id"),
    ("students", "courses", "course_id"),
    ("flights", "airlines", "airline_id"),
    ("games", "publishers", "publisher_id"),
    ("songs", "artists", "artist_id"),
    ("doctors", "hospitals", "hospital_id"),
    ("movies", "directors", "director_id"),
    ("books", "authors", "author_id"),
    ("players", "teams", "team_id"),
)


# =========================================================================== SQL queries


def _sql_literal(value: str | int | float) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


class _Table:
    """A concrete table for one query: name, entity and the columns the query uses."""

    def __init__(self, entity: Entity, rng: random.Random, name: str | None = None):
        self.entity = entity
        self.rng = rng
        # Like sql-create-context, some tables carry WikiSQL's generic names.
        self.name = name or (
            f"table_name_{rng.randint(1, 99)}" if rng.random() < 0.15 else rng.choice(entity.tables)
        )
        self.used: list[Column] = []
        self.extra: list[Column] = []

    def pick(self, numeric: bool | None = None) -> Column:
        """An unused column (optionally only numeric / non-numeric); recorded for the schema."""
        options = [
            c
            for c in self.entity.columns
            if c not in self.used and (numeric is None or c.numeric == numeric)
        ]
        column = self.rng.choice(options)
        self.used.append(column)
        return column

    def value(self, column: Column) -> str | int | float:
        return _value(column.kind, self.rng)

    def create(self, pad: int) -> str:
        """``CREATE TABLE`` with the used columns plus up to ``pad`` distractors, shuffled."""
        spare = [c for c in self.entity.columns if c not in self.used]
        columns = self.used + self.extra + self.rng.sample(spare, min(pad, len(spare)))
        self.rng.shuffle(columns)
        body = ", ".join(f"{c.name} {c.sql_type}" for c in columns)
        return f"CREATE TABLE {self.name} ({body})"


def _q_select_where(t: _Table, r: random.Random) -> tuple[str, str]:
    a, b = t.pick(), t.pick()
    v = t.value(b)
    e = t.entity
    question = r.choice(
        (
            f"What is the {a.phrase} of the {e.singular} with {b.phrase} {v}?",
            f"What is the {a.phrase} of the {e.singular} whose {b.phrase} is {v}?",
            f"Which {a.phrase} belongs to the {e.singular} with a {b.phrase} of {v}?",
            f"Name the {a.phrase} when the {b.phrase} is {v}.",
            f"Tell me the {a.phrase} for {b.phrase} of {v}.",
        )
    )
    return question, f"SELECT {a.name} FROM {t.name} WHERE {b.name} = {_sql_literal(v)}"


def _q_count_where(t: _Table, r: random.Random) -> tuple[str, str]:
    b = t.pick()
    v = t.value(b)
    question = r.choice(
        (
            f"How many {t.entity.plural} have {b.phrase} {v}?",
            f"How many {t.entity.plural} are there whose {b.phrase} is {v}?",
            f"Count the number of {t.entity.plural} with a {b.phrase} of {v}.",
        )
    )
    return question, f"SELECT COUNT(*) FROM {t.name} WHERE {b.name} = {_sql_literal(v)}"


_AGGREGATES = {
    "MAX": ("highest", "maximum", "largest"),
    "MIN": ("lowest", "minimum", "smallest"),
    "AVG": ("average", "mean"),
    "SUM": ("total",),
}


def _q_aggregate(t: _Table, r: random.Random) -> tuple[str, str]:
    fn = r.choice(tuple(_AGGREGATES))
    word = r.choice(_AGGREGATES[fn])
    n = t.pick(numeric=True)
    select = f"SELECT {fn}({n.name}) FROM {t.name}"
    if r.random() < 0.5:
        return f"What is the {word} {n.phrase} of all {t.entity.plural}?", select
    b = t.pick()
    v = t.value(b)
    question = r.choice(
        (
            f"What is the {word} {n.phrase} of {t.entity.plural} whose {b.phrase} is {v}?",
            f"What is the {word} {n.phrase} when the {b.phrase} is {v}?",
        )
    )
    return question, f"{select} WHERE {b.name} = {_sql_literal(v)}"


def _q_order_limit(t: _Table, r: random.Random) -> tuple[str, str]:
    a, n = t.pick(), t.pick(numeric=True)
    desc = r.random() < 0.6
    extreme = "highest" if desc else "lowest"
    order = f"ORDER BY {n.name} DESC" if desc else f"ORDER BY {n.name}"
    select = f"SELECT {a.name} FROM {t.name} {order}"
    k = r.choice((1, 1, 3, 5, 10))
    if r.random() < 0.2:
        direction = "descending" if desc else "ascending"
        return (
            f"List the {a.phrase} of all {t.entity.plural} sorted by {n.phrase} in "
            f"{direction} order.",
            select,
        )
    if k == 1:
        question = r.choice(
            (
                f"What is the {a.phrase} of the {t.entity.singular} with the {extreme} {n.phrase}?",
                f"Which {t.entity.singular} has the {extreme} {n.phrase}? Give its {a.phrase}.",
            )
        )
    else:
        question = (
            f"List the {a.phrase} of the {k} {t.entity.plural} with the {extreme} {n.phrase}."
        )
    return question, f"{select} LIMIT {k}"


def _q_group_by(t: _Table, r: random.Random) -> tuple[str, str]:
    g = t.pick(numeric=False)
    roll = r.random()
    if roll < 0.4:
        return (
            f"How many {t.entity.plural} are there for each {g.phrase}?",
            f"SELECT {g.name}, COUNT(*) FROM {t.name} GROUP BY {g.name}",
        )
    if roll < 0.75:
        fn = r.choice(("AVG", "MAX", "MIN", "SUM"))
        word = _AGGREGATES[fn][0]
        n = t.pick(numeric=True)
        return (
            f"What is the {word} {n.phrase} for each {g.phrase}?",
            f"SELECT {g.name}, {fn}({n.name}) FROM {t.name} GROUP BY {g.name}",
        )
    k = r.randint(1, 20)
    return (
        f"Which {g.phrase} values have more than {k} {t.entity.plural}?",
        f"SELECT {g.name} FROM {t.name} GROUP BY {g.name} HAVING COUNT(*) > {k}",
    )


def _q_where_and(t: _Table, r: random.Random) -> tuple[str, str]:
    a, b, c = t.pick(), t.pick(), t.pick()
    vb, vc = t.value(b), t.value(c)
    question = r.choice(
        (
            f"What is the {a.phrase} of the {t.entity.singular} whose {b.phrase} is {vb} and "
            f"{c.phrase} is {vc}?",
            f"Name the {a.phrase} when the {b.phrase} is {vb} and the {c.phrase} is {vc}.",
            f"Which {a.phrase} has {b.phrase} {vb} and {c.phrase} {vc}?",
        )
    )
    where = f"{b.name} = {_sql_literal(vb)} AND {c.name} = {_sql_literal(vc)}"
    return question, f"SELECT {a.name} FROM {t.name} WHERE {where}"


def _q_distinct(t: _Table, r: random.Random) -> tuple[str, str]:
    a = t.pick(numeric=False)
    select = f"SELECT DISTINCT {a.name} FROM {t.name}"
    if r.random() < 0.5:
        return r.choice(
            (
                f"What are the distinct {a.phrase} values of all {t.entity.plural}?",
                f"List the different {a.phrase} values among the {t.entity.plural}.",
            )
        ), select
    n = t.pick(numeric=True)
    v = t.value(n)
    return (
        f"What are the distinct {a.phrase} values of {t.entity.plural} with {n.phrase} "
        f"greater than {v}?",
        f"{select} WHERE {n.name} > {v}",
    )


def _q_compare(t: _Table, r: random.Random) -> tuple[str, str]:
    n = t.pick(numeric=True)
    lo, hi = sorted((t.value(n), t.value(n)))
    roll = r.random()
    if roll < 0.3:
        a = t.pick()
        return (
            f"List the {a.phrase} of {t.entity.plural} whose {n.phrase} is between {lo} and {hi}.",
            f"SELECT {a.name} FROM {t.name} WHERE {n.name} > {lo} AND {n.name} < {hi}",
        )
    op, words = r.choice(
        ((">", ("greater than", "more than", "above")), ("<", ("less than", "below", "under")))
    )
    word = r.choice(words)
    if roll < 0.5:
        return (
            f"How many {t.entity.plural} have a {n.phrase} {word} {lo}?",
            f"SELECT COUNT(*) FROM {t.name} WHERE {n.name} {op} {lo}",
        )
    a = t.pick()
    return (
        f"Which {a.phrase} values belong to {t.entity.plural} with {n.phrase} {word} {lo}?",
        f"SELECT {a.name} FROM {t.name} WHERE {n.name} {op} {lo}",
    )


QueryShape = Callable[[_Table, random.Random], tuple[str, str]]
#: Single-table shapes and their weights.
SQL_SHAPES: dict[str, tuple[QueryShape, int]] = {
    "select_where": (_q_select_where, 4),
    "count_where": (_q_count_where, 2),
    "aggregate": (_q_aggregate, 2),
    "order_limit": (_q_order_limit, 2),
    "group_by": (_q_group_by, 2),
    "where_and": (_q_where_and, 2),
    "distinct": (_q_distinct, 1),
    "compare": (_q_compare, 2),
}
JOIN_WEIGHT = 2


def _sql_join(rng: random.Random) -> dict:
    child_name, parent_name, key_name = rng.choice(JOINS)
    child = _Table(ENTITIES[child_name], rng, rng.choice(ENTITIES[child_name].tables))
    parent = _Table(ENTITIES[parent_name], rng, rng.choice(ENTITIES[parent_name].tables))
    key = Column(key_name, "INTEGER", "int:1:999")
    child.extra.append(key)
    parent.extra.append(key)
    p = parent.pick()
    v = parent.value(p)
    ce, pe = child.entity, parent.entity
    on = f"{child.name} AS T1 JOIN {parent.name} AS T2 ON T1.{key.name} = T2.{key.name}"
    where = f"WHERE T2.{p.name} = {_sql_literal(v)}"
    if rng.random() < 0.35:
        question = (
            f"How many {ce.plural} belong to {articled(pe.singular)} whose {p.phrase} is {v}?"
        )
        answer = f"SELECT COUNT(*) FROM {on} {where}"
    else:
        a = child.pick()
        question = rng.choice(
            (
                f"What are the {a.phrase} values of {ce.plural} whose {pe.singular} has "
                f"{p.phrase} {v}?",
                f"Find the {a.phrase} of the {ce.plural} linked to the {pe.singular} with "
                f"{p.phrase} {v}.",
            )
        )
        answer = f"SELECT T1.{a.name} FROM {on} {where}"
    context = f"{child.create(rng.randint(1, 3))}, {parent.create(rng.randint(0, 2))}"
    return {"context": context, "question": question, "answer": answer}


def sql_record(rng: random.Random) -> dict:
    """One random text-to-SQL record ``{"context", "question", "answer"}``."""
    names = list(SQL_SHAPES) + ["join"]
    weights = [w for _, w in SQL_SHAPES.values()] + [JOIN_WEIGHT]
    shape = rng.choices(names, weights)[0]
    if shape == "join":
        return _sql_join(rng)
    table = _Table(rng.choice(list(ENTITIES.values())), rng)
    question, answer = SQL_SHAPES[shape][0](table, rng)
    # 2-6 columns in all, as in the task statement; the query may already use up to 3.
    pad = max(0, rng.randint(2, 6) - len(table.used))
    return {"context": table.create(pad), "question": question, "answer": answer}


def sql_key(record: dict) -> str:
    return normalise_key(record["context"], record["question"])


def build_sql(split: str, n: int, seed: int) -> list[dict]:
    """``n`` distinct text-to-SQL records of ``split``."""
    return draw("sql", split, n, seed, sql_record, sql_key)
