"""Dataset formats on the shipped sample files (golds checked against values recomputed from the problem text or
the other file of the same problems) and on broken files (errors name file, row, field and the expected layout)."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data.datasets import load_records, read_rows
from megarl.data.formats import DataFormatError
from megarl.data.samples import SAMPLES_DIR
from megarl.data.samples.make_samples import write_samples

SAMPLE_FILES = ["guru_math_sample.parquet", "guru_math_sample_jsonstr.parquet", "gsm8k_sample.jsonl",
                "math500_sample.jsonl", "math_sample.parquet"]


def test_shipped_samples_are_what_the_script_writes(tmp_path):
    written = write_samples(tmp_path)
    assert sorted(p.name for p in written) == sorted(SAMPLE_FILES)
    for name in SAMPLE_FILES:  # the same rows (parquet bytes may differ in metadata across pyarrow versions)
        assert read_rows(tmp_path / name) == read_rows(SAMPLES_DIR / name), name
        assert len(read_rows(SAMPLES_DIR / name)) == 24


def test_gsm8k_gold_is_the_last_hash_number_without_commas():
    records = load_records([SAMPLES_DIR / "gsm8k_sample.jsonl"], "gsm8k")
    assert len(records) == 24 and {r.data_source for r in records} == {"gsm8k"}
    assert records[0].prompt.startswith("Mia buys 5 boxes of pencils with 8 pencils") and records[0].answer == "33"
    for r in records:  # recomputed from the question's own numbers
        numbers = [int(n) for n in re.findall(r"\d+", r.prompt)]
        expected = numbers[0] * numbers[1] - (numbers[2] if r.prompt.startswith("Mia") else 0)
        assert r.answer == str(expected), r.prompt
    assert any(int(r.answer) >= 1000 for r in records)  # written `#### 1,250`-style in the file
    assert "," in read_rows(SAMPLES_DIR / "gsm8k_sample.jsonl")[3]["answer"].rsplit("####")[1]


def test_gsm8k_gold_after_the_last_of_two_hash_markers(tmp_path):
    """A solution with two `####` (an intermediate line, then the final answer): the gold is after the LAST one."""
    rows = [{"question": "q", "answer": "Half of it: #### 7 is not it.\n3 * 404 = 1,212\n#### 1,212"}]
    path = tmp_path / "two_markers.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    assert [r.answer for r in load_records([path], "gsm8k")] == ["1212"]


def _expected_gold(problem: str) -> Fraction:
    """The answer of a sample problem, recomputed from its text."""
    if m := re.search(r"\\frac\{(\d+)\}\{(\d+)\} \+ \\frac\{(\d+)\}\{(\d+)\}", problem):
        a, b, c, d = map(int, m.groups())
        return Fraction(a, b) + Fraction(c, d)
    if m := re.search(r"\$(\d+)x \+ (\d+) = (\d+)\$", problem):
        a, b, c = map(int, m.groups())
        return Fraction(c - b, a)
    n, k = map(int, re.search(r"\$(\d+)\$ is divided by \$(\d+)\$", problem).groups())
    return Fraction(n % k)


def _as_fraction(latex: str) -> Fraction:
    m = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", latex)
    return Fraction(int(m[2]), int(m[3])) * (-1 if m[1] else 1) if m else Fraction(int(latex))


def test_math_gold_from_answer_or_last_boxed_of_solution():
    with_answer = load_records([SAMPLES_DIR / "math500_sample.jsonl"], "math")
    from_solution = load_records([SAMPLES_DIR / "math_sample.parquet"], "math")  # no `answer` column
    assert [r.answer for r in with_answer] == [r.answer for r in from_solution]
    assert [r.prompt for r in with_answer] == [r.prompt for r in from_solution]
    assert with_answer[0].prompt == "Compute $\\frac{8}{10} + \\frac{8}{6}$." and with_answer[0].answer == \
        "\\frac{32}{15}"  # 8/10 + 8/6 = 32/15, by hand
    for r in with_answer:
        assert _as_fraction(r.answer) == _expected_gold(r.prompt), r.prompt
    assert any("\\frac" in r.answer for r in from_solution)  # nested braces inside the last \boxed{...}


def test_guru_struct_and_json_string_variants_agree():
    plain = load_records([SAMPLES_DIR / "guru_math_sample.parquet"], "guru")
    jsonstr = load_records([SAMPLES_DIR / "guru_math_sample_jsonstr.parquet"], "guru")
    assert plain == jsonstr and len(plain) == 24
    assert isinstance(pq.read_table(SAMPLES_DIR / "guru_math_sample_jsonstr.parquet")["reward_model"][0].as_py(), str)
    assert isinstance(pq.read_table(SAMPLES_DIR / "guru_math_sample.parquet")["reward_model"][0].as_py(), dict)
    for r in plain:
        user = r.prompt[-1]
        assert user["role"] == "user" and user["content"].endswith(" Please output the final answer within \\boxed{}.")
        assert _as_fraction(r.answer) == _expected_gold(user["content"]), user["content"]
        assert r.data_source == "math__made_up_sample"
    assert [m["role"] for m in plain[5].prompt] == ["system", "user"]


def test_several_files_are_one_row_list_in_order():
    both = load_records([SAMPLES_DIR / "gsm8k_sample.jsonl", SAMPLES_DIR / "gsm8k_sample.jsonl"], "gsm8k")
    assert len(both) == 48 and both[:24] == both[24:] and both[30].row == 6


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GOOD_GURU = {"prompt": [{"role": "user", "content": "1+1?"}], "data_source": "s",
             "reward_model": {"ground_truth": "2"}, "extra_info": {"index": 0}}


@pytest.mark.parametrize(("fmt", "bad_row", "field", "problem"), [
    ("guru", {**GOOD_GURU, "reward_model": {"style": "rule"}}, "reward_model.ground_truth", "missing"),
    ("guru", {**GOOD_GURU, "prompt": "1+1?"}, "prompt", "has type str"),  # a column type: every row bad
    ("guru", {**GOOD_GURU, "prompt": [{"role": "user", "text": "1+1?"}]}, "prompt", "message 0"),
    ("guru", {k: v for k, v in GOOD_GURU.items() if k != "data_source"}, "data_source", "is missing"),
    ("gsm8k", {"question": "q", "answer": "it is 4"}, "answer", "no `#### N`"),
    ("gsm8k", {"question": "q"}, "answer", "is missing"),
    ("gsm8k", {"question": 3, "answer": "#### 3"}, "question", "has type int"),
    ("math", {"problem": "p", "solution": "it is 4"}, "solution", "no closed, non-empty \\boxed"),
    ("math", {"problem": "p", "solution": "\\boxed{4"}, "solution", "no closed"),
    ("math", {"problem": "p"}, "solution", "is missing"),
    ("math", {"question": "p", "answer": "4"}, "problem", "is missing"),
])
def test_bad_row_error_names_file_row_field_and_layout(tmp_path, fmt, bad_row, field, problem):
    good = {"guru": GOOD_GURU, "gsm8k": {"question": "q", "answer": "#### 1"},
            "math": {"problem": "p", "answer": "1"}}[fmt]
    type_change = problem.startswith("has type")  # a column cannot change type between rows: all rows have it
    rows = [bad_row] * 3 if type_change else [good, good, bad_row, good]
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataFormatError) as error:
        load_records([path], fmt)
    message = str(error.value)
    assert message.startswith(f"{path}: row {0 if type_change else 2}: field {field!r}"), message
    assert problem in message and f"the {fmt!r} format expects" in message


def test_guru_json_string_errors(tmp_path):
    path = _parquet(tmp_path / "g.parquet", [{**GOOD_GURU, "reward_model": json.dumps({"ground_truth": "2"}),
                                             "extra_info": "{not json"}])
    with pytest.raises(DataFormatError, match=r"g.parquet: row 0: field 'extra_info' is a string but not JSON"):
        load_records([path], "guru")
    path = _parquet(tmp_path / "h.parquet", [{**GOOD_GURU, "reward_model": "[1, 2]", "extra_info": None}])
    with pytest.raises(DataFormatError, match="field 'reward_model' is a JSON list, not an object"):
        load_records([path], "guru")
    ok = _parquet(tmp_path / "k.parquet", [{**GOOD_GURU, "reward_model": json.dumps({"ground_truth": 7}),
                                           "extra_info": None}])
    assert load_records([ok], "guru")[0].answer == "7"


def test_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        load_records([tmp_path / "nope.jsonl"], "gsm8k")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataFormatError, match="empty.jsonl"):
        load_records([tmp_path / "empty.jsonl"], "gsm8k")
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": \n')
    with pytest.raises(DataFormatError, match="broken.jsonl cannot be read as jsonl"):
        load_records([tmp_path / "broken.jsonl"], "gsm8k")
    rows = [{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "#### 1"}, {"question": 5}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataFormatError, match=r"mixed.jsonl cannot be read as jsonl: .*question.* row 2"):
        load_records([tmp_path / "mixed.jsonl"], "gsm8k")  # pyarrow's message names the column and the row
    (tmp_path / "d.csv").write_text("question,answer\n")
    with pytest.raises(DataFormatError, match="unknown suffix '.csv'"):
        load_records([tmp_path / "d.csv"], "gsm8k")
    with pytest.raises(DataFormatError, match="needs at least one dataset file"):
        load_records([], "gsm8k")
