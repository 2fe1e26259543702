"""Write the sample dataset files of megarl/data/samples/: made-up problems (seeded, so the files are reproducible)
in the schemas of the real datasets. Run `python -m megarl.data.samples.make_samples` to regenerate them.

- guru_math_sample.parquet: Guru / verl layout (`prompt` chat messages, `reward_model` {style, ground_truth},
  `data_source`, `ability`, `extra_info` {index, split}); guru_math_sample_jsonstr.parquet: the same rows with
  `reward_model` and `extra_info` stored as JSON strings.
- gsm8k_sample.jsonl: openai/gsm8k (`question`, `answer` with `<<a*b=c>>` calculations and a final `#### N`).
- math500_sample.jsonl: HuggingFaceH4/MATH-500 (`problem`, `solution`, `answer`, `subject`, `level`,
  `unique_id`); math_sample.parquet: MATH train layout (`problem`, `level`, `type`, `solution`, no `answer`), the
  same problems.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.data.samples import SAMPLES_DIR

ROWS = 24
GURU_SUFFIX = "Please output the final answer within \\boxed{}."


def _latex(q: Fraction) -> str:
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def math_problems(rng: random.Random) -> list[dict[str, str]]:
    """(problem, solution, answer, subject) of made-up algebra / arithmetic / number theory problems."""
    out = []
    for i in range(ROWS):
        a, b, c, d = (rng.randint(1, 9) for _ in range(4))
        kind = i % 3
        if kind == 0:
            q = Fraction(a, b + 1) + Fraction(c, d + 1)
            problem = f"Compute $\\frac{{{a}}}{{{b + 1}}} + \\frac{{{c}}}{{{d + 1}}}$."
            solution = f"Over a common denominator, $\\frac{{{a}}}{{{b + 1}}} + \\frac{{{c}}}{{{d + 1}}} = " \
                       f"\\boxed{{{_latex(q)}}}$."
            subject, answer = "Prealgebra", _latex(q)
        elif kind == 1:
            q = Fraction(c * 10 - b, a)
            problem = f"Solve for $x$: ${a}x + {b} = {c * 10}$."
            solution = f"Subtract {b} and divide by {a}: " \
                       f"$x = \\frac{{{c * 10} - {b}}}{{{a}}} = \\boxed{{{_latex(q)}}}$."
            subject, answer = "Algebra", _latex(q)
        else:
            n, m = a * 100 + b * 10 + c, d + 2
            problem = f"What is the remainder when ${n}$ is divided by ${m}$?"
            solution = f"${n} = {n // m} \\cdot {m} + {n % m}$, so the remainder is $\\boxed{{{n % m}}}$."
            subject, answer = "Number Theory", str(n % m)
        out.append({"problem": problem, "solution": solution, "answer": answer, "subject": subject})
    return out


def gsm8k_rows(rng: random.Random) -> list[dict[str, str]]:
    rows = []
    for i in range(ROWS):
        a, b, c = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 9)
        if i % 4 == 3:  # a four-digit answer, written with a thousands separator as GSM8K does
            a, b = a * 25, b * 10
            total = a * b
            question = f"A farm ships {a} crates with {b} apples in each crate. How many apples does it ship?"
            answer = f"It ships {a} * {b} = <<{a}*{b}={total}>>{total} apples.\n#### {total:,}"
        else:
            total, left = a * b, a * b - c
            question = (f"Mia buys {a} boxes of pencils with {b} pencils in each box. She gives away {c} pencils. "
                        "How many pencils does she have left?")
            answer = (f"Mia has {a} * {b} = <<{a}*{b}={total}>>{total} pencils.\n"
                      f"She has {total} - {c} = <<{total}-{c}={left}>>{left} pencils left.\n#### {left}")
        rows.append({"question": question, "answer": answer})
    return rows


def guru_rows(rng: random.Random, json_strings: bool) -> list[dict]:
    rows = []
    for i, p in enumerate(math_problems(rng)):
        messages = [{"role": "user", "content": f"{p['problem']} {GURU_SUFFIX}"}]
        if i % 6 == 5:
            messages.insert(0, {"role": "system", "content": "You are a careful mathematician."})
        reward_model = {"style": "rule", "ground_truth": p["answer"]}
        extra_info = {"index": i, "split": "train"}
        rows.append({"data_source": "math__made_up_sample", "prompt": messages, "ability": "math",
                     "reward_model": json.dumps(reward_model) if json_strings else reward_model,
                     "extra_info": json.dumps(extra_info) if json_strings else extra_info})
    return rows


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_samples(out_dir: Path = SAMPLES_DIR) -> list[Path]:
    """Write every sample file into `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in ("guru_math_sample.parquet", "guru_math_sample_jsonstr.parquet",
                                               "gsm8k_sample.jsonl", "math500_sample.jsonl", "math_sample.parquet")}
    pq.write_table(pa.Table.from_pylist(guru_rows(random.Random(11), False)), paths["guru_math_sample.parquet"])
    pq.write_table(pa.Table.from_pylist(guru_rows(random.Random(11), True)), paths["guru_math_sample_jsonstr.parquet"])
    _jsonl(paths["gsm8k_sample.jsonl"], gsm8k_rows(random.Random(8)))
    problems = math_problems(random.Random(500))
    _jsonl(paths["math500_sample.jsonl"], [{**p, "level": 1 + i % 5, "unique_id": f"sample/{i}.json"}
                                           for i, p in enumerate(problems)])
    pq.write_table(pa.Table.from_pylist([{"problem": p["problem"], "level": f"Level {1 + i % 5}",
                                          "type": p["subject"], "solution": p["solution"]}
                                         for i, p in enumerate(problems)]), paths["math_sample.parquet"])
    return list(paths.values())


if __name__ == "__main__":
    for written in write_samples():
        print(written)
