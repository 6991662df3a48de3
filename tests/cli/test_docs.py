"""README.md and the docs: every relative link and quoted repository path resolves, and each
generated block (README's results tables, the H100 study's report) is what `sbp report` prints from
the committed rows.

Run `python tests/cli/test_docs.py` to rewrite every block from those rows (then read the diff).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: import the checkout's sbpbench
    sys.path.insert(0, str(ROOT))

from sbpbench.cli import app  # noqa: E402
from sbpbench.config.experiment import load_experiment  # noqa: E402
from sbpbench.models import full_depth  # noqa: E402
from sbpbench.records.exactness import read_exactness  # noqa: E402
from sbpbench.records.reference import load_reference  # noqa: E402
from sbpbench.report import glance_markdown, markdown_report, points_markdown  # noqa: E402
from sbpbench.report.inputs import load_table  # noqa: E402

README = ROOT / "README.md"
GLANCE_ROWS = Path("results/cpu/peers_cpu.csv")
GLANCE_EXACTNESS = Path("results/cpu/peers_exactness.csv")
GPU_ROWS = Path("results/gpu/NVIDIA-H100-80GB-HBM3")
H100_STUDY = ROOT / "benchmarks" / "h100_first_rows_2026-11-26.md"
# Written by other work from the code (command help, the settings table): links to them are
# checked once they exist.
GENERATED = {ROOT / "docs" / "commands.md", ROOT / "docs" / "settings.md"}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, ROOT / "sbpbench" / "core" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "benchmarks").glob("*.md"))]  # fmt: skip


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation but - and _ dropped,
    spaces to -, a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug)
        seen[slug] = 0 if count is None else count + 1
        if count is not None:
            seen[f"{slug}-{count + 1}"] = 0
    return set(seen)


def _broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = page if not path else (page.parent / path).resolve()
        if resolved in GENERATED and not resolved.exists():
            continue
        if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    return broken


# A path in a page's text, code span or command: path characters around a slash. The lookbehind
# keeps a URL's tail out (a slash or dot before it), and a <placeholder> is skipped by its caller.
QUOTED_PATH = re.compile(r"(?<![\w./<~:-])\.?[\w-]+(?:/[\w.-]*)+")


def _written_by_a_command(path: str, before: str) -> bool:
    """A path a command writes, not one the repository holds. That is anything directly in results/:
    results/runs.csv, results/<experiment>.csv and results/cpu-selftest/ are the commands' outputs,
    and committed rows live one folder down (results/<hardware>/). So is the argument of --out or -o."""
    parts = Path(path).parts
    return (parts[0] == "results" and len(parts) == 2) or re.search(r"(--out|-o)[ =]$", before) is not None


def _unresolved_paths(page: Path) -> list[str]:
    """Paths the page quotes that start at a folder of the repository, of the package (`methods/...`
    means sbpbench/methods/...) or beside the page, and name nothing there."""
    bases = [ROOT, ROOT / "sbpbench", page.parent]
    starts = {entry.name for base in bases for entry in base.iterdir()}
    unresolved = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for match in QUOTED_PATH.finditer(line):
            path, after = match.group(0).rstrip("."), line[match.end() : match.end() + 1]
            if path.split("/")[0] not in starts or after in ("<", "*", "{"):
                continue  # a model id (`Qwen/Qwen3-8B`), a ratio, a placeholder (`results/gpu/<device>/`)
            if _written_by_a_command(path, line[: match.start()]):
                continue
            if not any((base / path).exists() for base in bases):
                unresolved.append(f"{page.relative_to(ROOT)}:{number}: {path}")
    return unresolved


def glance_now() -> str:
    """The table `sbp report --glance` makes now from the committed rows (paths relative to ROOT)."""
    table = load_table(ROOT / GLANCE_ROWS)
    return glance_markdown(table, exactness=read_exactness(ROOT / GLANCE_EXACTNESS))


def gpu_points_now() -> str:
    """`sbp report results/gpu/NVIDIA-H100-80GB-HBM3 --points` from the committed rows."""
    return points_markdown(load_table(ROOT / GPU_ROWS), load_reference(), full_depth=full_depth)


def h100_report_now() -> str:
    """`sbp report results/gpu/NVIDIA-H100-80GB-HBM3`, every heading one level down (the study page
    has its own title)."""
    text = markdown_report(load_table(ROOT / GPU_ROWS), load_reference(), full_depth=full_depth)
    return "".join("#" + line if line.startswith("#") else line for line in text.splitlines(keepends=True))


def paper_on_one_gpu_now() -> str:
    """`sbp sweep experiments/paper_on_one_gpu.toml --dry-run`'s entries as Markdown, priced from the
    committed rows with no point done."""
    from sbpbench.runner.pricing import price_experiment
    from sbpbench.simulate.cost import pricing_markdown

    experiment = ROOT / "experiments" / "paper_on_one_gpu.toml"
    return pricing_markdown(price_experiment(experiment, results=ROOT / "results", reference=load_reference()))


# Generated blocks: the page, the block's name (its <!-- NAME: begin/end --> markers), what makes it.
BLOCKS = (
    (README, "glance", glance_now),
    (README, "gpu-points", gpu_points_now),
    (H100_STUDY, "h100-report", h100_report_now),
    (ROOT / "docs" / "reproducing.md", "paper-on-one-gpu", paper_on_one_gpu_now),
)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"


def _block(text: str, name: str) -> str:
    begin, end = _markers(name)
    assert text.count(begin) == 1 and text.count(end) == 1, f"the page needs one {begin} ... {end} block"
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def _readme_glance(text: str) -> str:
    return _block(text, "glance")


def test_experiment_example_loads(tmp_path):
    """The experiment file shown in docs/experiments.md loads: 6 grid points and 2 searches."""
    example = re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "experiments.md").read_text(), flags=re.S)[0]
    (tmp_path / "mine.toml").write_text(example)
    specs = load_experiment(tmp_path / "mine.toml").points
    assert [type(s).__name__ for s in specs].count("MaxlenSpec") == 2 and len(specs) == 8


def test_relative_links_resolve():
    """Every relative link and image in README.md, docs/, benchmarks/ and core/README.md names a
    file of the repository (and, into a Markdown page, one of its headings)."""
    broken = [line for page in _pages() for line in _broken_links(page)]
    assert not broken, "\n".join(broken)


def test_link_check_sees_a_broken_link(tmp_path, monkeypatch):
    """The link check reports a missing file and a missing heading (so the test above can fail)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[a](missing.md) [b](#title) [c](#nowhere) [d](https://example.org)\n")
    assert _broken_links(page) == [
        "page.md: missing.md (no such file in the repository)",
        "page.md: #nowhere (no heading #nowhere)",
    ]


def test_quoted_repository_paths_resolve():
    """Every repository path the pages quote (a code span, prose, a command's argument) names a file
    or folder that exists; paths a command writes are left out."""
    unresolved = [line for page in _pages() for line in _unresolved_paths(page)]
    assert not unresolved, "\n".join(unresolved)


def test_path_check_sees_a_moved_file(tmp_path, monkeypatch):
    """The path check reports a quoted file that is not there and passes one that is, a package-relative
    one, an output, a placeholder and a URL (so the test above can fail)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "sbpbench" / "core" / "placements").mkdir(parents=True)
    (tmp_path / "sbpbench" / "core" / "placements" / "placement.py").touch()
    (tmp_path / "tests").mkdir()
    page = tmp_path / "page.md"
    page.write_text(
        "See `sbpbench/core/placement.py` and core/placements/placement.py, tests/test_old.py.\n"
        "    sbp run --out plots/mine && cat results/runs.csv results/gpu/<device>/runs.csv\n"
        "[x](https://example.org/tests/gone.py) Qwen/Qwen3-8B, tiny/qwen3.\n"
    )
    assert _unresolved_paths(page) == ["page.md:1: sbpbench/core/placement.py", "page.md:1: tests/test_old.py"]


@pytest.mark.parametrize("page, name, make", BLOCKS, ids=[name for _, name, _ in BLOCKS])
def test_generated_blocks_are_the_reports(page, name, make):
    """Each generated block (README's CPU glance table and GPU points table, the H100 study's report)
    equals what `sbp report` makes now from the committed rows; refresh with `python tests/cli/test_docs.py`."""
    assert _block(page.read_text(), name) == make(), f"{page.name} {name}: stale: run `python tests/cli/test_docs.py`"


def test_a_changed_row_makes_the_gpu_points_block_stale(tmp_path, monkeypatch):
    """The points block follows the rows: a measured peak changed in a copy of the GPU rows changes
    the table (so the test above fails when README and rows differ)."""
    import shutil

    copy = tmp_path / "rows"
    shutil.copytree(ROOT / GPU_ROWS, copy)
    runs = copy / "runs.csv"
    runs.write_text(runs.read_text().replace(",34609907200,", ",34709907200,", 1))
    monkeypatch.setattr(sys.modules[__name__], "GPU_ROWS", copy)
    assert "| Qwen3-4B | ckpt | 9,000 | 32.33 |" in gpu_points_now()
    assert gpu_points_now() != _block(README.read_text(), "gpu-points")


def test_report_glance_cli_prints_the_table():
    """`sbp report ROWS --exactness CSV --glance` prints the glance table: one row per method, only
    the lengths every method ran, and the exactness column."""
    args = ["report", str(ROOT / GLANCE_ROWS), "--exactness", str(ROOT / GLANCE_EXACTNESS), "--glance"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output == glance_now()
    header = next(line for line in result.output.splitlines() if line.startswith("| method"))
    assert header == "| method | T=1024 | T=2048 | max T | exact vs bp |"
    streambp = "| streambp | 0.13 GiB, 2.12 ms/tok | 0.14 GiB, 2.23 ms/tok | ≥16384 | exact (fp64 1.0e-15) |"
    assert streambp in result.output.splitlines()


def _refresh() -> None:
    for page, name, make in BLOCKS:
        text = page.read_text()
        _block(text, name)
        begin, end = _markers(name)
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        page.write_text(f"{head}{begin}\n{make()}{end}{tail}")
        print(f"rewrote {name} in {page.relative_to(ROOT)}")


if __name__ == "__main__":
    _refresh()


# docs/architecture.md, "Writing prose": one idea per sentence, about 30 words at most
PROSE_PAGES = [
    "README.md",
    *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))),
    "sbpbench/core/README.md",
]
FIRST_PAGES = ("README.md", "docs/architecture.md", "docs/settings.md", "docs/reproducing.md", "docs/placements.md",
               "docs/objectives.md", "docs/experiments.md", "docs/results-schema.md", "docs/exactness.md")  # fmt: skip
MEDIAN_WORDS, FIRST_PAGES_MAX_WORDS = 20, 50


def sentences(markdown: str) -> list[str]:
    """The sentences of a page's prose: not code blocks, indented blocks, tables or headings; each
    list item on its own; a link as its text, inline code as one word."""
    markdown = re.sub(r"```.*?```", "", markdown, flags=re.S)
    blocks, current = [], []
    for line in [*markdown.splitlines(), ""]:
        text = line.strip()
        item = re.match(r"([-*]|\d+\.)\s+", text)
        if not text or line.startswith("    ") or text.startswith(("|", "#", "<!--")) or item:
            blocks.append(" ".join(current))
            current = [text[item.end() :]] if item else []
        else:
            current.append(text)
    found = []
    for block in blocks:
        block = re.sub(r"`[^`]*`", "X", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", block))
        found += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(\[*X])", block) if len(s.split()) >= 3]
    return found


def test_sentences_are_short():
    """The pages' median sentence is under 20 words and none of the first pages a newcomer reads runs
    past 50; a long sentence, a list item and a code block are told apart."""
    lengths = {page: [len(s.split()) for s in sentences((ROOT / page).read_text())] for page in PROSE_PAGES}
    everything = sorted(n for page in lengths.values() for n in page)
    assert everything[len(everything) // 2] <= MEDIAN_WORDS
    long = {page: max(lengths[page]) for page in FIRST_PAGES if max(lengths[page]) > FIRST_PAGES_MAX_WORDS}
    assert not long, f"split these pages' longest sentences (docs/architecture.md, Writing prose): {long}"
    sample = "One two three four.\n- an item of four\n\n```\nno code counts here at all\n```\n    nor this one here\n"
    assert sentences(sample) == ["One two three four.", "an item of four"]


def test_the_readme_installs_before_it_runs():
    """A newcomer reads top down: the install block (pip install -e) comes before the first `sbp` command."""
    commands = [line.strip() for line in README.read_text().splitlines() if line.startswith("    ")]
    install = next(i for i, line in enumerate(commands) if "pip install -e" in line)
    first_run = next(i for i, line in enumerate(commands) if line.startswith("sbp "))
    assert install < first_run, commands[first_run]


def test_the_readme_installs_the_torch_range_pyproject_gives():
    """The README's torch install line names pyproject.toml's torch requirement exactly, so a torch it admits is kept."""
    import tomllib

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [d for d in dependencies if d.startswith("torch")]
    assert f'pip install "{torch}"' in README.read_text(), torch
