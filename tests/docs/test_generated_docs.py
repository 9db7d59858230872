"""The generated pages match what their generators make: the config reference (from the schema), the families
tables (from the adapters and the planner) and the benchmarks page with the README's headline table (from
bench/results/*.json). A difference fails with the command that regenerates it."""
from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys

import pytest
from pydantic import BaseModel

from bench import gen_benchmarks

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen_config = _load("gen_config")
gen_families = _load("gen_families")


def _between(text: str, begin: str, end: str) -> str:
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def test_the_configuration_page_is_what_the_schema_makes():
    assert (ROOT / "docs" / "configuration.md").read_text() == gen_config.page(), \
        "docs/configuration.md is stale: run .venv/bin/python docs/gen_config.py"


def test_the_configuration_page_lists_every_key_of_the_app_args():
    text = (ROOT / "docs" / "configuration.md").read_text()
    for cls in (gen_config.AppArgs, gen_config.StageArgs, gen_config.Limits, gen_config.JobsArgs):
        for name in cls.model_fields:
            assert f"| `{name}` |" in text, f"{cls.__name__}.{name} is not on the page"


class _Knobs(BaseModel):
    # Documented.
    speed: int = 1
    color: str = "red"


def test_a_config_field_without_a_comment_fails_the_generator():
    with pytest.raises(gen_config.Undocumented, match=r"\['color'\]"):
        gen_config.rows(_Knobs)


@pytest.fixture(scope="module")
def families_table() -> str:
    return gen_families.families_table()  # ~100 real-size plans on meta: once


def test_the_families_tables_are_what_the_adapters_and_the_planner_make(families_table):
    table = families_table
    for path in gen_families.TARGETS:
        assert _between(path.read_text(), gen_families.BEGIN, gen_families.END) == table, \
            f"{path.relative_to(ROOT)}'s families table is stale: run .venv/bin/python docs/gen_families.py"


def test_every_folder_kind_has_one_adapter_and_a_real_size_plan(families_table):
    table = families_table
    for kind in gen_families.FOLDER_KINDS:
        assert f"`{kind.model}`" in table
    assert gen_families.NOT_PLANNED not in table.split("\n\n")[0], "a family the planner could not plan"


def test_the_benchmarks_page_and_the_readme_headline_are_what_the_results_make():
    page, readme = gen_benchmarks.rendered(gen_benchmarks.README.read_text(), gen_benchmarks.load_results())
    assert gen_benchmarks.PAGE.read_text() == page, "docs/benchmarks.md is stale: run .venv/bin/python bench/gen_benchmarks.py"
    assert gen_benchmarks.README.read_text() == readme, "README.md's headline table is stale: run bench/gen_benchmarks.py"


@pytest.mark.parametrize("key", ["command", "machine", "commit", "date"])
def test_a_result_without_its_command_machine_commit_or_date_fails(key):
    results = gen_benchmarks.load_results()
    assert results, "no result files under bench/results"
    name, result = next(iter(results.items()))
    for broken in ({k: v for k, v in result.items() if k != key}, {**result, key: " "}):
        with pytest.raises(gen_benchmarks.ResultError, match=key):
            gen_benchmarks.check_result(name, broken)


def test_a_made_up_commit_or_date_format_fails():
    name, result = next(iter(gen_benchmarks.load_results().items()))
    with pytest.raises(gen_benchmarks.ResultError, match="commit"):
        gen_benchmarks.check_result(name, {**result, "commit": "yesterday's"})
    with pytest.raises(gen_benchmarks.ResultError, match="date"):
        gen_benchmarks.check_result(name, {**result, "date": "Tuesday"})


def test_the_readme_shows_at_most_seven_headline_figures():
    results = gen_benchmarks.load_results()
    more = copy.deepcopy(results)
    name = next(iter(more))
    more[name]["figures"] = [{"name": f"f{i}", "value": "1", "headline": f"h{i}"} for i in range(8)]
    with pytest.raises(gen_benchmarks.ResultError, match="at most 7"):
        gen_benchmarks.headline_table(more)
