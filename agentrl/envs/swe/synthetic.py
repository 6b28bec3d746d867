"""Offline SWE tasks: small Python repositories with one planted bug, in the SWE-bench layout.

For CPU runs and tests, where no SWE-bench image can be pulled. Each task is a package of
a few functions drawn from a bank; one of them gets a one-line bug. The repository the
model sees has tests for the other functions (PASS_TO_PASS); the tests that expose the
bug are hidden in `test_patch` (FAIL_TO_PASS), and the problem statement reports the
symptom the way an issue would. `patch` is the one-line fix.

    python -m agentrl.envs.swe.synthetic runs/swe_tasks --n 64 --seed 0
    # -> runs/swe_tasks/tasks.jsonl and runs/swe_tasks/repos/<instance_id>/
"""

from __future__ import annotations

import argparse
import difflib
import random
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from agentrl.envs.swe.tasks import SweTask, load_tasks, save_tasks


@dataclass(frozen=True)
class Template:
    name: str
    source: str
    bug: tuple[str, str]
    """(correct line, buggy line): the planted bug replaces the first with the second."""
    visible: tuple[tuple[str, str], ...]
    """(call, expected) pairs that pass with and without the bug."""
    hidden: tuple[tuple[str, str], ...]
    """(call, expected) pairs that expose the bug."""


BANK = [
    Template("clamp", "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
             ("max(lo, min(x, hi))", "min(x, hi)"),
             (("clamp(5, 0, 10)", "5"), ("clamp(42, 0, 10)", "10")), (("clamp(-3, 0, 10)", "0"), ("clamp(-1, 2, 4)", "2"))),
    Template("is_palindrome",
             "def is_palindrome(s):\n    chars = [c.lower() for c in s if c.isalnum()]\n    return chars == chars[::-1]\n",
             ("[c.lower() for c in s if c.isalnum()]", "[c for c in s if c.isalnum()]"),
             (("is_palindrome('abba')", "True"),), (("is_palindrome('Racecar')", "True"),
                                                    ("is_palindrome('No lemon, no melon')", "True"))),
    Template("mean", "def mean(xs):\n    if not xs:\n        raise ValueError('mean of nothing')\n"
             "    return sum(xs) / len(xs)\n", ("sum(xs) / len(xs)", "sum(xs) / (len(xs) + 1)"),
             (("mean([0])", "0.0"),), (("mean([1, 2, 3])", "2.0"), ("mean([4])", "4.0"))),
    Template("fizzbuzz", "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n"
             "        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n",
             ("if n % 15 == 0:", "if n % 15 == 1:"),
             (("fizzbuzz(3)", "'Fizz'"), ("fizzbuzz(7)", "'7'")), (("fizzbuzz(15)", "'FizzBuzz'"),
                                                                  ("fizzbuzz(30)", "'FizzBuzz'"))),
    Template("count_words", "def count_words(text):\n    return len(text.split())\n",
             ("len(text.split())", "len(text.split(' '))"),
             (("count_words('one two')", "2"),), (("count_words('one  two')", "2"), ("count_words(' a b ')", "2"))),
    Template("factorial", "def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n        result *= k\n"
             "    return result\n", ("range(2, n + 1)", "range(2, n)"),
             (("factorial(0)", "1"), ("factorial(1)", "1")), (("factorial(5)", "120"), ("factorial(3)", "6"))),
    Template("chunk", "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n",
             ("range(0, len(xs), n)", "range(0, len(xs) - n, n)"),
             (("chunk([], 2)", "[]"),), (("chunk([1, 2, 3], 2)", "[[1, 2], [3]]"), ("chunk([1, 2], 1)", "[[1], [2]]"))),
    Template("dedupe", "def dedupe(xs):\n    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n"
             "            seen.add(x)\n            out.append(x)\n    return out\n",
             ("            out.append(x)", "            out.insert(0, x)"),
             (("dedupe([1, 1])", "[1]"),), (("dedupe([3, 1, 3, 2])", "[3, 1, 2]"), ("dedupe(['b', 'a'])", "['b', 'a']"))),
    Template("c_to_f", "def c_to_f(celsius):\n    return celsius * 9 / 5 + 32\n",
             ("celsius * 9 / 5 + 32", "celsius * 5 / 9 + 32"),
             (("c_to_f(0)", "32.0"),), (("c_to_f(100)", "212.0"), ("c_to_f(-40)", "-40.0"))),
    Template("gcd", "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return abs(a)\n",
             ("return abs(a)", "return a"),
             (("gcd(7, 0)", "7"), ("gcd(12, 18)", "6")), (("gcd(-4, 0)", "4"), ("gcd(12, -18)", "6"))),
    Template("find_index", "def find_index(sorted_xs, target):\n    lo, hi = 0, len(sorted_xs) - 1\n"
             "    while lo <= hi:\n        mid = (lo + hi) // 2\n        if sorted_xs[mid] == target:\n"
             "            return mid\n        if sorted_xs[mid] < target:\n            lo = mid + 1\n        else:\n"
             "            hi = mid - 1\n    return -1\n", ("while lo <= hi:", "while lo < hi:"),
             (("find_index([1, 3, 5], 4)", "-1"),), (("find_index([1, 3, 5], 5)", "2"), ("find_index([2], 2)", "0"))),
    Template("title_case", "def title_case(text):\n    return ' '.join(w[:1].upper() + w[1:].lower() for w in text.split())\n",
             ("w[:1].upper() + w[1:].lower()", "w[:1].upper() + w[1:]"),
             (("title_case('hello world')", "'Hello World'"),), (("title_case('hELLO')", "'Hello'"),
                                                                 ("title_case('a BC')", "'A Bc'"))),
]  # fmt: skip
PACKAGES = ["mathkit", "strutil", "toolbox", "numtools", "textops", "helpers", "coreutils_py", "minilib"]


