"""A disk quota for one local sandbox: its writable directories on a filesystem of their own.

RLIMIT_FSIZE caps each file, not their sum: without a quota, code in a sandbox can fill
the host's disk with many files. Here the sandbox's root directory (holding `work/` and
`tmp/`, the only places it can write besides memory-backed /dev/shm) is a mount point:

- `loop`: a sparse ext4 image of `disk_mb` MiB next to it, loop-mounted (`nosuid,nodev`):
  disk-backed, so a full quota costs the host at most `disk_mb` MiB of disk and no memory;
- `tmpfs`: a size-limited tmpfs where no loop device can be had (e.g. inside a container):
  memory-backed, its pages charged to the writer's memory cgroup.

Both need root (mounting); for an unprivileged user there is no quota and `details`
says why. A write past the quota fails with ENOSPC, which the model sees as its tool's
"No space left on device".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from agentrl.log import get_logger

logger = get_logger("envs.sandbox")


class DiskQuota:
    """A size-limited filesystem mounted on a sandbox's root directory."""

    def __init__(self, root: Path, kind: str, size_mb: int, image: Path | None) -> None:
        self.root, self.kind, self.size_mb, self.image = root, kind, size_mb, image

    @classmethod
    def mount(cls, root: Path, size_mb: int) -> tuple[DiskQuota | None, str]:
        """Mount a `size_mb` filesystem on the (empty) directory `root`: (quota, "") or, where
        none can be made, (None, why)."""
        if os.geteuid() != 0:
            return None, "mounting a filesystem for the quota needs root"
        if shutil.which("mkfs.ext4") and os.path.exists("/dev/loop-control"):
            image = root.with_name(root.name + ".img")
            try:
                with open(image, "wb") as f:
                    f.truncate(size_mb << 20)  # sparse: costs disk only as it fills
                _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E",
                      "lazy_itable_init=1,nodiscard", str(image)])  # fmt: skip
                _run(["mount", "-o", "loop,nosuid,nodev,noatime", str(image), str(root)])
                shutil.rmtree(root / "lost+found", ignore_errors=True)
                return cls(root, "loop", size_mb, image), ""
            except (OSError, subprocess.SubprocessError) as exc:
                logger.debug("no loop-mounted quota for %s: %s", root, exc)
                image.unlink(missing_ok=True)
        try:
            _run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755,nosuid,nodev", "agentrl-sandbox",
                  str(root)])  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"neither a loop image nor a tmpfs could be mounted: {exc}"
        return cls(root, "tmpfs", size_mb, None), ""

    def describe(self) -> str:
        return f"{self.kind} {self.size_mb} MiB"

    def unmount(self) -> None:
        """Unmount (lazily if something still holds it) and delete the image. Safe to call twice."""
        if self.kind:
            for attempt in range(50):
                done = subprocess.run(["umount", str(self.root)], capture_output=True, text=True)
                if done.returncode == 0 or not os.path.ismount(self.root):
                    break
                if attempt == 49:  # busy past 1 s: detach now, the kernel frees it when released
                    subprocess.run(["umount", "-l", str(self.root)], capture_output=True)
                time.sleep(0.02)
            self.kind = ""
        if self.image is not None:
            with contextlib.suppress(OSError):
                self.image.unlink()
            self.image = None


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise subprocess.SubprocessError(f"{' '.join(argv[:2])}: {done.stderr.strip() or done.returncode}")
