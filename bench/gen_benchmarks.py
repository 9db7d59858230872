"""Writes docs/benchmarks.md, and the README's headline table, from the result files in bench/results/.

Each ``bench/results/*.json`` is one measured run: the command that made it, the machine, the commit
and the date (``unknown`` where nobody recorded it, never guessed), then its figures, tables and
notes. A figure marked ``headline`` also goes into the README's table between
``<!-- headline:begin -->`` and ``<!-- headline:end -->`` (six at most). Nothing here measures: to add
a figure, run its bench and commit a result file, then ``.venv/bin/python bench/gen_benchmarks.py``.
``--check`` exits 1 when either page differs from what the files make (tests/docs does the same).

Run by hand in the user's shell and by the test suite; json and text only.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
HEADLINE_BEGIN, HEADLINE_END = "<!-- headline:begin -->", "<!-- headline:end -->"
MAX_HEADLINES = 7  # 7th: the mixed-fleet routing figure (issue 37)
REQUIRED = ("topic", "title", "command", "machine", "commit", "date")
# A commit is a hash, or "unknown", or "per row" where a table's rows name their own.
COMMIT = re.compile(r"^([0-9a-f]{7,40}|unknown|per row)$")
DATE = re.compile(r"^(\d{4}-\d{2}-\d{2}.*|unknown)$")
# The page's sections, in reading order; a result's topic must be one of them.
TOPICS = ("GPU runs", "Streaming engine", "Host memory", "Planner", "Batching and fewer bytes",
          "Simulated accelerator", "Service", "Cluster", "Test suite and idle costs")


class ResultError(ValueError):
    """A result file that lacks what every figure needs beside it (command, machine, commit, date)."""


def check_result(name: str, result: dict) -> None:
    missing = [key for key in REQUIRED if not isinstance(result.get(key), str) or not result[key].strip()]
    if missing:
        raise ResultError(f"bench/results/{name}.json lacks {missing}: every figure needs its command, "
                          f"machine, commit and date beside it ('unknown' where nobody recorded it)")
    if not COMMIT.match(result["commit"]):
        raise ResultError(f"bench/results/{name}.json: commit {result['commit']!r} is not a hash, 'unknown' or 'per row'")
    if not DATE.match(result["date"]):
        raise ResultError(f"bench/results/{name}.json: date {result['date']!r} is not YYYY-MM-DD... or 'unknown'")
    if result["topic"] not in TOPICS:
        raise ResultError(f"bench/results/{name}.json: topic {result['topic']!r} is not one of {TOPICS}")
    for figure in result.get("figures", ()):
        if not {"name", "value"} <= set(figure):
            raise ResultError(f"bench/results/{name}.json: a figure without a name or value: {figure}")
    for table in result.get("tables", ()):
        width = len(table["columns"])
        bad = [row for row in table["rows"] if len(row) != width]
        if bad:
            raise ResultError(f"bench/results/{name}.json: rows of {len(bad[0])} cells under {width} columns: {bad[0]}")


def load_results(folder: pathlib.Path = RESULTS) -> dict[str, dict]:
    """Every result file by its name (without .json), checked."""
    results = {}
    for path in sorted(folder.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ResultError(f"{path.name}: not JSON ({error})") from error
        check_result(path.stem, result)
        results[path.stem] = result
    return results


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(columns, rows) -> list[str]:
    return ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)]


def _command(command: str) -> str:
    return command if command.startswith("unknown") else f"`{command}`"


def _machine(machine: str) -> str:
    """The machine's first words for the README ("one NVIDIA H200", "the project's CI-class VM: 2 CPU cores")."""
    return machine.split(";")[0].split(",")[0]


def _section(name: str, result: dict) -> list[str]:
    lines = [f'<a id="{name}"></a>', f"### {result['title']}", "",
             *_table(("command", "machine", "commit", "date"),
                     [(_command(result["command"]), result["machine"], result["commit"], result["date"])])]
    if result.get("recorded_in"):
        lines.append(f"\nThe commit that recorded the figure: {result['recorded_in']}.")
    if result.get("setup"):
        lines += ["", result["setup"]]
    figures = result.get("figures", ())
    if figures:
        lines += ["", *_table(("figure", "value", "target"),
                              [(f["name"], f["value"], f.get("target", "")) for f in figures])]
    for table in result.get("tables", ()):
        lines += ["", *([f"*{table['caption']}*", ""] if table.get("caption") else []),
                  *_table(table["columns"], table["rows"])]
    if result.get("notes"):
        lines += ["", *(f"- {note}" for note in result["notes"])]
    return lines + [""]


def _order(item: tuple[str, dict]) -> tuple:
    name, result = item
    return TOPICS.index(result["topic"]), result["date"], name


def benchmarks_page(results: dict[str, dict]) -> str:
    lines = ["# Benchmarks", "",
             "<!-- Generated by bench/gen_benchmarks.py from bench/results/*.json: edit those, then run it. -->", "",
             "Every figure with the command that made it, the machine, the commit and the date. CPU runs are on "
             "a 2-core VM without a GPU, shared with other work, with OMP_NUM_THREADS=1 unless the command says otherwise, "
             "so their times carry noise; bytes and peaks are "
             "exact. On CPU the \"device\" is the CPU. Simulated-accelerator figures are a model's, not hardware's. "
             "To add one: run the bench, write its result file under `bench/results/`, run "
             "`.venv/bin/python bench/gen_benchmarks.py`.", ""]
    ordered = sorted(results.items(), key=_order)
    for topic in TOPICS:
        names = [(n, r) for n, r in ordered if r["topic"] == topic]
        if names:
            lines += [f"## {topic}", "", *(f"- [{r['title']}](#{n})" for n, r in names), ""]
            for name, result in names:
                lines += _section(name, result)
    return "\n".join(lines).rstrip("\n") + "\n"


def headline_table(results: dict[str, dict]) -> str:
    rows = [(f["headline"], f.get("headline_value", f["value"]), _machine(r["machine"]),
             f"[{r['date'].split()[0]}](docs/benchmarks.md#{n})")
            for n, r in sorted(results.items(), key=_order) for f in r.get("figures", ()) if f.get("headline")]
    if len(rows) > MAX_HEADLINES:
        raise ResultError(f"{len(rows)} headline figures; the README shows at most {MAX_HEADLINES}")
    return "\n".join(_table(("figure", "value", "machine", "measured"), rows))


def replace_between(text: str, begin: str, end: str, body: str, where: str) -> str:
    """``text`` with what lies between the two markers replaced by ``body`` (markers kept)."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where} needs exactly one {begin} followed by one {end}")
    head, rest = text.split(begin)
    return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def rendered(readme_text: str, results: dict[str, dict]) -> tuple[str, str]:
    """What docs/benchmarks.md and the README should read."""
    return benchmarks_page(results), replace_between(readme_text, HEADLINE_BEGIN, HEADLINE_END,
                                                      headline_table(results), "README.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from what the files make")
    args = parser.parse_args(argv)
    page, readme = rendered(README.read_text(), load_results())
    stale = [p for p, text in ((PAGE, page), (README, readme)) if not p.is_file() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run .venv/bin/python bench/gen_benchmarks.py", file=sys.stderr)
        return 1 if stale else 0
    PAGE.write_text(page)
    README.write_text(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
