"""This environment's torch, and only what it needs, made importable in another virtualenv (the
official peer's, runner/official.py), so that the peer runs on the same torch build without a
second copy: a CUDA torch is gigabytes, and a machine without a package index cannot install one.

    python -m sbpbench.runner.parent_torch VENV

links torch's installed files and those of its requirements (their closure, markers evaluated,
extras left out) into VENV/parent-site/ and puts that folder on VENV's path with a .pth file, after
VENV's own site-packages. Nothing else of this environment is visible there: a package that
transformers imports when it is present (datasets, say) would otherwise come in built for our
transformers and huggingface_hub, not the peer's (`from transformers import Trainer` then fails).
"""

from __future__ import annotations

import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LINKS_DIR = "parent-site"
PTH_NAME = "_sbpbench_parent_torch.pth"


def requirement_closure(name: str) -> list[metadata.Distribution]:
    """The installed distribution `name` and every installed one it requires, transitively (a
    requirement whose marker is false here, or that only an extra asks for, is left out)."""
    found, seen, todo = [], set(), [name]
    while todo:
        key = canonicalize_name(todo.pop())
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue  # optional on this platform, or not installed: nothing to link
        found.append(dist)
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def top_level_entries(dist: metadata.Distribution) -> set[Path]:
    """The files and folders a distribution installed at the top of its site-packages (its packages,
    modules, shared libraries and .dist-info), not scripts outside it."""
    names = {Path(f).parts[0] for f in dist.files or []}
    root = Path(dist.locate_file(""))
    return {root / n for n in names if n not in ("..", "__pycache__") and (root / n).exists()}


def venv_site_packages(venv: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))


def link_parent_torch(venv: Path) -> Path:
    """Link torch and its requirements into VENV/parent-site/ and add it to VENV's path; returns
    the folder."""
    links = venv / LINKS_DIR
    links.mkdir(parents=True, exist_ok=True)
    for dist in requirement_closure("torch"):
        for entry in top_level_entries(dist):
            link = links / entry.name
            if not link.is_symlink() and not link.exists():
                link.symlink_to(entry)
    site = venv_site_packages(venv)
    site.mkdir(parents=True, exist_ok=True)
    (site / PTH_NAME).write_text(str(links.resolve()) + "\n")
    return links


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m sbpbench.runner.parent_torch VENV")
    print(f"linked this environment's torch into {link_parent_torch(Path(sys.argv[1]))}")
