"""Carry pure-Python packages into an image without pip or a network: collect, then install.

On the host, `collect` copies installed distributions (and their dependencies, found
from their metadata) out of the Python that runs this script into a directory of the
build context. In the image, `install` copies that directory into the image Python's
site-packages. Pure-Python packages only (pytest and friends); compiled ones need a
matching interpreter and belong in a real `pip install` where a network exists.

    python sandboxes/vendor.py collect sandboxes/vendor pytest       # on the host
    python3 /opt/agentrl/vendor.py install /opt/agentrl/vendor       # in Dockerfile.swe
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def collect(dest: Path, names: list[str]) -> list[str]:
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    dest.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    todo = list(names)
    while todo:
        name = todo.pop()
        dist = metadata.distribution(name)
        if dist.metadata["Name"] in done:
            continue
        done.append(dist.metadata["Name"])
        for file in dist.files or []:
            if file.parts[0] == ".." or "__pycache__" in file.parts or file.suffix in (".so", ".pyd"):
                continue
            target = dest / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file.locate(), target)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return done


def install(source: Path) -> Path:
    import site

    target = Path(site.getsitepackages()[0])
    target.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target, dirs_exist_ok=True)
    return target


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "collect":
        print("vendored:", ", ".join(collect(Path(argv[1]), argv[2:] or ["pytest"])))
        return 0
    if len(argv) == 2 and argv[0] == "install":
        print("installed into", install(Path(argv[1])))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
