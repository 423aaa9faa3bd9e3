"""The README and the design notes only point at files a clone has, and the README opens with the two
commands CI and a new user run."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_relative_links_point_at_files_in_the_repository():
    for doc in (ROOT / "README.md", ROOT / "docs" / "design.md"):
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