def _diff(path: str, before: str, after: str, new_file: bool = False) -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        fromfile="/dev/null" if new_file else f"a/{path}",
        tofile=f"b/{path}",
    )
    return "".join(lines)


def _tests(package: str, template: Template, cases: tuple[tuple[str, str], ...], offset: int = 0) -> str:
    body = [f"from {package}.core import {template.name}\n"]
    for k, (call, expected) in enumerate(cases, offset):
        body.append(f"\n\ndef test_{template.name}_{k}():\n    assert {call} == {expected}\n")
    return "".join(body)


def _actual(source: str, name: str, call: str) -> str:
    """What the buggy code returns for `call` (the bank is ours: trusted code)."""
    namespace: dict = {}
    exec(source, namespace)
    try:
        return repr(eval(call, namespace))
    except Exception as exc:
        return f"raises {type(exc).__name__}"


def make_task(index: int, rng: random.Random, root: Path) -> SweTask:
    """One task: a package of 3-4 bank functions, one with its bug planted, written under root."""
    package = f"{rng.choice(PACKAGES)}{index}"
    chosen = rng.sample(BANK, rng.randint(3, 4))
    buggy = chosen[0]
    rng.shuffle(chosen)
    correct_src = "\n\n".join(t.source for t in chosen)
    good_line, bad_line = buggy.bug
    assert good_line in buggy.source, buggy.name
    buggy_src = correct_src.replace(buggy.source, buggy.source.replace(good_line, bad_line, 1))
    instance_id = f"synthetic__{package}-{index:05d}"
    repo = root / "repos" / instance_id
    (repo / package).mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / package / "__init__.py").write_text(f'"""{package}: small helpers."""\n')
    (repo / package / "core.py").write_text(f'"""Core helpers of {package}."""\n\n\n' + buggy_src)
    (repo / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    p2p = []
    for template in chosen:
        if template is buggy:
            continue
        test_file = f"tests/test_{template.name}.py"
        (repo / test_file).write_text(_tests(package, template, template.visible + template.hidden))
        p2p += [
            f"{test_file}::test_{template.name}_{k}" for k in range(len(template.visible + template.hidden))
        ]
    hidden_file = f"tests/test_{buggy.name}.py"
    hidden = _tests(package, buggy, buggy.hidden)
    call, expected = buggy.hidden[0]
    statement = textwrap.dedent(f"""\
        `{package}.core.{buggy.name}` gives the wrong answer.

        `{call}` returns `{_actual(buggy_src, buggy.name, call)}`, but it should return `{expected}`.
        Please fix `{buggy.name}` in `{package}/core.py` without breaking the other helpers.
        """)
    header = f'"""Core helpers of {package}."""\n\n\n'
    return SweTask(
        instance_id=instance_id,
        problem_statement=statement,
        FAIL_TO_PASS=[f"{hidden_file}::test_{buggy.name}_{k}" for k in range(len(buggy.hidden))],
        PASS_TO_PASS=p2p,
        repo=f"synthetic/{package}",
        repo_dir=f"repos/{instance_id}",
        patch=_diff(f"{package}/core.py", header + buggy_src, header + correct_src),
        test_patch=_diff(hidden_file, "", hidden, new_file=True),
        metadata={"bug_function": buggy.name, "functions": [t.name for t in chosen]},
    )


def generate(out_dir: str | Path, n: int, seed: int = 0) -> list[SweTask]:
    """Write n tasks (repos/ + tasks.jsonl) under out_dir and return them as loaded back."""
    out = Path(out_dir)
    rng = random.Random(seed)
    tasks = [make_task(i, rng, out) for i in range(n)]
    return load_tasks(save_tasks(tasks, out / "tasks.jsonl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write offline SWE tasks with planted bugs.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (args.out_dir / "repos").exists():
        parser.error(f"{args.out_dir}/repos exists; choose an empty directory")
    tasks = generate(args.out_dir, args.n, args.seed)
    print(f"wrote {len(tasks)} tasks to {args.out_dir / 'tasks.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
