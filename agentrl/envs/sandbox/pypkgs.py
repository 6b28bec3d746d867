"""Make pure-Python packages of this interpreter importable inside local sandboxes.

A local sandbox sees only the system's `/usr` — not the virtualenv agentrl runs from
(which lives under a home directory or the project). Tasks still need tools such as
pytest inside. `python_packages: [pytest]` copies the named distributions and their
dependencies (from their metadata) once per process into a cache directory, which the
sandbox mounts read-only and puts on PYTHONPATH. Compiled extensions are skipped: they
would need the sandbox's interpreter to match, so such packages belong in an image.
(sandboxes/vendor.py does the same for Docker image builds, without agentrl installed.)
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata as metadata
import shutil
import tempfile
import threading
from pathlib import Path

from packaging.requirements import Requirement

_lock = threading.Lock()
_cache: dict[tuple[str, ...], Path] = {}


def _copy_distribution(dist: metadata.Distribution, dest: Path) -> None:
    for file in dist.files or []:
        if file.parts[0] == ".." or "__pycache__" in file.parts or file.suffix in (".so", ".pyd"):
            continue
        source = Path(str(file.locate()))
        if source.is_file():
            target = dest / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)


def site_dir(names: list[str]) -> Path:
    """A directory holding `names` and their dependencies, made once per process."""
    key = tuple(sorted(names))
    with _lock:
        if key in _cache and _cache[key].is_dir():
            return _cache[key]
        digest = hashlib.sha1(",".join(key).encode()).hexdigest()[:10]
        dest = Path(tempfile.mkdtemp(prefix=f"agentrl-pypkgs-{digest}-"))
        dest.chmod(0o755)
        done: set[str] = set()
        todo = list(key)
        while todo:
            name = todo.pop()
            try:
                dist = metadata.distribution(name)
            except metadata.PackageNotFoundError as exc:
                raise ValueError(f"sandbox.python_packages: {name!r} is not installed here") from exc
            canonical = dist.metadata["Name"].lower()
            if canonical in done:
                continue
            done.add(canonical)
            _copy_distribution(dist, dest)
            for spec in dist.requires or []:
                req = Requirement(spec)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(req.name)
        for path in [dest, *dest.rglob("*")]:  # readable by the sandbox's uid
            path.chmod(0o755 if path.is_dir() else 0o644)
        _cache[key] = dest
        atexit.register(shutil.rmtree, dest, True)
        return dest
