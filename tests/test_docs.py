"""The README and docs/ only point at files a clone has, the README opens with the two commands CI and a
new user run, stays short, and its table of what is implemented names exactly what the code accepts."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_relative_links_point_at_files_in_the_repository():
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), f"{doc.name} links {target}, not in the repository"


def test_readme_opens_with_the_demo_and_the_test_command_that_ci_runs():
    first_block = ROOT.joinpath("README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["make demo", "make test"]
    assert "make test" in ROOT.joinpath(".ci", "run").read_text()


def _implemented() -> dict[str, set[str]]:
    """Backquoted names per row of the README's 'What is implemented' table."""
    text = ROOT.joinpath("README.md").read_text().split("## What is implemented", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[1].strip(): set(re.findall(r"`([\w.-]+)`", cells[2])) for cells in rows[1:]}


def test_the_readme_is_short_and_its_implemented_table_names_what_the_code_accepts():
    from kvjax.compress import policy

    assert len(ROOT.joinpath("README.md").read_text().splitlines()) <= 200
    table = _implemented()
    assert table["model"] == {p.stem for p in (ROOT / "configs" / "models").glob("*.yaml")}
    listed = set().union(*(table[row] for row in ("token eviction", "encoding", "heads and layers")))
    assert listed == set(policy.all_methods())
    assert table["budgets and merging"] == set(policy.ALLOCATORS) | set(policy.REDUCERS)
    from kvjax.training import families
    from kvjax.training.gguf_import import SHIPPED

    assert table["real models"] == set(SHIPPED) | set(families.BY_HF_ARCHITECTURE) | set(families.BY_GGUF_ARCHITECTURE)


def test_the_readme_python_example_runs_and_its_byte_counts_agree():
    """The README's Python block, run as written: its last line's analytic and measured bytes are equal."""
    block = ROOT.joinpath("README.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    *body, last = block.strip().splitlines()
    scope: dict = {}
    exec("\n".join(body), scope)
    analytic, measured = eval(last.split("#")[0], scope)
    assert analytic == measured > 0
