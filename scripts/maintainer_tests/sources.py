"""The maintainers' test sources for the installed Lightning and Accelerate, cached.

The tests must match the installed library, so each suite is taken from its repository's
tag for the installed version (or the nearest release tag below it when that tag is not
reachable), tried in order: a shallow `git clone` of the tag from GitHub, the tag's
tarball from GitHub, a local git mirror of the repository (`--git-mirror` /
`$ZERO_MAINTAINER_GIT_MIRRORS`, or `/work/.mirror/<owner>+<name>/repo` when present), and
last the PyPI sdist (Accelerate's ships `tests/`; Lightning's does not). What was used is
written to `SOURCE` in the cache entry, and the report quotes it.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "zero-strategy-maintainer-tests"
)


@dataclass(frozen=True)
class Suite:
    name: str  # "lightning" / "accelerate"
    dist: str  # the installed distribution whose version decides the tag
    repo: str  # GitHub owner/name
    tag_prefix: str  # "" for Lightning's "2.6.6", "v" for Accelerate's "v1.15.0"
    tests: tuple[str, ...]  # folders of the repository to keep


SUITES = {
    "lightning": Suite("lightning", "lightning", "Lightning-AI/pytorch-lightning", "", ("tests",)),
    "accelerate": Suite("accelerate", "accelerate", "huggingface/accelerate", "v", ("tests",)),
}


def _vtuple(text: str) -> tuple[int, ...] | None:
    m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(x) for x in m.groups()) if m else None


def nearest_tag(tags: list[str], installed: str) -> str | None:
    """The tag of the installed version, else the newest release tag below it."""
    want = _vtuple(installed)
    releases = {t: v for t in tags if (v := _vtuple(t)) is not None}
    for t, v in releases.items():
        if v == want:
            return t
    below = [t for t, v in releases.items() if want is None or v < want]
    return max(below, key=lambda t: releases[t]) if below else None


def _run(cmd: list[str], timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _from_clone(suite: Suite, installed: str, dest: Path) -> str | None:
    url = f"https://github.com/{suite.repo}"
    try:
        listing = _run(["git", "ls-remote", "--tags", url], timeout=60)
    except subprocess.TimeoutExpired:
        return None
    if listing.returncode != 0:
        return None
    tags = [
        line.split("refs/tags/")[1] for line in listing.stdout.splitlines() if "^{}" not in line
    ]
    tag = nearest_tag(tags, installed)
    if tag is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        clone = _run(["git", "clone", "-q", "--depth", "1", "--branch", tag, url, tmp])
        if clone.returncode != 0:
            return None
        _copy_tests(suite, Path(tmp), dest)
    return f"git clone {url} tag {tag}"


def _from_tarball(suite: Suite, installed: str, dest: Path) -> str | None:
    tag = suite.tag_prefix + installed
    url = f"https://github.com/{suite.repo}/archive/refs/tags/{tag}.tar.gz"
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except OSError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tmp, filter="data")
        (root,) = Path(tmp).iterdir()
        _copy_tests(suite, root, dest)
    return f"tarball {url}"


def _mirrors(suite: Suite, extra: list[str]) -> list[Path]:
    owner, name = suite.repo.split("/")
    listed = [*extra, *os.environ.get("ZERO_MAINTAINER_GIT_MIRRORS", "").split(os.pathsep)]
    found = []
    for entry in [p for p in listed if p] + [f"/work/.mirror/{owner}+{name}/repo"]:
        path = Path(entry)
        for candidate in (path, path / f"{owner}+{name}" / "repo"):
            is_git = (candidate / "objects").is_dir() or (candidate / ".git").is_dir()
            if is_git and _mirrors_repo(candidate, owner, name):
                found.append(candidate)
    return found


def _mirrors_repo(git_dir: Path, owner: str, name: str) -> bool:
    """Whether `git_dir` is a copy of owner/name: by its origin's URL, or by the
    `<owner>+<name>` folder the fetch tool puts it in. Another repository's mirror (one
    --git-mirror for both suites) would give the wrong tests under the right label."""
    if f"{owner}+{name}".lower() in str(git_dir).lower():
        return True
    url = _run(["git", "-C", str(git_dir), "config", "--get", "remote.origin.url"], 60)
    return url.stdout.strip().lower().removesuffix(".git").endswith(f"{owner}/{name}".lower())


def _from_mirror(
    suite: Suite, installed: str, dest: Path, extra: list[str], exact: bool = False
) -> str | None:
    """The tests at the mirror's tag of the installed version (`exact`), or else at the
    newest release tag below it."""
    for git_dir in _mirrors(suite, extra):
        refs = _run(["git", f"--git-dir={git_dir}", "tag", "--list"], timeout=60)
        tag = nearest_tag(refs.stdout.split(), installed) if refs.returncode == 0 else None
        if tag is None or (exact and _vtuple(tag) != _vtuple(installed)):
            continue
        archive = subprocess.run(
            ["git", f"--git-dir={git_dir}", "archive", "--format=tar", tag, *suite.tests],
            capture_output=True,
            timeout=300,
        )
        if archive.returncode != 0:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                tar.extractall(tmp, filter="data")
            _copy_tests(suite, Path(tmp), dest)
        return f"local git mirror {git_dir} ({suite.repo}) tag {tag}"
    return None


def _from_sdist(suite: Suite, installed: str, dest: Path) -> str | None:
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        if _run([*pip, f"{suite.dist}=={installed}", "-d", tmp], timeout=600).returncode != 0:
            return None
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        root = Path(tmp) / sdist.name.removesuffix(".tar.gz")
        if not all((root / folder).is_dir() for folder in suite.tests):
            return None  # Lightning's sdists carry no tests
        _copy_tests(suite, root, dest)
    return f"PyPI sdist {sdist.name}"


def _copy_tests(suite: Suite, root: Path, dest: Path) -> None:
    for folder in suite.tests:
        shutil.copytree(root / folder, dest / folder)


def obtain(name: str, mirrors: list[str] | None = None, refresh: bool = False) -> Path:
    """The cached checkout for suite `name` (fetched on first use); raises if no source works."""
    suite = SUITES[name]
    installed = version(suite.dist)
    entry = CACHE / f"{suite.name}-{installed}"
    if (entry / "SOURCE").is_file() and not refresh:
        return entry
    shutil.rmtree(entry, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    tried = []
    for label, attempt in (
        ("git clone", lambda d: _from_clone(suite, installed, d)),
        ("GitHub tarball", lambda d: _from_tarball(suite, installed, d)),
        # The installed version's own tests first: a mirror's tag of it, else its sdist
        # (Accelerate's carries the tests); an older tag of a mirror only when neither has.
        (
            "local git mirror, the installed version's tag",
            lambda d: _from_mirror(suite, installed, d, mirrors or [], exact=True),
        ),
        ("PyPI sdist", lambda d: _from_sdist(suite, installed, d)),
        (
            "local git mirror, an older tag",
            lambda d: _from_mirror(suite, installed, d, mirrors or []),
        ),
    ):
        staging = Path(tempfile.mkdtemp(prefix=f".{suite.name}-", dir=CACHE))
        try:
            origin = attempt(staging)
            if origin:
                note = f"{origin} (installed {suite.dist} {installed})\n"
                (staging / "SOURCE").write_text(note)
                staging.rename(entry)
                return entry
            tried.append(label)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    raise RuntimeError(
        f"No source for {suite.repo} tests matching {suite.dist} {installed}; tried "
        f"{', '.join(tried)}. Put a clone at {entry}/tests with a SOURCE file, or pass "
        "--git-mirror PATH to a local git mirror of the repository."
    )


def source_note(entry: Path) -> str:
    return (entry / "SOURCE").read_text().strip()
